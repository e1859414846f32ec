"""Generate the procedural manipulation task (jaxpar.data.episodes) as train and held-out splits.

    python scripts/make_vla_data.py data/vla_tiny --episodes 4000 --heldout 500 --image_size 16 --grid 4
    python scripts/make_vla_data.py data/vla_lerobot --format lerobot --video_size 64 --codec av1

The held-out split uses another seed and skips every scene of the train split. --format npz (default)
writes one episode_NNNNN.npz per episode; --format lerobot writes each split as a Hugging Face LeRobot
v3.0 dataset (jaxpar.data.lerobot_write: parquet + mp4, frames upscaled to --video_size). configs/vla_tiny.py
generates the npz data itself on first use (data.generate=true).
"""

import argparse
import pathlib
import sys

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
    parser.add_argument("--format", choices=("npz", "lerobot"), default="npz")
    parser.add_argument("--video_size", type=int, default=None, help="lerobot: video frame size (default 64), "
                        "a multiple of image_size: frames are upscaled nearest-neighbour")
    parser.add_argument("--codec", default=None, help="lerobot: video codec, av1 (default) or h264")
    args = parser.parse_args()
    shape = dict(size=args.image_size, grid=args.grid, steps=args.steps, cameras=args.cameras, dims=args.dims)
    try:
        if args.format == "lerobot":
            from jaxpar.data.lerobot_write import write_lerobot_splits

            write_lerobot_splits(args.out, args.episodes, args.heldout, seed=args.seed,
                                 video_size=64 if args.video_size is None else args.video_size,
                                 codec=args.codec or "av1", **shape)
        elif args.video_size is not None or args.codec is not None:
            raise ConfigError("--video_size and --codec apply to --format lerobot; npz episodes store raw images")
        else:
            from jaxpar.data.episodes import write_splits

            write_splits(args.out, args.episodes, args.heldout, seed=args.seed, **shape)
    except ConfigError as err:
        print(f"make_vla_data: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.episodes} train and {args.heldout} held-out episodes ({args.format}) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
