"""The planner's report: one dict (the --json output) and its text rendering."""

from __future__ import annotations

import dataclasses
import shlex

from jaxpar.config import Config, nan_guard_for, to_dict
from jaxpar.planner import cost, memory, offload
from jaxpar.compiler import hardware
from jaxpar.compiler.hardware import GB, Hardware
from jaxpar.planner.recommend import describe, rules

MEMORY_ROWS = [
    ("params", "compute-dtype weights"),
    ("params_on_host", "  of which in host memory (offload.params)"),
    ("master", "fp32 master weights"),
    ("optimizer", "Adam m + v (fp32)"),
    ("optimizer_on_host", "  of which in host memory (offload)"),
    ("gradients", "gradients during the backward"),
    ("activations", "saved activations (remat, schedule, m)"),
    ("activations_on_host", "  activations offloaded to host"),
    ("working_set", "largest temporary (one layer's backward / LM head)"),
    ("backward_phase", "temp: backward phase"),
    ("update_phase", "temp: optimizer-update phase"),
    ("peak", "PEAK (device state + larger phase)"),
]
OFFLOAD_ROWS = ("params_on_host", "optimizer_on_host", "activations_on_host")  # printed only when not zero
HOST_LINK_ROWS = (("params_in", "parameter shards in (fwd + bwd, per microbatch)"),
                  ("state_in", "optimizer state in (update=device)"),
                  ("state_out", "optimizer state out (update=device)"),
                  ("grads_out", "gradient shards out (update=host)"),
                  ("updated_params_in", "updated parameters in (update=host)"),
                  ("updated_params_out", "updated parameters out (offload.params)"),
                  ("activations_out", "activations out (remat=offload, per layer forward)"),
                  ("activations_in", "activations in (remat=offload, per layer backward)"))


def select_guard_peak(config: Config, target: str, compute_capability: float, cond: float) -> float | None:
    """The planned peak with train.nan_guard=select, when a cond asked for by name makes the step's peak
    (`cond`, planned) at least 5% higher on a GPU (docs/design.md "The NaN guard"); else None."""
    if target != "gpu" or nan_guard_for(config.train, target) != "cond":
        return None
    select = dataclasses.replace(config, train=dataclasses.replace(config.train, nan_guard="select"))
    peak = memory.estimate(select, target, compute_capability)["per_device_bytes"]["peak"]
    return peak if peak < 0.95 * cond else None


def plan(config: Config, hw: Hardware, gpus_per_node: int, target: str = "gpu") -> dict:
    mem = memory.estimate(config, target, hw.compute_capability)
    time = cost.step_time(config, hw, gpus_per_node)
    return {"layout": describe(config), "devices": config.mesh.size, "hardware": hw.name, "target": target,
            "pcie_gbps": hw.pcie_gbps,
            "per_device_bytes": mem["per_device_bytes"], "fits": mem["per_device_bytes"]["peak"] <= hw.usable_bytes,
            "usable_bytes": hw.usable_bytes, "microbatch_sequences": mem["microbatch"], "seq_len": mem["seq_len"],
            "peak_phase": mem["phase"], "param_counts_per_device": mem["param_counts"],
            "flops_per_step": time["model_flops"], "model_flops_per_device": time["model_flops_per_device"],
            "executed_flops_per_device": time["executed_flops_per_device"],
            "executed_flops_parts": time["executed_parts"],
            "step_time": {k: time[k] for k in ("compute_s", "matmul_s", "memory_s", "launch_s", "bubble_s",
                                               "tp_comm_s", "tp_exposed_s", "dp_comm_s", "dp_exposed_s",
                                               "pp_comm_s", "pp_exposed_s", "cp_comm_s", "step_s",
                                               "step_s_no_overlap", "host_link_s", "host_link_exposed_s",
                                               "host_adam_s")},
            "host_link_bytes": time["host_link_parts"], "offload": offload.enabled(config),
            "memory_bound_s": time["memory_parts"],
            "links": time["links"], "bubble_fraction": time["bubble_fraction"], "mfu": time["mfu"],
            "tokens_per_s": time["tokens_per_s"], "config": to_dict(config),
            "select_guard_peak_bytes": select_guard_peak(config, target, hw.compute_capability,
                                                         mem["per_device_bytes"]["peak"])}


def gpu_figures(config: Config, gpu_name: str, gpus_per_node: int) -> dict:
    """The planner's step time, MFU and peak for a layout, to sit beside the GPU compiler's in the GPU
    dry run (jaxpar.compiler.dry_run)."""
    hw = hardware.get(gpu_name)
    planned = cost.step_time(config, hw, gpus_per_node)
    peak = memory.estimate(config, "gpu", hw.compute_capability)["per_device_bytes"]["peak"]
    return {"step_s": planned["step_s"], "mfu": planned["mfu"], "peak_bytes": peak,
            "matmul_efficiency": hw.matmul_efficiency,
            "select_guard_peak_bytes": select_guard_peak(config, "gpu", hw.compute_capability, peak)}


def format_plan(report: dict) -> str:
    pd = report["per_device_bytes"]
    st = report["step_time"]
    fits = "fits" if report["fits"] else "does NOT fit"
    lines = [f"plan: {report['layout']} on {report['devices']} x {report['hardware']} "
             f"(estimate for {report['target']}; microbatch {report['microbatch_sequences']} x {report['seq_len']} tokens)",
             "per-device memory (GB = 1e9 bytes):"]
    lines += [f"  {label:<52} {pd[key] / GB:9.2f}" for key, label in MEMORY_ROWS
              if key not in OFFLOAD_ROWS or pd[key]]
    lines.append(f"  -> {fits} in {report['usable_bytes'] / GB:.1f} GB usable; peak in the {report['peak_phase']} phase")
    if report.get("select_guard_peak_bytes"):
        lines.append(f"  -> train.nan_guard=select updates in place on GPUs: peak {report['select_guard_peak_bytes'] / GB:.2f} GB")
    if report["offload"]:
        lines += offload_lines(report)
    lines.append(flops_line(report))
    lines.append("step time (s):")
    for key, label in (("compute_s", "compute"), ("matmul_s", "  matmuls"),
                       ("memory_s", "  memory-bound kernels"), ("launch_s", "  kernel launches"),
                       ("bubble_s", f"pipeline bubble ({report['bubble_fraction']:.0%})"),
                       ("tp_comm_s", f"tp all-reduces ({report['links']['tp']})"),
                       ("tp_exposed_s", "  of which not overlapped"),
                       ("dp_comm_s", f"dp gradient sync ({report['links']['dp']})"),
                       ("dp_exposed_s", "  of which not overlapped"),
                       ("pp_comm_s", f"pp sends ({report['links']['pp']})"),
                       ("pp_exposed_s", "  of which not overlapped"),
                       ("cp_comm_s", f"cp K / V traffic ({report['links'].get('cp', 'none')}, not overlapped)"),
                       ("host_link_s", "host link (PCIe, offload)"),
                       ("host_link_exposed_s", "  of which not overlapped"),
                       ("host_adam_s", "AdamW on the host CPU (update=host)"),
                       ("step_s", "total (overlap modelled)"), ("step_s_no_overlap", "total without overlap")):
        if key == "cp_comm_s" and "cp" not in report["links"]:
            continue
        if key.startswith("host_") and not report["offload"]:
            continue
        lines.append(f"  {label:<40} {st[key]:9.3f}")
    lines.append(f"MFU {report['mfu']:.1%}, {report['tokens_per_s']:,.0f} tokens/s")
    return "\n".join(lines)


def offload_lines(report: dict) -> list[str]:
    """Host memory and host-link traffic per device (offload on): what offload costs for what it saves."""
    pd, moved = report["per_device_bytes"], report["host_link_bytes"]
    lines = [f"host memory per device (GB): {pd['host_total'] / GB:.2f} (optimizer state {pd['optimizer_on_host'] / GB:.2f}, "
             f"parameters {pd['params_on_host'] / GB:.2f}, gradients for the host update {pd['host_gradients'] / GB:.2f})",
             f"host link per device per step (GB, {report['pcie_gbps']:.0f} GB/s PCIe):"]
    lines += [f"  {label:<52} {moved[key] / GB:9.2f}" for key, label in HOST_LINK_ROWS if moved[key]]
    lines.append(f"  {'total':<52} {moved['total'] / GB:9.2f}")
    return lines


def flops_line(report: dict) -> str:
    """Model vs executed FLOPs per device: the gap is remat, masked pipeline slots and replicated work."""
    model, executed = report["model_flops_per_device"], report["executed_flops_per_device"]
    return (f"FLOPs per device per step: model {model:.3e} (6N + attention), executed {executed:.3e} "
            f"(x{executed / model:.2f}: remat recompute, masked pipeline slots, replicated work); "
            f"bubble {report['bubble_fraction']:.1%}")


def format_recommendation(result: dict, gpus: int, gpus_per_node: int, hw: Hardware) -> str:
    lines = [f"recommend: {gpus} x {hw.name} ({gpus // gpus_per_node} node(s) of {gpus_per_node}); "
             f"{result['considered']} valid layouts, {result['fitting']} fit in {hw.usable_bytes / GB:.1f} GB"]
    for rank, r in enumerate(result["ranked"], 1):
        lines.append(f"{rank}. {describe(r['config'])}: {r['tokens_per_s']:,.0f} tokens/s, MFU {r['mfu']:.1%}, "
                     f"peak {r['peak'] / GB:.1f} GB, step {r['step_s']:.2f}s (compute {r['compute_s']:.2f}, "
                     f"bubble {r['bubble_s']:.2f}, tp {r['tp_comm_s']:.2f}, dp {r['dp_comm_s']:.2f} ({r['dp_exposed_s']:.2f} not overlapped), pp {r['pp_comm_s']:.2f})")
        for rule, ok, detail in rules(r, gpus, gpus_per_node):
            why = "" if ok else _price(rule, r, result["alternatives"].get(rule))
            lines.append(f"     {'follows' if ok else 'BREAKS '} \"{rule}\": {detail}{why}")
        if "flags" in r:
            lines.append(f"     flags: {_flags_text(r['flags'])}")
    return "\n".join(lines)


def _flags_text(flags: list[str]) -> str:
    return " ".join(shlex.quote(f) for f in flags) or "(none: the config as written)"


def _size(n: float) -> str:
    return f"{n / GB:.2f} GB" if n >= 0.1 * GB else f"{n / 1e6:.1f} MB"


def format_compiled(rows: list[dict], hw: Hardware, config_name: str) -> str:
    """The compiled search's table (jaxpar.planner.compiled): the planner's figures beside the GPU-compiled
    ones per layout, in the compiled ranking, each layout's flags under it, and the winner's command."""
    budget = rows[0]["budget"] if rows else hw.usable_bytes
    lines = [f"compiled search: the recommender's top {len(rows)}, GPU-compiled for {hw.name} without a device "
             f"(peak: fits in {_size(budget)} usable; step and MFU: XLA's schedule estimate), planner / compiled:",
             f"{'#':>2} {'plan#':>5}  {'peak':>21}  {'fits':>4}  {'step s':>15}  {'MFU':>13}  {'compile':>7}  layout"]
    for i, row in enumerate(rows, 1):
        a, c = row["analytic"], row["compiled"]
        if "error" in c:
            lines.append(f"{i:>2} {row['analytic_rank']:>5}  {_size(a['peak']):>9} / {'-':>9}  {'-':>4}  "
                         f"{a['step_s']:>6.4g} / {'-':>6}  {a['mfu']:>5.1%} / {'-':>5}  {'FAILED':>7}  "
                         f"{describe(row['config'])}")
            lines.append(f"{'':9}compile failed: {c['error']}")
        else:
            lines.append(f"{i:>2} {row['analytic_rank']:>5}  {_size(a['peak']):>9} / {_size(c['peak']):>9}  "
                         f"{'yes' if row['compiled_fits'] else 'NO':>4}  {a['step_s']:>6.4g} / {c['step_s']:>6.4g}  "
                         f"{a['mfu']:>5.1%} / {c['mfu']:>5.1%}  {c['compile_s']:>6.0f}s  {describe(row['config'])}")
        lines.append(f"{'':9}{_flags_text(row['flags'])}")
    winner = rows[0] if rows and rows[0]["compiled_fits"] else None
    if winner is None:
        lines.append(f"none of the {len(rows)} fits when compiled: compile more (--compile K) or add GPUs")
    else:
        flags = _flags_text(winner["flags"]) if winner["flags"] else "(the config as written: no flags)"
        lines.append(f"winner: python -m jaxpar.train --config {shlex.quote(config_name)} {flags}")
    return "\n".join(lines)


def _price(rule: str, chosen: dict, alternative: dict | None) -> str:
    """Why breaking a rule is worth it: what the best layout that follows it gives."""
    if alternative is None:
        return "; no fitting layout follows it"
    slower = 1 - alternative["tokens_per_s"] / chosen["tokens_per_s"]
    return f"; the best that follows it ({describe(alternative['config'])}) is {slower:.0%} slower"
