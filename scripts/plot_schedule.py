"""Render a pipeline schedule table as a PNG: stages as rows, executed F/B slots as columns.

    python scripts/plot_schedule.py --stages 4 --microbatches 8 --schedule 1f1b --out docs/schedule_1f1b_p4_m8.png

The picture is drawn from jaxpar.parallel.schedule, the same table that drives the training scan.
"""

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from jaxpar.parallel.schedule import IDLE, SCHEDULES, build, ideal_bubble  # noqa: E402

COLOURS = {"F": "#4c72b0", "B": "#55a868", "idle": "#e5e5e5"}


def plot(kind: str, stages: int, microbatches: int, out: str) -> float:
    table = build(kind, stages, microbatches)
    slots = table.slots()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.32 * len(slots)), 0.55 * stages + 1.4))
    for column, slot in enumerate(slots):
        for stage, mb in enumerate(slot.microbatch_per_stage):
            colour = COLOURS["idle"] if mb == IDLE else COLOURS[slot.kind]
            ax.add_patch(plt.Rectangle((column, stage), 0.95, 0.9, color=colour))
            if mb != IDLE:
                ax.text(column + 0.47, stage + 0.45, str(mb), ha="center", va="center", fontsize=7, color="white")
    ax.set_xlim(0, len(slots))
    ax.set_ylim(stages, 0)
    ax.set_yticks([s + 0.45 for s in range(stages)], [f"stage {s}" for s in range(stages)])
    ax.set_xlabel("executed slots (one forward or backward of one microbatch each; number = microbatch)")
    bubble = table.idle_fraction()
    ax.set_title(f"{kind.upper()}  p={stages}  m={microbatches}: bubble {bubble:.1%} "
                 f"(ideal (p-1)/(m+p-1) = {ideal_bubble(stages, microbatches):.1%})\n"
                 f"at most {table.in_flight().max()} microbatches in flight per stage", fontsize=10)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(handles=[Patch(color=COLOURS[k], label=k if k != "idle" else "idle (bubble)") for k in COLOURS],
              loc="upper right", bbox_to_anchor=(1.0, -0.25), ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return bubble


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = args.out or f"schedule_{args.schedule}_p{args.stages}_m{args.microbatches}.png"
    bubble = plot(args.schedule, args.stages, args.microbatches, out)
    print(f"wrote {out} (bubble {bubble:.4f})")


if __name__ == "__main__":
    main()
