"""Export a run's checkpoint as a Hugging Face Llama directory.

    python -m jaxpar.export --workdir W --out DIR [--step N]

Reads W/config.json (written by every run) and the checkpoint of step N (default: the latest), from
whatever layout it was trained on, and writes DIR loadable with
`transformers.LlamaForCausalLM.from_pretrained(DIR)` (jaxpar.hf_llama has the tensor mapping), with
the run's tokenizer file when its training data was made with one. The fp32 master weights are
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
    tokenizer = run_tokenizer_file(config)
    if tokenizer is not None and tokenizer.is_file():
        shutil.copy(tokenizer, out / ("tokenizer.json" if tokenizer.suffix == ".json" else "tokenizer.model"))
    print(f"wrote step {step} of {workdir} to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return main_with_one_line_errors(run, argv)


if __name__ == "__main__":
    sys.exit(main())
