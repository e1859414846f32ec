"""CLI: analytic memory / step-time plan of a config, or a recommended layout for a cluster.

    python -m jaxpar.plan --config llama7b.py [--config.KEY=VALUE ...] [--gpu a100-80gb] [--json]
    python -m jaxpar.plan --config vla70b.py --recommend --gpus 64 --gpus_per_node 8 --gpu a100-80gb

A mistake (unknown GPU, impossible cluster, nothing fits) prints one line and exits 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxpar.cli import OneLineArgumentParser, main_with_one_line_errors, parse_with_overrides
from jaxpar.errors import ConfigError


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = OneLineArgumentParser(prog="python -m jaxpar.plan", description=__doc__.splitlines()[0],
                                   usage_hint="--config NAME [--config.KEY=VALUE ...] [--gpu NAME] [--json] "
                                              "[--recommend --gpus N --gpus_per_node 8]")
    parser.add_argument("--config", required=True)
    parser.add_argument("--gpu", default="a100-80gb", help="hardware profile (jaxpar/compiler/hardware.py)")
    parser.add_argument("--hardware_json", default=None, help="JSON file or string overriding profile fields")
    parser.add_argument("--gpus_per_node", type=int, default=8)
    parser.add_argument("--gpus", type=int, default=None, help="with --recommend: cluster size")
    parser.add_argument("--recommend", action="store_true")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--target", choices=("gpu", "cpu"), default="gpu",
                        help="cpu: model XLA:CPU's bf16 widening, to compare with a dry run on this host")
    parser.add_argument("--json", action="store_true")
    return parse_with_overrides(parser, argv)


def run(argv: list[str]) -> int:
    from jaxpar.interop.pretrained import load_run_config
    from jaxpar.planner import recommend, report
    from jaxpar.compiler import hardware

    args, overrides = parse_args(argv)
    hw = hardware.get(args.gpu, hardware.load_overrides(args.hardware_json))
    config = load_run_config(args.config, overrides)
    if args.gpus_per_node < 1:
        raise ConfigError(f"--gpus_per_node={args.gpus_per_node} must be >= 1")
    if args.recommend:
        gpus = args.gpus or config.mesh.size
        result = recommend.recommend(config, gpus, args.gpus_per_node, hw, args.top)
        if args.json:
            print(json.dumps([report.plan(r["config"], hw, args.gpus_per_node) for r in result["ranked"]], indent=2))
        else:
            print(report.format_recommendation(result, gpus, args.gpus_per_node, hw))
        return 0
    if args.gpus_per_node > config.mesh.size and args.gpus is not None and args.gpus_per_node > args.gpus:
        raise ConfigError(f"--gpus_per_node={args.gpus_per_node} is more than --gpus={args.gpus}")
    result = report.plan(config, hw, min(args.gpus_per_node, config.mesh.size), args.target)
    print(json.dumps(result, indent=2) if args.json else report.format_plan(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    return main_with_one_line_errors(run, argv)


if __name__ == "__main__":
    sys.exit(main())
