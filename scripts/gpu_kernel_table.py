"""The kernels of a GPU dry run's step, ranked by the seconds the schedule estimate prices them at.

Why: `estimate.compute_parts` (jaxpar.compiler.gpu_program) says how much of the step is memory-bound
kernels and launches, not which kernels; this lists them, each multiplied by the trip counts of the
loops around it, with its op_name metadata so it can be traced to jaxpar's source (issue 46).

    python scripts/gpu_kernel_table.py compile --config configs/vla70b.py --dry_run --gpu a100-80gb \
        --gpus_per_node 8 --workdir /tmp/m70          # the dry run, also writing WORKDIR/step.hlo.txt
    python scripts/gpu_kernel_table.py table /tmp/m70/step.hlo.txt --gpu a100-80gb [--top 15] [--by op_name]

The table prices each kernel as gpu_program does (max(FLOPs / matmul rate, bytes / HBM) + launch); a
conditional counts its costliest branch. "GPU-compiled, no device": these are estimates.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re
import sys


def compile_and_save(argv: list[str]) -> int:
    """Run the trainer's dry run, saving the compiled GPU program's text next to dry_run.json."""
    from jaxpar.compiler import gpu_aot

    gpu_aot.prepare_environment()  # before JAX starts, as the trainer does
    import jaxpar.compiler.dry_run as dry_run
    from jaxpar import train

    workdir = pathlib.Path(argv[argv.index("--workdir") + 1])
    original = dry_run.schedule_fields

    def saving(mesh, gpu, text, model_flops):
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "step.hlo.txt").write_text(text)
        return original(mesh, gpu, text, model_flops)

    dry_run.schedule_fields = saving
    return train.main(argv)


class _Table:
    """A walk of the program like gpu_program._Walker's, recording each kernel's seconds x trips."""

    def __init__(self, text: str, gpu: str):
        from jaxpar.compiler import gpu_program, hardware, hlo_collectives

        self.gp, self.hc = gpu_program, hlo_collectives
        self.hw = hardware.get(gpu)
        walker = gpu_program._Walker.__new__(gpu_program._Walker)
        walker.comps, walker.entry = hlo_collectives.parse_module(text)
        walker.hw, walker.matmul_rate = self.hw, self.hw.peak_flops * gpu_program.MATMUL_EFFICIENCY
        walker.flops_memo = {}
        self.walker = walker
        self.rows: list[dict] = []

    def kernel(self, ins: dict, instrs: dict) -> dict:
        flops, nbytes = self.walker.kernel_cost(ins, instrs)
        matmul_s, memory_s = flops / self.walker.matmul_rate, nbytes / (self.hw.hbm_tbps * 1e12)
        return {"name": ins["name"], "op": ins["op"], "op_name": self.op_name(ins),
                "matmul_s": matmul_s if matmul_s >= memory_s else 0.0,
                "memory_s": memory_s if memory_s > matmul_s else 0.0, "bytes": nbytes,
                "launch_s": self.gp.KERNEL_LAUNCH_S, "shape": ins["shape"][:80]}

    def op_name(self, ins: dict) -> str:
        """The kernel's op_name, or for a fusion without one its fused root's (else the first inside)."""
        name = re.search(r'op_name="([^"]*)"', ins["attrs"])
        if name:
            return name.group(1)
        called = self.hc._called(ins) if ins["op"] == "fusion" else []
        body = self.walker.comps.get(called[0], []) if called else []
        for i in body[::-1]:
            name = re.search(r'op_name="([^"]*)"', i["attrs"])
            if name:
                return name.group(1) + " (inside)"
        return ""

    def walk(self, comp: str, trips: float, depth: int = 0) -> list[dict]:
        """Kernels of `comp`, each with `trips` (times it runs per step)."""
        out: list[dict] = []
        if depth > 64:
            return out
        body = self.walker.comps.get(comp, [])
        instrs = {i["name"]: i for i in body}
        for ins in body:
            op = ins["op"]
            if op in self.gp._FREE or op.endswith("-done"):
                continue
            if op == "while":
                inner, n = self.hc._while_parts(self.walker.comps, ins, instrs)
                if inner is not None and n:
                    out += self.walk(inner, trips * n, depth + 1)
            elif op == "conditional":
                branches = [self.walk(c, trips, depth + 1) for c in self.hc._called(ins)]
                if branches:
                    out += max(branches, key=lambda b: sum(_seconds(r) for r in b))
            elif op in ("call", "async-start") and not self._collective(ins):
                for callee in self.hc._called(ins):
                    out += self.walk(callee, trips, depth + 1)
            elif self._collective(ins) or op in ("copy-start", "fusion-start") and ":S(5)" in ins["shape"]:
                continue
            else:
                out.append({**self.kernel(ins, instrs), "trips": trips, "comp": comp})
        return out

    def _collective(self, ins: dict) -> bool:
        op = ins["op"]
        base = op[:-len("-start")] if op.endswith("-start") else op
        if op == "async-start":
            return any(i["op"] in self.hc.OPS for c in self.hc._called(ins) for i in self.walker.comps.get(c, []))
        return base in self.hc.OPS


def _seconds(row: dict) -> float:
    return (row["matmul_s"] + row["memory_s"] + row["launch_s"]) * row.get("trips", 1)


def _off_matmul(row: dict) -> float:
    return (row["memory_s"] + row["launch_s"]) * row.get("trips", 1)


def table(path: str, gpu: str, top: int, by: str) -> None:
    t = _Table(pathlib.Path(path).read_text(), gpu)
    rows = t.walk(t.walker.entry, 1.0)
    total = collections.Counter()
    for r in rows:
        for k in ("matmul_s", "memory_s", "launch_s"):
            total[k] += r[k] * r["trips"]
        total["kernels"] += r["trips"]
    print(f"kernels {total['kernels']:.0f}, matmul {total['matmul_s']:.3f} s, memory {total['memory_s']:.3f} s, "
          f"launch {total['launch_s']:.3f} s")
    report = pathlib.Path(path).with_name("dry_run.json")
    if report.exists():  # the walk above must agree with the dry run's own (a branch choice may differ)
        parts = json.loads(report.read_text()).get("estimate", {}).get("compute_parts", {})
        print("dry_run.json's compute_parts:", {k: round(v, 4) for k, v in parts.items()})
    print(f"\n{'memory_s':>9} {'launch_s':>9} {'kernels':>8}  bucket")
    for label, memory_s, launch_s, kernels in buckets(rows):
        print(f"{memory_s:9.4f} {launch_s:9.4f} {kernels:8.0f}  {label}")
    groups: dict[str, dict] = {}
    for r in rows:
        key = r["name"] if by == "kernel" else _short(r["op_name"]) + ("" if by == "op_name" else f" [{r['op']}]")
        g = groups.setdefault(key, {"memory_s": 0.0, "launch_s": 0.0, "matmul_s": 0.0, "kernels": 0.0,
                                    "bytes": 0.0, "example": r})
        if _off_matmul(r) > _off_matmul(g["example"]):
            g["example"] = r  # the group's costliest kernel off the matmul roofline
        for k in ("memory_s", "launch_s", "matmul_s"):
            g[k] += r[k] * r["trips"]
        g["kernels"] += r["trips"]
        g["bytes"] += r["bytes"] * r["trips"]
    for metric in ("memory_s", "launch_s"):
        print(f"\ntop {top} by {metric}:")
        print(f"{'memory_s':>9} {'launch_s':>9} {'kernels':>8} {'GB':>8}  source")
        for key, g in sorted(groups.items(), key=lambda kv: -kv[1][metric])[:top]:
            ex = g["example"]
            print(f"{g['memory_s']:9.4f} {g['launch_s']:9.4f} {g['kernels']:8.0f} {g['bytes'] / 1e9:8.2f}  {key}"
                  f"  <{ex['name']} x{ex['trips']:.0f} {ex['shape']}>")


# (label, test on a row): the first that matches names a kernel's bucket (vla70b's step, issue 46)
BUCKETS = (
    ("pipeline: chunk weights sliced per slot", lambda r: re.search(r"pipeline_[FBW]/dynamic_slice$", r["op_name"])),
    ("pipeline: fp32 gradient accumulation", lambda r: re.search(r"pipeline_[BW]/dynamic_update_slice$", r["op_name"])),
    ("pipeline: stash writes / reads", lambda r: "dynamic_update_index_in_dim" in r["op_name"]
     or re.search(r"bf16\[81,", r["shape"]) and r["op"] == "copy"),
    ("layout transposes (tp gathers / scatters along s)", lambda r: "transpose" in r["name"]
     and r["op"] == "fusion" and re.search(r"296,8,8192|8,296,8192|8192,8,296", r["shape"])),
    ("GEMMs priced by bytes", lambda r: r["op"] == "custom-call" and "cudnn" not in r["name"]),
    ("optimizer update (AdamW, casts)", lambda r: r["op_name"].startswith("jit(train_step)/")
     and "shard_map" not in r["op_name"]),
    ("LLM layer, other (norms, rope, softmax, masks)", lambda r: "pipeline_" in r["op_name"]),
    ("outside the ticks (ViT, first input, head, norms of grads)", lambda r: True),
)


def buckets(rows: list[dict]) -> list[tuple[str, float, float, float]]:
    """(label, memory-bound s, launch s, kernels) per bucket, costliest first."""
    out = {label: [0.0, 0.0, 0.0] for label, _ in BUCKETS}
    for r in rows:
        label = next(label for label, test in BUCKETS if test(r))
        out[label][0] += r["memory_s"] * r["trips"]
        out[label][1] += r["launch_s"] * r["trips"]
        out[label][2] += r["trips"]
    return sorted(((k, *v) for k, v in out.items()), key=lambda row: -row[1])


def _short(op_name: str) -> str:
    """op_name without the jit/transpose wrappers that repeat on every kernel."""
    return re.sub(r"^jit\([^)]*\)/", "", op_name)[:160]


def main(argv: list[str]) -> int:
    if argv and argv[0] == "compile":
        return compile_and_save(argv[1:])
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["table"])
    parser.add_argument("path")
    parser.add_argument("--gpu", default="a100-80gb")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--by", choices=["op_name", "op", "kernel"], default="op_name")
    args = parser.parse_args(argv)
    table(args.path, args.gpu, args.top, args.by)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
