"""Layout recommender: enumerate (dp, pp, cp, tp, ZeRO, remat, m), drop what does not fit, rank by
estimated throughput, and say which of the seeds' planning rules each choice follows or breaks.

Rules (the first seed, sections 2.4, 4.1, 4.4): "TP <= 8 inside a node, PP = number of nodes, DP =
the rest"; "m >= 4p keeps the bubble under 25%" (with jaxpar's exact (p-1)/(m+p-1), m >= 4p gives
<= (p-1)/(5p-1) < 20%); "checkpointing before offload". Candidates keep the config's global batch,
model and precision; everything else is searched. Invalid layouts are those jaxpar.config.validate
refuses (e.g. ZeRO-3 with a pipeline, tp not dividing the heads, a sequence that cp does not cut
into 2 cp chunks).

Context parallelism (mesh.cp) multiplies the search (every split of the devices now has a third
factor), so cp > 1 is searched as follows:
- cp may cross nodes (its group spans processes: jaxpar.parallel.mesh puts tp, then cp, inside a node);
  the planner prices its per-layer traffic at the link the group uses (NVLink inside a node, the NICs
  across), so cp x tp beyond a node ranks below a layout that needs no cross-node K / V traffic unless
  nothing else fits (llama7b at 1,048,576 tokens on 64 GPUs).
- All three strategies: all_gather keeps the whole sequence's K / V on each rank (where a policy keeps
  the gathered tensors) and moves fewer bytes in the backward; the ring keeps none, and sends its
  dK / dV in fp32 (planner/memory.py, cost.py), so the ring wins where the gathered K / V do not fit.
  Ulysses (where the heads divide over cp x tp) moves q, k, v and the output by all-to-alls and runs one
  device's kernel on 1/cp of the heads.
- Only the smallest microbatch the search tries for that mesh (one sequence with a pipeline):
  cp cuts a microbatch's tokens, as splitting it into more microbatches (or more dp) does without
  the K / V traffic, so cp is the next step after the batch cannot be split further. vla70b's
  64-GPU search holds 2,980 valid layouts with this rule and 5,905 without it (2,314 while cp stayed
  inside a node, before 2026-12-06); with the schedule tables cached (jaxpar.parallel.schedule.build)
  the 2,980 take about 5 s (`python -m jaxpar.plan --config configs/vla70b.py --gpu a100-80gb
  --recommend --gpus 64`).
So cp is picked where sequences are long (activations bind; e.g. llama7b at 917,504 tokens on 8
A100-80GB fits only with cp) and not at the configs' short defaults, where it only adds traffic.
The search times only the layouts that fit (their peak decides which are ranked).

Host offload (OFFLOADS), only on top of full remat ("checkpointing before offload"): the optimizer state
with the update on the device or on the host (DeepSpeed's CPU Adam), and with ZeRO-3 the parameters
too. The planner prices the host link and the host AdamW (planner/offload.py; the host's memory
bandwidth is an assumption), so these rank by the same throughput as the rest.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

from jaxpar.config import Config, MeshConfig, OffloadConfig, PipelineConfig, RematConfig, ZeroConfig, validate
from jaxpar.errors import ConfigError
from jaxpar.planner import cost, memory
from jaxpar.compiler.hardware import GB, Hardware

REMATS = ("none", "selective", "full")
# Host offload choices (checkpointing before offload: each only with full remat): the optimizer state
# brought to the device for the update, or updated on the host; ZeRO-3's parameters on the host too.
OFFLOADS = (OffloadConfig(),
            OffloadConfig(optimizer=True),
            OffloadConfig(optimizer=True, update="host"),
            OffloadConfig(params=True),
            OffloadConfig(optimizer=True, update="host", params=True))
CP_STRATEGIES = ("all_gather", "ring", "ulysses")  # priced apart: see the module docstring


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _with(config: Config, dp, pp, tp, zero, remat, m, offload: OffloadConfig, vision_tp, sp=False, cp=1,
          cp_strategy="all_gather") -> Config:
    return dataclasses.replace(
        config, mesh=MeshConfig(dp, pp, tp, sequence_parallel=sp, cp=cp, cp_strategy=cp_strategy),
        zero=ZeroConfig(zero), remat=RematConfig(remat),
        pipeline=_pipeline(config, pp, m),
        train=dataclasses.replace(config.train, grad_accum=1 if pp > 1 or config.model.kind == "vla" else m),
        offload=offload,
        vision=dataclasses.replace(config.vision, tp=vision_tp))


def _pipeline(config: Config, pp: int, m: int) -> PipelineConfig:
    """The config's pipeline options (schedule, and virtual stages / stage recompute where the config
    has them) with m microbatches; the defaults without pp."""
    return dataclasses.replace(config.pipeline, microbatches=m) if pp > 1 else PipelineConfig()


def _vision_tps(config: Config, tp: int) -> list[int]:
    """The config's vision.tp where it divides tp, else (or when the images do not split evenly over
    the other devices) the next candidates up to tp."""
    if config.model.kind != "vla":
        return [config.vision.tp]
    return sorted({k for k in divisors(tp) if k >= min(config.vision.tp, tp)}, key=lambda k: (k != config.vision.tp, k))


def candidates(config: Config, gpus: int) -> Iterator[Config]:
    """Every layout of `gpus` devices that jaxpar.config.validate accepts, cp pruned as the module says."""
    batch = config.train.global_batch_size
    for tp in divisors(gpus):
        for pp in divisors(gpus // tp):
            for cp in divisors(gpus // tp // pp):
                dp = gpus // tp // pp // cp
                if batch % dp:
                    continue
                per_dp = batch // dp
                splits = [k for k in divisors(per_dp) if pp > 1 and k >= pp or pp == 1 and k <= 8] or [per_dp]
                if pp == 1 and config.model.kind == "vla":  # a VLA encodes the whole batch at once: no grad_accum
                    splits = [1]
                if cp > 1:  # cp only once the microbatch is split as far as the search splits it
                    splits = splits[-1:]
                yield from _variants(config, dp, pp, cp, tp, splits)


def _variants(config: Config, dp: int, pp: int, cp: int, tp: int, splits: list[int]) -> Iterator[Config]:
    """The valid (m, ZeRO, remat, offload, sequence parallel, cp strategy, vision tp) choices of one mesh."""
    for m in splits:
        for zero in range(4 if pp == 1 else 3) if dp * cp > 1 else (0,):  # ZeRO shards over dp x cp; 1: stages equal
            for remat in REMATS:
                for offload in OFFLOADS:
                    if offload != OffloadConfig() and remat != "full":
                        continue  # checkpointing before offload: offload only on top of full remat
                    for sp in (False, True) if tp > 1 else (False,):  # sequence parallel: less memory
                        for strategy in CP_STRATEGIES if cp > 1 else ("all_gather",):
                            for vision_tp in _vision_tps(config, tp):
                                candidate = _with(config, dp, pp, tp, zero, remat, m, offload, vision_tp, sp,
                                                  cp, strategy)
                                try:
                                    validate(candidate)
                                except ConfigError:
                                    continue
                                yield candidate
                                break


def evaluate(config: Config, hw: Hardware, gpus_per_node: int, time_unfit: bool = True, target: str = "gpu") -> dict:
    """Peak, whether it fits, and the step time (`time_unfit=False`: only for a layout that fits; the
    search ranks only those, and the step time is most of the cost: schedule tables). `target`: the
    compiler whose memory the peak models (memory.estimate; "cpu" for the trainer's preflight on CPUs)."""
    mem = memory.estimate(config, target, hw.compute_capability)["per_device_bytes"]
    fits = mem["peak"] <= hw.usable_bytes
    time = cost.step_time(config, hw, gpus_per_node) if fits or time_unfit else {}
    return {"config": config, "peak": mem["peak"], "fits": fits, **time}


def describe(config: Config) -> str:
    mesh, p = config.mesh, config.mesh.pp
    virtual = f", v={config.pipeline.virtual_stages}" if config.pipeline.virtual_stages > 1 else ""
    split = f"m={config.pipeline.microbatches} ({config.pipeline.schedule}{virtual})" if p > 1 else \
        f"grad_accum={config.train.grad_accum}"
    off = (" +offload.optimizer" if config.offload.optimizer else "") + \
        (" (update=host)" if config.offload.optimizer and config.offload.update == "host" else "") + \
        (" +offload.params" if config.offload.params else "")
    sp = " +sequence_parallel" if mesh.sequence_parallel else ""
    cp = f" cp={mesh.cp} ({mesh.cp_strategy})" if mesh.cp > 1 else ""
    return f"dp={mesh.dp} pp={p}{cp} tp={mesh.tp}{sp} zero={config.zero.stage} remat={config.remat.policy}{off} {split}"


def rules(result: dict, gpus: int, gpus_per_node: int) -> list[tuple[str, bool, str]]:
    """(rule, followed, detail) for one layout."""
    config = result["config"]
    mesh, nodes = config.mesh, max(gpus // gpus_per_node, 1)
    p, m = mesh.pp, config.pipeline.microbatches
    out = [("TP <= 8 inside a node", mesh.tp <= min(8, gpus_per_node),
            f"tp={mesh.tp} all-reduces over {result['links']['tp']}"),
           ("PP = number of nodes", p == nodes, f"pp={p}, {nodes} node(s); DP = the rest = {mesh.dp}")]
    if p > 1:
        out.append(("m >= 4p keeps the bubble under 25%", m >= 4 * p,
                    f"m={m}, p={p}: bubble {result['bubble_fraction']:.0%}"))
    if config.offload.optimizer or config.offload.params:
        out.append(("checkpointing before offload", config.remat.policy == "full",
                    f"remat={config.remat.policy}, " + ("optimizer state" if config.offload.optimizer else "parameters")
                    + " in host memory"))
    return out


def _one_per_layout(ranked: list[dict]) -> list[dict]:
    """Drop a sequence-parallel variant ranked after the same layout without it: it is listed only
    where it is faster or needs less memory (ties keep the plain layout, which comes first)."""
    seen, out = set(), []
    for result in ranked:
        key = describe(dataclasses.replace(result["config"], mesh=dataclasses.replace(
            result["config"].mesh, sequence_parallel=False)))
        if key not in seen:
            seen.add(key)
            out.append(result)
    return out


def recommend(config: Config, gpus: int, gpus_per_node: int, hw: Hardware, top: int = 5, target: str = "gpu") -> dict:
    """The `top` fitting layouts by estimated tokens/s, the rules each follows, and the best layout
    that follows each rule (so a broken rule comes with its price); `target` as for `evaluate`."""
    if gpus_per_node > gpus:
        raise ConfigError(f"--gpus_per_node={gpus_per_node} is more than --gpus={gpus}; "
                          f"use --gpus_per_node <= {gpus}")
    if gpus % gpus_per_node:
        raise ConfigError(f"--gpus={gpus} is not a whole number of {gpus_per_node}-GPU nodes")
    results = [evaluate(c, hw, gpus_per_node, time_unfit=False, target=target)
               for c in candidates(config, gpus)]
    if not results:
        raise ConfigError(f"no valid (dp, pp, cp, tp) layout of {gpus} GPUs for this model and global batch "
                          f"{config.train.global_batch_size}; change --gpus or train.global_batch_size")
    fitting = _one_per_layout(sorted((r for r in results if r["fits"]), key=lambda r: (-r["tokens_per_s"], r["peak"])))
    if not fitting:
        best = min(results, key=lambda r: r["peak"])
        raise ConfigError(f"no layout of {gpus} x {hw.name} fits: the smallest estimated peak is "
                          f"{best['peak'] / GB:.1f} GB ({describe(best['config'])}), "
                          f"{(best['peak'] - hw.usable_bytes) / GB:.1f} GB over the {hw.usable_bytes / GB:.1f} GB usable; "
                          f"add GPUs or use a GPU with more memory")
    chosen = fitting[:top]
    alternatives = {}
    for rule, _, _ in rules(fitting[0], gpus, gpus_per_node):
        following = [r for r in fitting if any(n == rule and ok for n, ok, _ in rules(r, gpus, gpus_per_node))]
        alternatives[rule] = following[0] if following else None
    return {"ranked": chosen, "considered": len(results), "fitting": len(fitting), "alternatives": alternatives}
