"""Generate the procedural manipulation task (jaxpar.data.episodes) as train and held-out splits.

    python scripts/make_vla_data.py data/vla_tiny --episodes 200 --heldout 40 --image_size 16

Different seeds for the two splits: the held-out scenes never appear in training.
"""

import argparse
import pathlib

from jaxpar.data.episodes import write_split


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--heldout", type=int, default=40)
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--cameras", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    shape = dict(size=args.image_size, steps=args.steps, cameras=args.cameras)
    write_split(args.out / "train", args.episodes, seed=args.seed, **shape)
    write_split(args.out / "heldout", args.heldout, seed=args.seed + 1_000_003, **shape)
    print(f"wrote {args.episodes} train and {args.heldout} held-out episodes to {args.out}")


if __name__ == "__main__":
    main()
