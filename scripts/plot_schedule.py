"""Render a pipeline schedule table as a PNG: stages as rows, every executed F/B/W slot as a column.

    python scripts/plot_schedule.py --schedule 1f1b --stages 4 --microbatches 8 --out docs/schedule_1f1b_p4_m8.png
    python scripts/plot_schedule.py --schedule 1f1b --virtual 2 --out docs/schedule_interleaved_p4_m8_v2.png
    python scripts/plot_schedule.py --schedule zb --out docs/schedule_zb_p4_m8.png

The picture is drawn from jaxpar.parallel.schedule, the same table that drives the training scan. A
column is drawn for each kind active in a tick, because in lockstep SPMD that is what costs time:
grey cells are the masked garbage other stages compute meanwhile (the bubble). A column is as wide
as its kind costs (Schedule.costs), so grey area is bubble time. Columns are grouped
by tick (thin gaps) and by phase (labelled above); a red frame marks the loss slot on the last stage.
With interleaving a cell reads "microbatch/chunk" and later chunks are drawn lighter.
"""

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

from jaxpar.parallel.schedule import IDLE, SCHEDULES, build  # noqa: E402

COLOURS = {"F": "#4c72b0", "B": "#55a868", "W": "#dd8452"}
IDLE_COLOUR = "#e5e5e5"
TICK_GAP, PHASE_GAP = 0.25, 0.9


def shade(colour: str, chunk: int, virtual: int) -> tuple:
    """Lighter for later chunks: mix with white up to 45%."""
    mix = 0.45 * chunk / max(virtual - 1, 1)
    return tuple(c + (1 - c) * mix for c in to_rgb(colour))


def layout(table) -> list[tuple[float, object]]:
    """x position of every executed slot, its width its cost (so area is time): gaps between ticks
    and wider ones between phases."""
    positions, x, tick, phase_of = [], 0.0, None, {}
    for phase in table.phases:
        for t in range(phase.first, phase.first + phase.count):
            phase_of[t] = phase
    for slot in table.slots():
        if tick is not None and slot.tick != tick:
            x += PHASE_GAP if phase_of[slot.tick] is not phase_of[tick] else TICK_GAP
        positions.append((x, slot))
        x, tick = x + table.costs[slot.kind], slot.tick
    return positions


def draw_cells(ax, table, positions) -> None:
    last = table.stages - 1
    for x, slot in positions:
        w = table.costs[slot.kind] - 0.06
        for stage, (mb, chunk) in enumerate(zip(slot.microbatch_per_stage, slot.chunk_per_stage)):
            colour = IDLE_COLOUR if mb == IDLE else shade(COLOURS[slot.kind], chunk, table.virtual)
            ax.add_patch(Rectangle((x, stage), w, 0.9, color=colour))
            if mb == IDLE:
                continue
            label = f"{mb}/{chunk}" if table.virtual > 1 else str(mb)
            ax.text(x + w / 2, stage + 0.45, label, ha="center", va="center",
                    fontsize=6 if table.virtual > 1 else 7, color="black" if chunk else "white")
            if slot.kind == "F" and stage == last and table.loss[slot.tick] == mb and chunk == table.virtual - 1:
                ax.add_patch(Rectangle((x + 0.03, stage + 0.03), 0.88, 0.84, fill=False, ec="#c44e52", lw=1.6))


def draw_phase_labels(ax, table, positions) -> None:
    """Phase name and tick count above its columns, the tick numbers below the last stage."""
    xs = {}
    for x, slot in positions:
        xs.setdefault(slot.tick, []).extend([x, x + table.costs[slot.kind] - 0.06])
    for phase in table.phases:
        ticks = range(phase.first, phase.first + phase.count)
        lo, hi = min(xs[ticks[0]]), max(xs[ticks[-1]])
        ax.annotate("", (lo, -0.15), (hi, -0.15), arrowprops={"arrowstyle": "-", "color": "0.4"})
        ax.text((lo + hi) / 2, -0.3, f"{phase.kinds} x{phase.count}", ha="center", va="bottom", fontsize=8)
    step = max(1, table.ticks // 30)
    for tick, columns in xs.items():
        if tick % step == 0:
            ax.text((columns[0] + columns[-1]) / 2, table.stages + 0.15, str(tick),
                    ha="center", va="top", fontsize=6, color="0.35")


def plot(kind: str, stages: int, microbatches: int, virtual: int, out: str):
    table = build(kind, stages, microbatches, virtual)
    positions = layout(table)
    width = positions[-1][0] + table.costs[positions[-1][1].kind]
    fig, ax = plt.subplots(figsize=(max(7.0, 0.2 * width + 1.5), 0.5 * stages + 2.0))
    draw_cells(ax, table, positions)
    draw_phase_labels(ax, table, positions)
    ax.set_xlim(-0.2, width)
    ax.set_ylim(stages + 0.7, -0.9)
    ax.set_yticks([s + 0.45 for s in range(stages)], [f"stage {s}" for s in range(stages)])
    ax.set_xticks([])
    for spine in ax.spines.values():
        spine.set_visible(False)
    costs = "F=B=W=1" if kind == "zb" else "F=1, B=2"
    name = f"{kind.upper()}" + (f" interleaved v={virtual}" if virtual > 1 else "")
    cell = "microbatch/chunk" if virtual > 1 else "microbatch"
    ax.set_title(f"{name}  p={stages}  m={microbatches}: bubble {table.bubble_fraction():.1%} (costs {costs}), "
                 f"{table.stash_slots} stash slots (peak in flight per stage {table.in_flight().tolist()})",
                 fontsize=9)
    ax.set_xlabel(f"executed slot columns, grouped by tick (number below) and phase; width = cost; cell = {cell}",
                  fontsize=8)
    handles = [Patch(color=COLOURS[k], label=k) for k in "FBW" if k != "W" or kind == "zb"]
    if virtual > 1:
        handles.append(Patch(color=shade(COLOURS["F"], virtual - 1, virtual), label=f"chunk {virtual - 1} (lighter)"))
    handles += [Patch(color=IDLE_COLOUR, label="idle (bubble)"),
                Patch(fill=False, ec="#c44e52", lw=1.6, label="loss (L) on the last stage")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(handles),
              frameon=False, fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--virtual", type=int, default=1, help="model chunks per stage (interleaved 1f1b)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    name = "interleaved" if args.virtual > 1 else args.schedule
    out = args.out or f"schedule_{name}_p{args.stages}_m{args.microbatches}" + \
        (f"_v{args.virtual}" if args.virtual > 1 else "") + ".png"
    try:
        table = plot(args.schedule, args.stages, args.microbatches, args.virtual, out)
    except ValueError as error:
        parser.error(str(error))
    print(f"wrote {out} (bubble {table.bubble_fraction():.4f}, stash slots {table.stash_slots})")

if __name__ == "__main__":
    main()
