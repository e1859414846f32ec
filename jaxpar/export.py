"""Export a run's checkpoint as a Hugging Face Llama directory.

    python -m jaxpar.export --workdir W --out DIR [--step N]

Reads W/config.json (written by every run) and the checkpoint of step N (default: the latest), from
whatever layout it was trained on, and writes DIR loadable with
`transformers.LlamaForCausalLM.from_pretrained(DIR)` (jaxpar.interop.hf_llama has the tensor mapping), with
the run's tokenizer file when its training data was made with one (and, from a Hugging Face tokenizer
directory, its tokenizer_config.json / chat template), and generation_config.json's `eos_token_id`:
every id the run ends a sequence with (run_eos_ids), which transformers' generate reads before
config.json's. The fp32 master weights are
exported when the run kept them (precision=bf16), else the weights.
Only the weights are read from the checkpoint (jaxpar.parallel.checkpoint's partial restore: the optimizer
moments stay on disk), onto one device: 4 bytes per parameter. A VLA is written as DIR/llm (Llama) and DIR/vision (a
SiglipVisionModel, with projector.safetensors next to it); its encoder must be SigLIP-shaped
(vision.bias=true, no FiLM).
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


def run(argv: list[str]) -> int:
    parser = OneLineArgumentParser(prog="python -m jaxpar.export", usage_hint="--workdir W --out DIR [--step N]")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--step", type=int, default=None)
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
    out = hf_llama.write(llm, config.model, out)
    _write_tokenizer(config, out)
    _write_eos_ids(config, out)
    print(f"wrote step {step} of {workdir} to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return main_with_one_line_errors(run, argv)


if __name__ == "__main__":
    sys.exit(main())
