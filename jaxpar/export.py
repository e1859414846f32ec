"""Export a run's checkpoint as a Hugging Face Llama directory.

    python -m jaxpar.export --workdir W --out DIR [--step N]

Reads W/config.json (written by every run) and the checkpoint of step N (default: the latest), from
whatever layout it was trained on, and writes DIR loadable with
`transformers.LlamaForCausalLM.from_pretrained(DIR)` (jaxpar.hf_llama has the tensor mapping), with
the run's tokenizer file when its training data was made with one (and, from a Hugging Face tokenizer
directory, its tokenizer_config.json / chat template), and generation_config.json's `eos_token_id`:
every id the run ends a sequence with (run_eos_ids), which transformers' generate reads before
config.json's. The fp32 master weights are
exported when the run kept them (precision=bf16), else the weights.
Only the weights are read from the checkpoint (jaxpar.checkpoint's partial restore: the optimizer
moments stay on disk), onto one device: 4 bytes per parameter. A VLA is written as DIR/llm (Llama) and DIR/vision (a
SiglipVisionModel, with projector.safetensors next to it); its encoder must be SigLIP-shaped
(vision.bias=true, no FiLM).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import sys

from jaxpar.cli import OneLineArgumentParser, main_with_one_line_errors
from jaxpar.errors import ConfigError


def single_device(config):
    """`config` on one device: the checkpoint reshards onto it whatever layout wrote it."""
    from jaxpar.config import MeshConfig, PipelineConfig, ZeroConfig

    return dataclasses.replace(config, mesh=MeshConfig(), zero=ZeroConfig(), pipeline=PipelineConfig(),
                               offload=dataclasses.replace(config.offload, optimizer=False))


def restore_weights(workdir: pathlib.Path, step: int | None = None):
    """(the run's Config, its step, its weights as host numpy, the LLM's in model layer order; a VLA's
    include "vit" and "projector") from `workdir`'s checkpoint of `step` (default: the latest),
    whatever layout wrote it."""
    if not (workdir / "config.json").is_file():
        raise ConfigError(f"{workdir}/config.json not found; --workdir must be a jaxpar run's directory")
    from jaxpar.config import Config, from_dict

    config = from_dict(Config, json.loads((workdir / "config.json").read_text()))
    single = single_device(config)

    import jax

    from jaxpar.checkpoint import Checkpointer
    from jaxpar.mesh import Layout
    from jaxpar.parallel.step import StepBuilder

    builder = StepBuilder(single, Layout.for_config(single).make_mesh())
    checkpoints = Checkpointer(workdir, single)
    steps = checkpoints.all_steps()
    if not steps:
        raise ConfigError(f"{checkpoints.directory} has no checkpoint")
    if step is not None and step not in steps:
        raise ConfigError(f"--step {step} is not among the checkpoints {sorted(steps)}")
    abstract = builder.abstract_state()
    field = "master" if abstract.master is not None else "params"
    weights, step = checkpoints.restore_weights(field, getattr(abstract, field), step)
    checkpoints.close()
    return config, step, builder.to_model_order(jax.device_get(weights))


def run_tokenizer_file(config) -> pathlib.Path | None:
    """The tokenizer file the run's training data was made with (None: bytes, or synthetic data)."""
    meta = pathlib.Path(config.data.train) / "meta.json" if config.data.train else None
    if meta is None or not meta.is_file():
        return None
    spec = json.loads(meta.read_text()).get("tokenizer", "byte")
    return None if spec == "byte" else pathlib.Path(spec)


def run_tokenizer(config):
    """The run's tokenizer, encoding as its training text was encoded (jaxpar.data.text.split_tokenizer);
    bytes for a text run whose split holds no meta.json; None for synthetic data."""
    from jaxpar.data.text import ByteTokenizer, split_tokenizer

    if not config.data.train:
        return None
    return split_tokenizer(pathlib.Path(config.data.train)) or ByteTokenizer()


def hf_eos_ids(directory) -> list[int]:
    """A Hugging Face directory's end-of-sequence ids as transformers' generate reads them:
    generation_config.json's `eos_token_id` when that file exists (one id or a list, e.g.
    Llama-3-Instruct's <|end_of_text|> and <|eot_id|>), else config.json's."""
    directory = pathlib.Path(directory)
    for name in ("generation_config.json", "config.json"):
        if (directory / name).is_file():
            eos = json.loads((directory / name).read_text()).get("eos_token_id")
            return [int(i) for i in (eos if isinstance(eos, list) else [] if eos is None else [eos])]
    return []


def run_eos_ids(config, tokenizer) -> list[int]:
    """The ids a run's sequences end with: the end-of-document id its text was separated by, then,
    when its text was tokenized with the tokenizer of the Hugging Face model it started from
    (init.from_hf), that model's own ids (an Instruct model still ends its turns with them). With any
    other tokenizer those ids would name other tokens, so they are left out."""
    ids = [int(tokenizer.eos_id)] if getattr(tokenizer, "eos_id", None) is not None else []
    init = pathlib.Path(config.init.llm_dir) if config.init.llm_dir else None
    file = run_tokenizer_file(config)
    if init is not None and file is not None and file.is_file() and (init / "tokenizer.json").is_file():
        if file.read_bytes() == (init / "tokenizer.json").read_bytes():
            ids += [i for i in hf_eos_ids(init) if i not in ids]
    return ids


def _write_tokenizer(config, out: pathlib.Path) -> None:
    """The run's tokenizer file; from a Hugging Face tokenizer directory also the files that say how
    transformers uses it (special tokens, chat template), so the export tokenizes as the original."""
    tokenizer = run_tokenizer_file(config)
    if tokenizer is None or not tokenizer.is_file():
        return
    shutil.copy(tokenizer, out / ("tokenizer.json" if tokenizer.suffix == ".json" else "tokenizer.model"))
    if tokenizer.name == "tokenizer.json":
        for name in ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            if (tokenizer.parent / name).is_file():
                shutil.copy(tokenizer.parent / name, out / name)


def _write_eos_ids(config, out: pathlib.Path) -> None:
    """generation_config.json's eos_token_id (one id, or the list): where transformers' generate stops."""
    file = run_tokenizer_file(config)  # a tokenizer file moved away since training: nothing to read ids from
    eos = run_eos_ids(config, run_tokenizer(config) if file is None or file.is_file() else None)
    if eos:
        path = out / "generation_config.json"
        generation = json.loads(path.read_text()) if path.is_file() else {}
        path.write_text(json.dumps({**generation, "eos_token_id": eos[0] if len(eos) == 1 else eos}, indent=2))


def run(argv: list[str]) -> int:
    parser = OneLineArgumentParser(prog="python -m jaxpar.export", usage_hint="--workdir W --out DIR [--step N]")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--step", type=int, default=None)
    args = parser.parse_args(argv)
    workdir = pathlib.Path(args.workdir)
    config, step, weights = restore_weights(workdir, args.step)
    from jaxpar import hf_llama

    out = pathlib.Path(args.out)
    if config.model.kind == "vla":  # the LLM and the encoder (+ projector) as two Hugging Face directories
        from jaxpar import hf_siglip

        hf_siglip.write_vision({k: weights[k] for k in ("vit", "projector")}, config.vision, out / "vision")
        out = out / "llm"
    llm = {k: v for k, v in weights.items() if k not in ("vit", "projector")}
    out = hf_llama.write(llm, config.model, out)
    _write_tokenizer(config, out)
    _write_eos_ids(config, out)
    print(f"wrote step {step} of {workdir} to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return main_with_one_line_errors(run, argv)


if __name__ == "__main__":
    sys.exit(main())
