"""Tokenize a directory of text files into token shards for jaxpar (train and held-out splits).

    python scripts/prepare_text.py DIR OUT [--tokenizer byte|PATH.model|PATH.json] [--heldout 0.05]
        [--pattern '**/*.py'] [--max_bytes N]

Writes OUT/train and OUT/heldout (whole files go to one split, chosen by a hash of their path), each
with tokens_NNNNN.npy shards and meta.json (jaxpar/data/text.py documents the format); prints the
held-out unigram baseline in bits per byte. Point data.train / data.eval at the two directories.
Example with the Python standard library, which every machine has:

    python scripts/prepare_text.py "$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')" \\
        data/pystdlib --pattern '**/*.py'
"""

import argparse
import pathlib
import sys

from jaxpar.data.text import prepare_text
from jaxpar.errors import ConfigError


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=pathlib.Path, help="directory of text files (searched recursively)")
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--tokenizer", default="byte", help="byte, or a local sentencepiece .model / tokenizers .json")
    parser.add_argument("--heldout", type=float, default=0.05, help="fraction of files held out")
    parser.add_argument("--pattern", default="**/*", help="glob of the files to read, relative to DIR")
    parser.add_argument("--max_bytes", type=int, default=0, help="stop after this much text (0: all)")
    args = parser.parse_args()
    try:
        metas = prepare_text(args.dir, args.out / "train", args.out / "heldout", args.tokenizer, args.heldout,
                             args.pattern, args.max_bytes)
    except ConfigError as err:
        print(f"prepare_text: error: {err}", file=sys.stderr)
        return 2
    for name, meta in metas.items():
        print(f"{name}: {meta['files']} files, {meta['bytes']:,} bytes -> {meta['tokens']:,} tokens "
              f"in {meta['shards']} shard(s) under {args.out / name}")
    print(f"unigram baseline on the held-out split: {metas['heldout']['unigram_bits_per_byte']:.3f} bits per byte")
    return 0


if __name__ == "__main__":
    sys.exit(main())
