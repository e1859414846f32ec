"""Time in the scheduled GPU program: which collectives overlap compute, and the step time it implies.

Why: a GPU dry run (jaxpar.compiler.gpu_aot) gives XLA's own schedule of the step, with each async collective's
start and done placed where the latency-hiding scheduler put them. Reading time off that schedule says
what overlaps (ZeRO-3 prefetch, the pipeline's early dp reductions, tp all-reduces) in the program that
would run, where the planner (jaxpar.planner.cost) can only assume it. No device: every second here is
a model, a roofline walk of the schedule, not a measurement.

The model:
- A compiled GPU module is scheduled (`is_scheduled=true`): within a computation, instructions run in
  text order on one compute stream; async collectives (`*-start` .. `*-done`, or an `async-start`
  wrapping one) run one after another on one communication stream, host copies (`copy-start`, and
  a `fusion-start` slicing host memory: offload.params' per-layer copies) on their own.
- A kernel (fusion, library call, copy, ...) costs max(FLOPs / (peak x MATMUL_EFFICIENCY), bytes /
  HBM bandwidth) + KERNEL_LAUNCH_S; an FP8 cuBLASLt GEMM at the FP8 peak (jaxpar.compiler.hardware). FLOPs (jaxpar.compiler.hlo_collectives's): dots and convolutions inside it, cuBLAS
  GEMMs, cuDNN flash attention (hlo_flops.fmha_flops: 4 b h sq sk d forward, 2.5 times that backward, which
  recomputes the scores; half with a causal mask, whose masked blocks the kernel skips). Bytes: operands
  read plus results written; a fusion operand it only slices counts its slices (also when it slices the operand
  as a dynamic-update-slice inside the fusion left it: the pipeline's B slot reading its stash entry through the
  F slot's write of the same tick, counted whole until 2026-12-05), and the buffer a dynamic-update-slice
  writes in place counts the update alone (a layer scan reads one layer of its stacked weights).
- A collective costs COLLECTIVE_LATENCY_S plus its ring time over the link its groups cross, with the
  planner's figures (jaxpar.planner.cost.link_bandwidth: NVLink inside a node, the node's NICs shared
  by its GPUs across nodes): all-reduce 2 (n-1)/n x bytes, all-gather / reduce-scatter / all-to-all
  (n-1)/n x bytes (the full buffer), collective-permute its bytes. A synchronous one holds the compute
  stream; an async one starts once reached and its stream is free, and its done waits for it: the
  waiting is the exposed communication.
- A while loop runs its body trip-count times, costed as the first iteration plus the second times the
  rest (the second is the steady state: a collective XLA pipelines across iterations starts in one
  and is done in the next). A conditional costs its costliest branch.
MATMUL_EFFICIENCY is fitted to the one GPU measurement (below; recalibrate whenever one lands); the two
latencies are assumptions; peak FLOP/s, HBM and link bandwidths are the planner's profile's.
"""

from __future__ import annotations

import copy
import dataclasses
import re

import numpy as np

from jaxpar.compiler import hlo_collectives

from jaxpar.compiler import hlo_flops
from jaxpar.compiler import hardware
from jaxpar.compiler.hardware import GB, Hardware

# Fitted to the H200 rows in BENCHMARKS.md (the 1B Llama, XLA attention, remat none / selective / full:
# 0.324 / 0.251 / 0.285 s measured; this value gives 0.339 / 0.243 / 0.278 s, errors +5 / -3 / -3%); the
# planner's profiles use the same value (jaxpar.compiler.hardware).
MATMUL_EFFICIENCY = hardware.MATMUL_EFFICIENCY
KERNEL_LAUNCH_S = hardware.KERNEL_LAUNCH_S
COLLECTIVE_LATENCY_S = 10e-6  # per collective: NCCL's small-message latency on NVLink (assumption)
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "partition-id", "replica-id",
         "after-all", "opt-barrier", "add-dependency", "async-update"}
_RING = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
         "reduce-scatter": lambda n: (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
         "collective-permute": lambda n: 1.0}
_SLICES = {"dynamic-slice", "slice", "gather"}


@dataclasses.dataclass
class _Flight:
    """An async transfer under way: its row, bytes, stream, end time and the compute done at its start."""
    key: tuple[str, str]
    nbytes: float
    stream: str
    end: float
    compute_at_start: float


@dataclasses.dataclass
class _State:
    now: float = 0.0  # the compute stream's clock
    compute_s: float = 0.0  # kernel seconds
    exposed_s: float = 0.0  # compute stream waiting on transfers (synchronous ones included)
    comm_s: float = 0.0  # transfer seconds on the streams
    flops: float = 0.0
    matmul_s: float = 0.0  # kernels priced by their FLOPs (launches excluded)
    memory_s: float = 0.0  # kernels priced by their HBM bytes (launches excluded)
    kernels: float = 0.0  # kernel launches
    free: dict = dataclasses.field(default_factory=dict)  # stream -> when it is free
    pending: dict = dataclasses.field(default_factory=dict)  # start instruction name -> _Flight
    carried: list = dataclasses.field(default_factory=list)  # started, to be done in a later computation
    # (op, axis) -> [bytes, bytes overlapped, seconds waited, own seconds (the transfers' time on their link)]
    rows: dict = dataclasses.field(default_factory=dict)


_TOTALS = ("now", "compute_s", "exposed_s", "comm_s", "flops", "matmul_s", "memory_s", "kernels")


class _Walker:
    def __init__(self, text: str, mesh, hw: Hardware, matmul_efficiency: float):
        self.comps, self.entry = hlo_collectives.parse_module(text)
        if self.entry is None:
            raise ValueError("no ENTRY computation in HLO text")
        self.mesh, self.hw, self.matmul_rate = mesh, hw, hw.peak_flops * matmul_efficiency
        # FP8 GEMMs at the FP8 peak, same efficiency (jaxpar.compiler.hardware: an estimate until measured)
        self.fp8_matmul_rate = (hw.fp8_peak_flops or hw.peak_flops) * matmul_efficiency
        self.n_devices = int(np.asarray(mesh.devices).size)
        flat = list(np.asarray(mesh.devices).flat)
        self.node = [getattr(d, "process_index", 0) for d in flat]  # a GPU dry run's node = its process
        self.gpus_per_node = max(1, self.n_devices // len(set(self.node)))
        self.flops_memo: dict = {}
        self.link_memo: dict = {}
        self.unknown_trips = False

    # ------------------------------------------------------------------ the walk
    def walk(self, name: str, st: _State, depth: int = 0) -> None:
        if depth > 64:
            return
        instrs = {i["name"]: i for i in self.comps.get(name, [])}
        outer, st.pending = st.pending, {}  # a start's done is in its own computation, or carried out of it
        for ins in self.comps.get(name, []):
            op = ins["op"]
            if op in _FREE:
                continue
            if op == "while":
                self._loop(ins, instrs, st, depth)
            elif op == "conditional":
                self._branches(ins, st, depth)
            elif op == "call":
                for callee in hlo_collectives._called(ins):
                    self.walk(callee, st, depth + 1)
            elif op.endswith("-done") or op == "async-done":
                self._done(ins, st)
            elif self._transfer(ins, instrs, st):
                continue
            else:
                self._kernel(ins, instrs, st)
        st.carried.extend(st.pending.values())  # started here, done after (a loop carry)
        st.pending = outer

    def _loop(self, ins: dict, instrs: dict, st: _State, depth: int) -> None:
        body, n = hlo_collectives._while_parts(self.comps, ins, instrs)
        if body is None or n == 0:
            return
        self.unknown_trips |= n is None
        self.walk(body, st, depth + 1)
        if not n or n < 2:
            return
        before = {k: getattr(st, k) for k in _TOTALS}
        rows = {k: list(v) for k, v in st.rows.items()}
        self.walk(body, st, depth + 1)  # the steady-state iteration
        extra = n - 2
        shift = (st.now - before["now"]) * extra
        for k in _TOTALS:
            setattr(st, k, getattr(st, k) + (getattr(st, k) - before[k]) * extra)
        for key, row in st.rows.items():
            first = rows.get(key, [0.0] * len(row))
            st.rows[key] = [now + (now - then) * extra for now, then in zip(row, first)]
        st.free = {s: t + shift for s, t in st.free.items()}
        for flight in st.carried:
            flight.end += shift
            flight.compute_at_start += shift

    def _branches(self, ins: dict, st: _State, depth: int) -> None:
        outcomes = []
        for callee in hlo_collectives._called(ins):
            branch = copy.deepcopy(st)
            self.walk(callee, branch, depth + 1)
            outcomes.append(branch)
        if outcomes:
            chosen = max(outcomes, key=lambda b: b.now)
            for field in dataclasses.fields(st):
                setattr(st, field.name, getattr(chosen, field.name))

    # ------------------------------------------------------------------ kernels
    def _kernel(self, ins: dict, instrs: dict, st: _State) -> None:
        flops, nbytes = self.kernel_cost(ins, instrs)
        rate = self.fp8_matmul_rate if hlo_flops.is_fp8_gemm(ins) else self.matmul_rate
        matmul_s, memory_s = flops / rate, nbytes / (self.hw.hbm_tbps * 1e12)
        if matmul_s >= memory_s:
            st.matmul_s += matmul_s
        else:
            st.memory_s += memory_s
        st.kernels += 1
        seconds = max(matmul_s, memory_s) + KERNEL_LAUNCH_S
        st.now += seconds
        st.compute_s += seconds
        st.flops += flops

    def kernel_cost(self, ins: dict, instrs: dict) -> tuple[float, float]:
        """(FLOPs, HBM bytes) of one kernel."""
        op = ins["op"]
        if op == "fusion":
            callee = re.search(r"calls=%?([\w.\-]+)", ins["attrs"]).group(1)
            counted = hlo_flops._comp_flops(self.comps, callee, self.flops_memo)
            flops = counted["dot"] + counted["convolution"] + counted["attention"]
            return flops, self._fusion_bytes(ins, instrs, callee)
        nbytes = sum(_nbytes(instrs[a]["shape"]) for a in ins["args"] if a in instrs) + _result_bytes(ins["shape"])
        own = hlo_flops._instr_flops(ins, instrs)  # cuDNN attention included (jaxpar.compiler.hlo_flops.fmha_flops)
        return (own[1] or 0.0) if own else 0.0, nbytes

    def _fusion_bytes(self, ins: dict, instrs: dict, callee: str) -> float:
        """Bytes a fusion reads and writes: a parameter only sliced counts its slices, also where the slice
        reads it through a dynamic-update-slice inside the fusion (the pipeline's B slot reading the stash
        as F's write of the same tick left it: the kernel reads one entry, from the buffer or the update);
        the buffer a root dynamic-update-slice updates in place is neither read nor written whole
        (bitcasts seen through)."""
        body = self.comps.get(callee, [])
        if not body:
            return 0.0
        by_name = {i["name"]: i for i in body}
        users: dict[str, list[dict]] = {}
        for i in body:
            for a in i["args"]:
                users.setdefault(a, []).append(i)

        def source(name: str) -> str:  # the value a chain of bitcasts starts from
            while name in by_name and by_name[name]["op"] == "bitcast":
                name = by_name[name]["args"][0]
            return name

        def uses(name: str) -> list[tuple[str, dict]]:  # (the name used, user), through bitcasts
            out = []
            for u in users.get(name, []):
                out.extend(uses(u["name"]) if u["op"] == "bitcast" else [(name, u)])
            return out

        def sliced_only(name: str) -> list[dict] | None:  # the slices that read `name`, or None if more does
            slices = []
            for used, u in uses(name):
                if u["op"] in _SLICES and u["args"][0] == used:
                    slices.append(u)
                elif u["op"] == "dynamic-update-slice" and u["args"][0] == used:
                    inner = sliced_only(u["name"])  # the updated buffer, read by slices only (an output is not)
                    if inner is None:
                        return None
                    slices.extend(inner)
                else:
                    return None
            return slices or None

        root = body[-1]
        outputs = [by_name.get(source(a)) for a in root["args"]] if root["op"] == "tuple" else [
            by_name.get(source(root["name"]))]
        in_place = {source(o["args"][0]) for o in outputs if o and o["op"] == "dynamic-update-slice"}
        read = 0.0
        for i in body:
            if i["op"] != "parameter" or i["name"] in in_place:
                continue
            slices = sliced_only(i["name"])
            if slices:
                read += sum(_nbytes(u["shape"]) for u in slices)
            else:
                k = int(i["args"][0])
                arg = ins["args"][k] if k < len(ins["args"]) else None
                read += _nbytes(instrs[arg]["shape"]) if arg in instrs else _nbytes(i["shape"])
        written = 0.0
        for o in outputs:
            if o is None:
                continue
            update = by_name.get(o["args"][1]) if o["op"] == "dynamic-update-slice" else None
            written += _nbytes(update["shape"]) if update else _nbytes(o["shape"])
        return read + written

    # ------------------------------------------------------------------ transfers
    def _transfer(self, ins: dict, instrs: dict, st: _State) -> bool:
        """Start (or run, if synchronous) a collective or host copy; False if `ins` is neither."""
        op = ins["op"]
        base = op[:-len("-start")] if op.endswith("-start") else op
        inner = ins
        if op == "async-start":
            inner = next((i for c in hlo_collectives._called(ins) for i in self.comps.get(c, [])
                          if i["op"] in hlo_collectives.OPS), None)
            if inner is None:  # an async computation that is not a collective: its kernels run in line
                for callee in hlo_collectives._called(ins):
                    self.walk(callee, st)
                return True
            base = inner["op"]
        if base == "copy" and op == "copy-start":
            nbytes = _result_bytes(_first(ins["shape"]))
            self._start(ins["name"], ("host-copy", "host"), nbytes, nbytes / (self.hw.pcie_gbps * GB), "host", st)
            return True
        if op == "fusion-start" and ":S(5)" in _first(ins["shape"]):  # an async slice out of or into host memory
            nbytes = _host_copy_bytes(ins["shape"])
            self._start(ins["name"], ("host-copy", "host"), nbytes, nbytes / (self.hw.pcie_gbps * GB), "host", st)
            return True
        if base not in hlo_collectives.OPS:
            return False
        key, nbytes, seconds = self.collective_cost(inner, base)
        if op.endswith("-start"):
            self._start(ins["name"], key, nbytes, seconds, "collectives", st)
        else:  # synchronous: the compute stream runs it
            begin = max(st.now, st.free.get("collectives", 0.0))
            st.free["collectives"] = begin + seconds
            row = st.rows.setdefault(key, [0.0, 0.0, 0.0, 0.0])
            row[0] += nbytes
            row[2] += begin + seconds - st.now
            row[3] += seconds
            st.exposed_s += begin + seconds - st.now
            st.comm_s += seconds
            st.now = begin + seconds
        return True

    def _start(self, name: str, key, nbytes: float, seconds: float, stream: str, st: _State) -> None:
        begin = max(st.now, st.free.get(stream, 0.0))
        st.free[stream] = begin + seconds
        st.comm_s += seconds
        st.pending[name] = _Flight(key, nbytes, stream, begin + seconds, st.compute_s)
        row = st.rows.setdefault(key, [0.0, 0.0, 0.0, 0.0])
        row[0] += nbytes
        row[3] += seconds

    def _done(self, ins: dict, st: _State) -> None:
        flight = st.pending.pop(ins["args"][0], None) if ins["args"] else None
        if flight is None and st.carried:  # started in another computation (a loop's previous iteration)
            kind = ins["op"][:-len("-done")]
            match = [f for f in st.carried if f.key[0] == kind or kind in ("async", "copy", "fusion")]
            flight = (match or st.carried)[0]
            st.carried.remove(flight)
        if flight is None:
            return
        if flight.end > st.now:
            st.rows[flight.key][2] += flight.end - st.now
            st.exposed_s += flight.end - st.now
            st.now = flight.end
        if st.compute_s > flight.compute_at_start:
            st.rows[flight.key][1] += flight.nbytes

    def collective_cost(self, ins: dict, base: str) -> tuple[tuple[str, str], float, float]:
        """((op, axis), bytes, seconds) of one execution of a collective."""
        nbytes = float(sum(hlo_collectives._collective_bytes(ins, base, self.n_devices).values()))
        attrs = ins["attrs"]
        memo_key = (base, re.sub(r"metadata=\{.*", "", attrs))
        if memo_key not in self.link_memo:
            if base == "collective-permute":
                axis = hlo_collectives.permute_axis(attrs, self.mesh)
                pairs = [(int(s), int(t)) for s, t in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", attrs)]
                n, crosses = 2, any(self.node[s] != self.node[t] for s, t in pairs)
            else:
                groups = hlo_collectives.parse_replica_groups(attrs, self.n_devices)
                axis = hlo_collectives.axis_label(groups, self.mesh)
                n = len(groups[0])
                crosses = any(len({self.node[d] for d in g}) > 1 for g in groups)
            bandwidth = (self.hw.ib_gbps_per_node / self.gpus_per_node if crosses else self.hw.nvlink_gbps / 2) * GB
            self.link_memo[memo_key] = (axis, n, bandwidth)
        axis, n, bandwidth = self.link_memo[memo_key]
        seconds = 0.0 if n <= 1 else COLLECTIVE_LATENCY_S + _RING[base](n) * nbytes / bandwidth
        return (base, axis), nbytes, seconds


def _nbytes(shape: str) -> float:
    return float(sum(hlo_collectives._bytes_by_dtype(shape).values()))


def _result_bytes(shape: str) -> float:
    """Bytes a kernel writes: its results less library scratch space (s8/u8 workspaces)."""
    return float(sum(_nbytes(e) for e in hlo_collectives._tuple_elems(shape) if not re.match(r"\s*[su]8\[", e)))


def _first(shape: str) -> str:
    return hlo_collectives._tuple_elems(shape)[0]


def _host_copy_bytes(shape: str) -> float:
    """Bytes an async fusion touching host memory moves over the link, from its `((operands), result,
    context)` shape: a slice out of a host array (offload.params' per-layer copy) moves its device
    result; a dynamic-update-slice into one (remat=offload's per-layer copy out) moves its device
    operands, not the host array it writes in place."""
    operands, result = hlo_collectives._tuple_elems(shape)[:2]
    if ":S(5)" not in result:
        return _nbytes(result)
    return float(sum(_nbytes(e) for e in hlo_collectives._tuple_elems(operands)
                     if ":S(5)" not in e and "[]" not in e))  # not the scalar offsets


def read_schedule(text: str, mesh, hw: Hardware, model_flops_per_device: float,
                  matmul_efficiency: float = MATMUL_EFFICIENCY) -> dict:
    """`overlap` rows and the `estimate` of one step of the scheduled GPU program `text` (see the module
    docstring) on `mesh`'s devices with `hw`'s rates.

    overlap: per (op, axis), `bytes` executed per step (loops x trip count), `bytes_overlapped` (those of
    async collectives whose start..done window holds compute), `exposed_s` (seconds the compute
    stream waits on them) and `own_s` (the seconds those bytes take on their link, priced as above):
    `exposed_s / own_s` is the part not hidden (issue 46 item 7: a window that holds some compute
    counts as "overlapped" although most of the transfer may still be waited for). estimate: `step_s`, `mfu` (model FLOPs per device / (step_s x peak)),
    `compute_s` (kernel seconds; `compute_parts`: the matmul-bound kernels', the memory-bound ones', the
    launches' and the kernel count), `exposed_comm_s` (the rest), `comm_s` (transfer seconds, hidden or
    not), `executed_flops` (matmul and attention FLOPs priced), `above_ceiling` (the MFU above the matmul
    efficiency: not a figure to quote; the dry run says why)."""
    walker = _Walker(text, mesh, hw, matmul_efficiency)
    st = _State()
    walker.walk(walker.entry, st)
    for flight in st.carried:  # never waited for inside the step: the step ends when it does
        if flight.end > st.now:
            st.rows[flight.key][2] += flight.end - st.now
            st.now = flight.end
    overlap = [{"op": op, "axis": axis, "bytes": int(b), "bytes_overlapped": int(o), "exposed_s": waited,
                "own_s": own} for (op, axis), (b, o, waited, own) in sorted(st.rows.items())]
    step_s = st.now
    estimate = {"step_s": step_s, "mfu": model_flops_per_device / (step_s * hw.peak_flops) if step_s else 0.0,
                "compute_s": st.compute_s, "exposed_comm_s": step_s - st.compute_s, "comm_s": st.comm_s,
                "executed_flops": st.flops,
                "compute_parts": {"matmul_s": st.matmul_s, "memory_s": st.memory_s,
                                  "launch_s": st.kernels * KERNEL_LAUNCH_S, "kernels": int(round(st.kernels))},
                "hardware": hw.name, "matmul_efficiency": matmul_efficiency,
                "trip_count_unknown": walker.unknown_trips}
    # every matmul at the efficiency caps MFU there, unless the model FLOPs count work the program does not
    # execute (PaLM's 12 L d s attention term is the whole s x s; causal kernels compute half of it)
    estimate["above_ceiling"] = bool(estimate["mfu"] > matmul_efficiency)
    return {"overlap": overlap, "estimate": estimate}
