"""CLI: analytic memory / step-time plan of a config, or a recommended layout for a cluster.

    python -m jaxpar.plan --config llama7b.py [--config.KEY=VALUE ...] [--gpu a100-80gb] [--json]
    python -m jaxpar.plan --config vla70b.py --recommend --gpus 64 --gpus_per_node 8 --gpu a100-80gb
    python -m jaxpar.plan --config llama7b.py --recommend --gpus 8 --gpu h100 --compile 5

--compile K: the recommender's top K layouts GPU-compiled without a device, one subprocess each, and ranked
again by the compiled peak and XLA's schedule estimate (jaxpar/planner/compiled.py).

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
                                              "[--recommend --gpus N --gpus_per_node 8 [--compile K]]")
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
    parser.add_argument("--compile", type=int, default=None, metavar="K",
                        help="with --recommend: GPU-compile the top K layouts (no device) and rank them again")
    parser.add_argument("--compile_timeout", type=float, default=None, help="seconds per compile (default 3600)")
    parser.add_argument("--compile_dir", default=None, help="keep each compile's dry_run.json and output here")
    return parse_with_overrides(parser, argv)


def run(argv: list[str]) -> int:
    from jaxpar.interop.pretrained import load_run_config
    from jaxpar.planner import compiled, recommend, report
    from jaxpar.compiler import hardware

    args, overrides = parse_args(argv)
    hw = hardware.get(args.gpu, hardware.load_overrides(args.hardware_json))
    config = load_run_config(args.config, overrides)
    if args.gpus_per_node < 1:
        raise ConfigError(f"--gpus_per_node={args.gpus_per_node} must be >= 1")
    if args.compile is not None and not args.recommend:
        raise ConfigError("--compile re-ranks the recommender's layouts: add --recommend --gpus N")
    if args.recommend:
        gpus = args.gpus or config.mesh.size
        if args.compile is not None:
            compiled.check_request(args.compile, args.gpu, args.hardware_json)
        result = recommend.recommend(config, gpus, args.gpus_per_node, hw, max(args.top, args.compile or 0))
        compiled.attach_flags(args.config, result["ranked"])
        if args.compile is not None:
            return _compiled_search(args, result, hw, gpus)
        if args.json:
            print(json.dumps([{**report.plan(r["config"], hw, args.gpus_per_node), "flags": r["flags"]}
                              for r in result["ranked"]], indent=2))
        else:
            print(report.format_recommendation(result, gpus, args.gpus_per_node, hw))
        return 0
    if args.gpus_per_node > config.mesh.size and args.gpus is not None and args.gpus_per_node > args.gpus:
        raise ConfigError(f"--gpus_per_node={args.gpus_per_node} is more than --gpus={args.gpus}")
    result = report.plan(config, hw, min(args.gpus_per_node, config.mesh.size), args.target)
    print(json.dumps(result, indent=2) if args.json else report.format_plan(result))
    return 0


def _compiled_search(args: argparse.Namespace, result: dict, hw, gpus: int) -> int:
    """The recommendation, then its top --compile layouts compiled and ranked again; 1 if none fits."""
    from jaxpar.planner import compiled, report

    if not args.json:
        print(report.format_recommendation(result, gpus, args.gpus_per_node, hw), flush=True)
    rows = compiled.search(result["ranked"], args.config, hw, args.gpus_per_node, args.compile,
                           args.compile_timeout or compiled.COMPILE_TIMEOUT_S, args.compile_dir,
                           progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(compiled.to_json(rows), indent=2) if args.json else report.format_compiled(rows, hw, args.config))
    return 0 if rows and rows[0]["compiled_fits"] else 1


def main(argv: list[str] | None = None) -> int:
    return main_with_one_line_errors(run, argv)


if __name__ == "__main__":
    sys.exit(main())
