"""Plot a run's curves from WORKDIR/metrics.jsonl: train loss, and every eval_* metric it has.

    python scripts/plot_metrics.py runs/vla_tiny/metrics.jsonl --out docs/vla_tiny_curve.png
"""

import argparse
import json
import pathlib
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RATIO_KEYS = ("accuracy", "bits_per_byte", "l1")  # eval metrics drawn on the right-hand panel


def read_records(path: pathlib.Path) -> list[dict]:
    if not path.is_file():
        raise SystemExit(f"plot_metrics: error: {path} does not exist; pass a run's metrics.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


def plot(records: list[dict], title: str, out: pathlib.Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for key in ("loss", "eval_loss"):
        steps, values = series(records, key)
        if steps:
            left.plot(steps, values, marker="o" if key.startswith("eval") else None, label=key)
    left.set(xlabel="step", ylabel="cross-entropy (nats / token)", title="loss")
    left.legend()
    eval_keys = sorted({k for r in records for k in r if k.startswith("eval_") and k.endswith(RATIO_KEYS)})
    for key in eval_keys + [k for k in ("unigram_bits_per_byte",) if any(k in r for r in records)]:
        steps, values = series(records, key)
        right.plot(steps, values, marker="o", linestyle="--" if key.startswith("unigram") else "-", label=key)
    for key in sorted({k for r in records for k, v in r.items() if isinstance(v, list)}):
        steps = [r["step"] for r in records if isinstance(r.get(key), list)]
        columns = list(zip(*[r[key] for r in records if isinstance(r.get(key), list)]))
        for index, column in enumerate(columns):
            if min(column) < 1.0:  # dims that are always right add nothing to the picture
                right.plot(steps, column, linestyle=":", marker=".", label=f"{key}[{index}]")
    right.set(xlabel="step", title="held-out metrics")
    right.grid(alpha=0.3)
    if eval_keys:
        right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", type=pathlib.Path)
    parser.add_argument("--out", type=pathlib.Path, default=None, help="PNG path (default: next to metrics.jsonl)")
    parser.add_argument("--title", default=None)
    args = parser.parse_args()
    out = args.out or args.metrics.with_name("curves.png")
    plot(read_records(args.metrics), args.title or str(args.metrics.parent), out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
