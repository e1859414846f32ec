"""Generate the procedural manipulation task (jaxpar.data.episodes) as train and held-out splits.

    python scripts/make_vla_data.py data/vla_tiny --episodes 4000 --heldout 500 --image_size 16 --grid 4

The held-out split uses another seed and skips every scene of the train split. configs/vla_tiny.py
generates the same data itself on first use (data.generate=true).
"""

import argparse
import pathlib
import sys

from jaxpar.data.episodes import write_splits
from jaxpar.errors import ConfigError


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--episodes", type=int, default=4000)
    parser.add_argument("--heldout", type=int, default=500)
    parser.add_argument("--image_size", type=int, default=16)
    parser.add_argument("--grid", type=int, default=4, help="cells per side; image_size / grid = the ViT patch")
    parser.add_argument("--steps", type=int, default=8, help="at most; an episode ends on the square")
    parser.add_argument("--cameras", type=int, default=1)
    parser.add_argument("--dims", type=int, default=7, help="action dims: (row, col) moves, zeros, gripper last")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    shape = dict(size=args.image_size, grid=args.grid, steps=args.steps, cameras=args.cameras, dims=args.dims)
    try:
        write_splits(args.out, args.episodes, args.heldout, seed=args.seed, **shape)
    except ConfigError as err:
        print(f"make_vla_data: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.episodes} train and {args.heldout} held-out episodes to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
