"""Export a run's checkpoint as a Hugging Face Llama directory.

    python -m jaxpar.export --workdir W --out DIR [--step N]

Reads W/config.json (written by every run) and the checkpoint of step N (default: the latest), from
whatever layout it was trained on, and writes DIR loadable with
`transformers.LlamaForCausalLM.from_pretrained(DIR)` (jaxpar.hf_llama has the tensor mapping). The
fp32 master weights are exported when the run kept them (precision=bf16), else the weights.
Known limit: the whole train state (optimizer moments included) is restored on one device, so the
host needs about 16 bytes per parameter; a VLA is refused.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys

from jaxpar.cli import OneLineArgumentParser, main_with_one_line_errors
from jaxpar.errors import ConfigError


def single_device(config):
    """`config` on one device: the checkpoint reshards onto it whatever layout wrote it."""
    from jaxpar.config import MeshConfig, PipelineConfig, ZeroConfig

    return dataclasses.replace(config, mesh=MeshConfig(), zero=ZeroConfig(), pipeline=PipelineConfig(),
                               offload=dataclasses.replace(config.offload, optimizer=False))


def run(argv: list[str]) -> int:
    parser = OneLineArgumentParser(prog="python -m jaxpar.export", usage_hint="--workdir W --out DIR [--step N]")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--step", type=int, default=None)
    args = parser.parse_args(argv)
    workdir = pathlib.Path(args.workdir)
    if not (workdir / "config.json").is_file():
        raise ConfigError(f"{workdir}/config.json not found; --workdir must be a jaxpar run's directory")
    from jaxpar.config import Config, from_dict

    config = from_dict(Config, json.loads((workdir / "config.json").read_text()))
    if config.model.kind != "llama":
        raise ConfigError(f"{workdir} trained a {config.model.kind}; export writes Llama models only so far")
    config = single_device(config)

    import jax

    from jaxpar import hf_llama
    from jaxpar.checkpoint import Checkpointer
    from jaxpar.mesh import Layout
    from jaxpar.parallel.step import StepBuilder

    builder = StepBuilder(config, Layout.for_config(config).make_mesh())
    checkpoints = Checkpointer(workdir, config)
    steps = checkpoints.all_steps()
    if not steps:
        raise ConfigError(f"{checkpoints.directory} has no checkpoint to export")
    if args.step is not None and args.step not in steps:
        raise ConfigError(f"--step {args.step} is not among the checkpoints {sorted(steps)}")
    state, step, _ = checkpoints.restore(builder.abstract_state(), args.step)
    checkpoints.close()
    weights = jax.device_get(state.master if state.master is not None else state.params)
    out = hf_llama.write(builder.to_model_order(weights), config.model, args.out)
    print(f"wrote step {step} of {workdir} to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return main_with_one_line_errors(run, argv)


if __name__ == "__main__":
    sys.exit(main())
