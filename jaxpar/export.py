"""Export a run's checkpoint as a Hugging Face Llama directory.

    python -m jaxpar.export --workdir W --out DIR [--step N] [--dtype bf16|fp32]

Reads W/config.json (written by every run) and the checkpoint of step N (default: the latest), from
whatever layout it was trained on, and writes DIR loadable with
`transformers.LlamaForCausalLM.from_pretrained(DIR)` (jaxpar.interop.hf_llama has the tensor mapping), with
the run's tokenizer file when its training data was made with one (and, from a Hugging Face tokenizer
directory, its tokenizer_config.json / chat template), and generation_config.json's `eos_token_id`:
every id the run ends a sequence with (run_eos_ids), which transformers' generate reads before
config.json's. The fp32 master weights are
read when the run kept them (precision=bf16), else the weights, and written in --dtype (default: the
run's compute dtype, bf16 for precision=bf16; config.json's torch_dtype says which). config.json's
max_position_embeddings is the run's own: its Hugging Face init's (model.max_position), else the
sequence it trained on.
Only the weights are read from the checkpoint (jaxpar.parallel.checkpoint's partial restore: the optimizer
moments stay on disk), onto one device: 4 bytes per parameter. A VLA is written as DIR/llm (Llama) and DIR/vision (a
SiglipVisionModel, with projector.safetensors next to it); its encoder must be SigLIP-shaped
(vision.bias=true, no FiLM); the vision directory is written in fp32 whatever --dtype says.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

from jaxpar.cli import OneLineArgumentParser, main_with_one_line_errors
from jaxpar.inference.loader import restore_weights, run_eos_ids, run_tokenizer, run_tokenizer_file


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


def max_positions(config) -> int:
    """The positions the exported LLM is meant for: its Hugging Face init's max_position_embeddings,
    else the sequence this run trained on (a VLA's: image + instruction + action tokens)."""
    if config.model.max_position:
        return config.model.max_position
    if config.model.kind == "vla":
        from jaxpar.config import vla_sequence_layout

        return vla_sequence_layout(config)[2]
    return config.train.seq_len


def run(argv: list[str]) -> int:
    parser = OneLineArgumentParser(prog="python -m jaxpar.export", usage_hint="--workdir W --out DIR [--step N] [--dtype bf16|fp32]")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=None)  # default: the run's compute dtype
    args = parser.parse_args(argv)
    workdir = pathlib.Path(args.workdir)
    config, step, weights = restore_weights(workdir, args.step)
    from jaxpar.interop import hf_llama

    out = pathlib.Path(args.out)
    if config.model.kind == "vla":  # the LLM and the encoder (+ projector) as two Hugging Face directories
        from jaxpar.interop import hf_siglip

        hf_siglip.write_vision({k: weights[k] for k in ("vit", "projector")}, config.vision, out / "vision")
        out = out / "llm"
    llm = {k: v for k, v in weights.items() if k not in ("vit", "projector")}
    dtype = args.dtype or ("bf16" if config.bf16_compute else "fp32")
    out = hf_llama.write(llm, config.model, out, max_positions(config), dtype)
    _write_tokenizer(config, out)
    _write_eos_ids(config, out)
    print(f"wrote step {step} of {workdir} to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return main_with_one_line_errors(run, argv)


if __name__ == "__main__":
    sys.exit(main())
