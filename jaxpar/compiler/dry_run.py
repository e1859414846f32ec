"""AOT dry run: compile the real train step for the real mesh from abstract shapes, allocate nothing.

Reports per-device memory (state bytes exactly from shard shapes and dtypes, per memory kind;
argument / output / temp from XLA's `compiled.memory_analysis()`), the ZeRO formula next to it, and
the collectives of one step (jaxpar.compiler.hlo_collectives), and the matmul FLOPs one device executes in the compiled
step (jaxpar.compiler.hlo_flops.executed_flops) next to its share of the model FLOPs that MFU uses: the gap is remat
recompute, masked pipeline slots and replicated work. On CPU, XLA's memory analysis does not separate host
from device memory, and XLA:CPU widens bf16 collectives to f32 in the optimised program, so the
report also lists the collectives as jaxpar wrote them (pre-optimisation HLO), with their dtype.
"""

from __future__ import annotations

import json
import math
import pathlib
import time
from typing import Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.compiler import hardware, hlo_collectives, hlo_flops
from jaxpar.compiler.gpu_aot import GpuTarget
from jaxpar.config import Config, to_dict
from jaxpar.files import write_atomic
from jaxpar.layers import order
from jaxpar.models import llama, vit, vla
from jaxpar.models.flops import model_flops_per_step
from jaxpar.parallel.pipeline import SLOT_SCOPES, activation_collectives, measured_slot_flops
from jaxpar.parallel.schedule import bubble_fraction, pipeline_table
from jaxpar.parallel.step import VISION_KEYS, StepBuilder
from jaxpar.sharding import tree_specs, unused_mesh_axes

def bytes_by_memory_kind(tree) -> dict[str, int]:
    """Per-device bytes of a tree of sharded ShapeDtypeStructs, grouped by sharding.memory_kind."""
    out: dict[str, int] = {}
    for leaf in jax.tree.leaves(tree):
        kind = leaf.sharding.memory_kind or "device"
        out[kind] = out.get(kind, 0) + math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
    return out


def zero_formula_bytes(config: Config, psi_local: int, dp: int) -> dict[str, float]:
    """Model-state bytes per device from the ZeRO paper's table (Psi = per-(pp, tp)-shard params).

    bf16: 2-byte params, K = 12 (fp32 master + Adam m + v) and grads reduced in fp32 (4 bytes; the
    paper's 2 with grad_reduce=bf16); fp32: 4 + 4, K = 8 (m + v). The gradients are the reduced ones:
    jaxpar's ZeRO-1 is Megatron's distributed optimizer, which reduce-scatters them into the optimizer's
    1/dp shard (the paper's stage 1 keeps them whole; with gradient accumulation jaxpar's does too, as
    the fp32 sum of the microbatches, before the reduce-scatter).
    """
    stage = config.zero.stage
    p_bytes, g_bytes, k = (2, 4 if config.grad_reduce == "fp32" else 2, 12) if config.bf16_compute else (4, 4, 8)
    out = {"params": p_bytes * psi_local / (dp if stage >= 3 else 1),
           "grads": g_bytes * psi_local / (dp if stage >= 1 else 1),
           "opt_state": k * psi_local / (dp if stage >= 1 else 1)}
    out["total"] = sum(out.values())
    return out


def local_param_count(builder: StepBuilder) -> int:
    """Psi of the ZeRO formulas: parameters one device holds before any dp sharding (tp/pp only)."""
    axes, shapes = llama.param_axes(), llama.param_shapes(builder.config.model)  # (no FP8 counters)
    if vla.ACTION_HEAD in builder.axes:  # the l1 / flow head's MLP, the LLM's too
        axes[vla.ACTION_HEAD] = vla.action_head_axes(builder.config)
        shapes[vla.ACTION_HEAD] = vla.action_head_shapes(builder.config)
    specs = tree_specs(axes, False, unused_mesh_axes(builder.mesh), builder.specs_rules)
    counts = jax.tree.map(lambda spec, shape: math.prod(NamedSharding(builder.mesh, spec).shard_shape(shape)),
                          specs, shapes, is_leaf=lambda x: isinstance(x, P))
    return int(sum(jax.tree.leaves(counts)))


def total_param_count(config: Config) -> int:
    count = llama.param_count(config.model)
    if config.model.kind == "vla":
        count += vit.param_count(config.vision, config.model.d_model)
        if config.actions.continuous:
            count += sum(math.prod(shape) for shape in vla.action_head_shapes(config).values())
    return count


def _subtree_bytes(tree, keys) -> dict[str, int]:
    """Bytes by memory kind of the leaves of `tree` under any top-level parameter key in `keys`."""
    leaves = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
              if any(getattr(entry, "key", None) in keys for entry in path)]
    return bytes_by_memory_kind(leaves)


def param_bytes(builder: StepBuilder, params, keys) -> dict[str, int]:
    """{"device", "pinned_host"}: per-device bytes of the parameters under `keys`, placed as the run
    places them (offload.params: jaxpar.parallel.step.StepBuilder.offloaded_params; read from the plan,
    since a GPU dry run's shardings keep no memory kind)."""
    host = builder.offloaded_params()
    def total(selected):
        return sum(_subtree_bytes(params, selected).values())
    return {"device": total([k for k in keys if k not in host]), "pinned_host": total([k for k in keys if k in host])}


def component_report(builder: StepBuilder, state) -> dict:
    """Each model component's layout and its per-device state bytes (params; master + optimizer)."""
    config = builder.config
    llm_keys = [k for k in state.params if k not in VISION_KEYS]
    layouts = {"llm": {"keys": llm_keys, "dp": config.mesh.dp, "pp": config.mesh.pp, "tp": config.mesh.tp,
                       "zero_stage": config.zero.stage, "zero3_prefetch": builder.zero.prefetches,
                       "remat": config.remat.policy,
                       "schedule": config.pipeline.schedule if config.mesh.pp > 1 else None}}
    if builder.vision is not None:
        layouts["vision+projector"] = {"keys": list(VISION_KEYS), **builder.vision.describe(builder.mesh)}
    for layout in layouts.values():
        keys = layout.pop("keys")
        params, opt = param_bytes(builder, state.params, keys), _subtree_bytes((state.master, state.opt_state), keys)
        layout.update(params_bytes=params.get("device", 0), params_host_bytes=params.get("pinned_host", 0),
                      opt_state_bytes=opt.get("device", 0), opt_state_host_bytes=opt.get("pinned_host", 0))
    return layouts


def compile_step(builder: StepBuilder, state) -> tuple:
    """(lowered, compiled, seconds) of the train step for the builder's mesh, traced from `state`'s shapes
    and shardings (abstract: nothing is allocated). The trainer runs this very executable, compiled
    before it allocates the state, so that its preflight can refuse a step that will not fit
    (jaxpar.training.preflight); the dry run reports on it."""
    start = time.perf_counter()
    with order.ordering(builder.mesh.devices.flat[0].platform == "cpu"):  # only CPU programs are ordered
        lowered = builder.jit_train_step().lower(state, builder.abstract_batch())
    compiled = lowered.compile()
    return lowered, compiled, time.perf_counter() - start


def compiled_bytes(compiled) -> dict[str, int]:
    """Per-device bytes of a compiled step from XLA's memory analysis: argument, output, alias (outputs
    written into donated arguments), temp, and the peak = argument + output - alias + temp."""
    mem = compiled.memory_analysis()
    out = {"argument": mem.argument_size_in_bytes, "output": mem.output_size_in_bytes,
           "alias": mem.alias_size_in_bytes, "temp": mem.temp_size_in_bytes}
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def dry_run(config: Config, mesh, gpu: GpuTarget | None = None, planner: Callable | None = None) -> dict:
    """The report of the train step compiled for `mesh`'s devices (`gpu`: the GPU target they are).
    `planner(config, gpu name, devices per node)`: the planner's figures for the same layout, shown
    beside the GPU compiler's under "planner" (jaxpar.planner.report.gpu_figures; the entry point
    hands it in, so the compiler's reading of its own program imports no planner)."""
    builder = StepBuilder(config, mesh)
    state = builder.abstract_state()
    lowered, compiled, compile_s = compile_step(builder, state)
    params = param_bytes(builder, state.params, list(state.params))
    opt = bytes_by_memory_kind((state.master, state.opt_state))
    per_device = {
        "params": params.get("device", 0),
        "params_host": params.get("pinned_host", 0),
        "opt_state": opt.get("device", 0),
        "opt_state_host": opt.get("pinned_host", 0),
        **compiled_bytes(compiled),
    }
    model_flops = model_flops_per_step(config, builder.seq_len)
    text = compiled.as_text()
    executed = hlo_flops.executed_flops(text, tuple(SLOT_SCOPES.values()))
    table = pipeline_table(config)
    slot_flops = None if table is None else measured_slot_flops(executed["by_scope"], table)
    report = {
        "devices": mesh.size,
        "platform": mesh.devices.flat[0].platform,
        "mesh": dict(mesh.shape),
        "zero_stage": config.zero.stage,
        "precision": config.precision,
        "nan_guard": builder.nan_guard,  # train.nan_guard as resolved for these devices
        "param_count": total_param_count(config),
        "components": component_report(builder, state),
        "per_device_bytes": per_device,
        "analytic_bytes": zero_formula_bytes(config, local_param_count(builder), mesh.shape["dp"]),  # the LLM's
        "collectives": hlo_collectives.collectives(compiled.as_text(), mesh),
        "collectives_requested": hlo_collectives.collectives(lowered.as_text(dialect="hlo"), mesh),
        "flops_per_step": model_flops,
        "model_flops_per_device": model_flops / mesh.size,
        "executed_flops_per_device": executed["total"],
        "executed_flops": executed,
        "bubble_fraction": bubble_fraction(config, slot_flops),
        "slot_flops": slot_flops,
        "pipeline_collectives": _pipeline_collectives(config),
        "compile_s": compile_s,
        "notes": [
            "params/opt_state: exact, from the state's shard shapes, dtypes and memory kinds",
            "argument/output/alias/temp: XLA memory_analysis of the compiled step; peak = argument + output - alias + temp",
            "on CPU, memory_analysis does not separate host from device memory",
            "collectives: optimised program (XLA:CPU widens bf16 collectives to f32; GPUs keep bf16); "
            "collectives_requested: as written by jaxpar, before XLA optimisation (GSPMD-inserted optimizer "
            "gathers are not there yet)",
            "model_flops_per_device: 6N + attention FLOPs of one step (jaxpar.models.flops) / devices; "
            "executed_flops_per_device: dot and convolution FLOPs of the compiled program on one device, "
            "plus cuDNN attention's matmuls (forward 4 b h s s d, backward 2.5x, causal half; jaxpar.compiler.hlo_flops.fmha_flops), "
            "loops x trip count, a conditional's costliest branch (jaxpar.compiler.hlo_flops.executed_flops)",
            "bubble_fraction: idle share of the pipeline schedule table's executed slots (0 without pp), each "
            "slot weighted by its kind's FLOPs in this program (slot_flops: one F, B or zb W chunk slot)",
            "pipeline_collectives: the activation-sized pp collectives of one step counted from the schedule table "
            "as the pipeline issues them and the planner prices them (jaxpar.parallel.pipeline.activation_collectives); "
            "the compiled program's are in `collectives` (tests/test_pipeline.py checks the two agree)",
        ],
        "config": to_dict(config),
    }
    if gpu is not None:
        report.update(gpu_fields(gpu, per_device, text))
        report.update(schedule_fields(mesh, gpu, text, model_flops / mesh.size))
        if planner is not None:
            nodes = len({getattr(d, "process_index", 0) for d in mesh.devices.flat})
            report["planner"] = planner(config, gpu.name, mesh.size // nodes)
        report["notes"].append(f"GPU-compiled, no device: XLA's GPU compiler for CUDA {report['cuda_runtime']} "
                               "without autotuning (default GEMM "
                               "tiles, cuBLAS GEMMs: Triton GEMM fusions off); memory is a close estimate")
    return report


def gpu_fields(gpu: GpuTarget, per_device: dict, text: str) -> dict:
    """What only a GPU program says: the target, whether the step fits the memory budget (the share of
    its memory the planner plans with and a GPU run gives XLA's allocator: hardware.memory_budget), and
    the library kernels it calls (cuDNN attention is taken only if the program has its custom calls; its
    forward calls are one per layer and microbatch, two where remat re-runs it in the backward; under
    context parallelism 1 + 2 (cp - 1) per layer, each branch of a block's cond counted, cp of them run)."""
    from jaxpar.compiler.gpu_aot import cuda_version

    calls = hlo_flops.custom_call_counts(text)
    fmha = {target: n for target, n in calls.items() if target.startswith("__cudnn$fmha")}
    cudnn = sum(fmha.values())
    backward = sum(n for target, n in fmha.items() if "Backward" in target)
    gemms = sum(n for target, n in calls.items() if target.startswith("__cublas$"))
    fp8_gemms = calls.get(hlo_flops.FP8_GEMM, 0)  # the one FP8 GEMM target hlo_flops prices
    usable = int(hardware.get(gpu.name).usable_bytes)  # whole bytes, as the rest of the report
    return {"target": gpu.name, "cuda_runtime": "%d.%d" % cuda_version(), "hbm_bytes": gpu.memory_bytes,
            "usable_bytes": usable,
            "fits": per_device["peak"] <= usable,
            "kernels": {"attention": "cudnn" if cudnn else "xla", "cudnn_attention_calls": cudnn,
                        "cudnn_attention_forward_calls": cudnn - backward, "cudnn_attention_backward_calls": backward,
                        "gemm_calls": gemms, "fp8_gemm_calls": fp8_gemms}}


def schedule_fields(mesh, gpu: GpuTarget, text: str, model_flops_per_device: float) -> dict:
    """`overlap` and `estimate` read from the scheduled GPU program (jaxpar.compiler.gpu_program)."""
    from jaxpar.compiler.gpu_program import read_schedule

    return read_schedule(text, mesh, hardware.get(gpu.name), model_flops_per_device)


def format_report(report: dict) -> str:
    pd, an = report["per_device_bytes"], report["analytic_bytes"]
    b = hlo_collectives.human_bytes
    mesh = " x ".join(f"{k}={v}" for k, v in report["mesh"].items())
    lines = [
        f"dry run: {report['param_count']:,} params on {report['devices']} {_devices_text(report)} devices "
        f"({mesh}), ZeRO-{report['zero_stage']}, {report['precision']}; compiled in {report['compile_s']:.1f}s",
        "per-device bytes:",
        f"  params     {b(pd['params']):>12}   (LLM ZeRO formula {b(an['params'])}; on host {b(pd['params_host'])})",
        f"  opt_state  {b(pd['opt_state']):>12}   (LLM ZeRO formula {b(an['opt_state'])}; on host {b(pd['opt_state_host'])})",
        f"  grads      {'(in temp)':>12}   (LLM ZeRO formula {b(an['grads'])})",
        f"  argument   {b(pd['argument']):>12}",
        f"  output     {b(pd['output']):>12}   (aliased with arguments: {b(pd['alias'])})",
        f"  temp       {b(pd['temp']):>12}",
        f"  peak       {b(pd['peak']):>12}   (argument + output - alias + temp)",
        "components:",
        *(f"  {name:<17} {_layout_text(c)}: params {b(c['params_bytes'])} (+ {b(c['params_host_bytes'])} on host), "
          f"optimizer {b(c['opt_state_bytes'])} (+ {b(c['opt_state_host_bytes'])} on host)"
          for name, c in report["components"].items()),
        *gpu_text(report),
        flops_text(report),
        "collectives per step (optimised program; XLA:CPU shows bf16 collectives as f32):",
        hlo_collectives.summarize(report["collectives"]),
        *_pipeline_text(report.get("pipeline_collectives")),
    ]
    return "\n".join(lines)


def _pipeline_collectives(config) -> dict | None:
    table = pipeline_table(config)
    return None if table is None else activation_collectives(table)


def _pipeline_text(counts: dict | None) -> list[str]:
    """One line: the activation-sized pp collectives the schedule table says one step executes."""
    if not counts:
        return []
    return [f"pipeline, per step (schedule table): {counts['sends']} activation sends over pp; activation "
            f"all-reduces: {counts['first_input']} of the first input (pp x tp), {counts['first_input_grad']} "
            f"of its gradient and {counts['head']} of the head (pp)"]


def _devices_text(report: dict) -> str:
    if "target" in report:
        return f"{report['target']} (GPU-compiled, no device)"
    return report["platform"]


def gpu_text(report: dict) -> list[str]:
    """The GPU target's lines: fit against its memory budget, and the kernels read from the program."""
    if "target" not in report:
        return []
    b, k = hlo_collectives.human_bytes, report["kernels"]
    fit = "fits" if report["fits"] else "does NOT fit"
    peak = b(report["per_device_bytes"]["peak"])
    est, plan = report["estimate"], report.get("planner")
    planned_peak = f"; planner {b(plan['peak_bytes'])}" if plan else ""
    planned_step = f" (planner: {plan['step_s']:.4g} s, MFU {plan['mfu']:.1%})" if plan else ""
    hint = [f"  the update is the peak: train.nan_guard=select updates in place (planner: {b(plan['select_guard_peak_bytes'])})"
            ] if plan and plan.get("select_guard_peak_bytes") else []
    usable = f"{b(report['usable_bytes'])} usable of {b(report['hbm_bytes'])}"
    return [f"  {fit} in {report['target']}'s {usable} (peak {peak}{planned_peak}; "
            f"NaN guard {report['nan_guard']})", *hint,
            f"kernels per step: attention {k['attention']} ({k['cudnn_attention_calls']} cuDNN fMHA calls: "
            f"{k['cudnn_attention_forward_calls']} forward, {k['cudnn_attention_backward_calls']} backward), "
            f"{k['gemm_calls']} cuBLAS GEMM calls"
            + (f" ({k['fp8_gemm_calls']} of them FP8)" if k.get("fp8_gemm_calls") else ""),
            f"estimated step (XLA's schedule, no device): {est['step_s']:.4g} s, MFU {est['mfu']:.1%}; compute "
            f"{est['compute_s']:.4g} s, exposed communication {est['exposed_comm_s']:.4g} s{planned_step}",
            *_above_ceiling_text(report),
            "collectives overlapped with compute in the schedule (exposed: compute waits / the transfers' own time):",
            *(f"  {r['op']:<18} {r['axis']:<12} {b(r['bytes']):>12} per step, {b(r['bytes_overlapped']):>12} "
              f"overlapped, compute waits {r['exposed_s']:.4g} s of {r['own_s']:.4g} s "
              f"({_exposed_share(r)} exposed)" for r in report["overlap"])]


def _above_ceiling_text(report: dict) -> list[str]:
    """One line when the estimated MFU exceeds its own matmul efficiency, which no program that executes its
    model FLOPs can reach: the model FLOPs then count work the program does not run (PaLM's attention term
    is the whole s x s, a causal kernel computes half: long sequences), or the estimate misses some."""
    est = report["estimate"]
    if not est.get("above_ceiling"):
        return []
    ratio = report["executed_flops_per_device"] / report["model_flops_per_device"]
    if est.get("trip_count_unknown"):
        why = "a loop's trip count was not found and the estimate counts it once: not a figure"
    elif ratio < 1:
        why = (f"the model FLOPs (6N + the whole s x s attention) exceed what the program executes (x{ratio:.2f}: causal "
               "attention skips its masked half); quote the step time")
    else:
        why = "the estimate misses work the program executes: a bug in jaxpar.compiler.gpu_program, not a figure"
    return [f"  MFU {est['mfu']:.1%} is above the estimate's matmul ceiling of {est['matmul_efficiency']:.0%}: {why}"]


def _exposed_share(row: dict) -> str:
    """exposed_s over own_s as a percentage: how much of a collective's time nothing hid."""
    return f"{row['exposed_s'] / row['own_s']:.0%}" if row["own_s"] > 0 else "-"


def flops_text(report: dict) -> str:
    """One line: executed vs model FLOPs per device, and the bubble that part of the gap comes from."""
    model, executed, counted = (report["model_flops_per_device"], report["executed_flops_per_device"],
                                report["executed_flops"])
    flags = "; a loop's trip count was not found (counted once)" if counted["trip_count_unknown"] else ""
    flags += f"; not counted: {', '.join(counted['uncounted'])}" if counted["uncounted"] else ""
    return (f"FLOPs per device per step: executed {executed:.3e} (compiled program), model {model:.3e} "
            f"(6N + attention; executed/model {executed / model:.2f}); pipeline bubble "
            f"{report['bubble_fraction']:.1%}{flags}")


def _layout_text(component: dict) -> str:
    skip = {"params_bytes", "params_host_bytes", "opt_state_bytes", "opt_state_host_bytes"}
    return ", ".join(f"{k}={v}" for k, v in component.items() if k not in skip and v is not None)


def write_report(report: dict, workdir: pathlib.Path) -> pathlib.Path:
    return write_atomic(workdir / "dry_run.json", json.dumps(report, indent=2))
