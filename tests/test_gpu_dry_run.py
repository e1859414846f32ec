"""The GPU dry run (issue 27): jaxpar's real train step compiled by XLA's GPU compiler, no GPU needed.

Each test runs `python -m jaxpar.train --dry_run --gpu NAME` in a subprocess (the compiler's packages
come from `make gpu-aot`, put on sys.path by jaxpar.compiler.gpu_aot before JAX starts) and reads what the
GPU program says: cuDNN attention calls, async collectives, the flag bundle accepted, the fit."""

import json
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

from jaxpar.compiler import gpu_aot, hlo_collectives
from jaxpar.config import load_config
from jaxpar.parallel import schedule
from jaxpar.planner import offload
from jaxpar.compiler.xla_flags import GPU_BUNDLE

INSTALLED = gpu_aot.LOCAL_PACKAGES.is_dir() or not gpu_aot.missing_packages()
if not INSTALLED and os.environ.get("CI", "").lower() != "true":  # CI must have it: `make test` installs it
    pytest.skip("XLA's GPU compiler is not installed (make gpu-aot)", allow_module_level=True)

TINY = ["--config", "llama_tiny", "--config.precision=bf16"]  # dp 2 x tp 4, 2 layers
# vla70b's default layout until 2026-12-02 (the seed's table 6.2, configs/vla70b.py's docstring): these tests' subject
VLA70B_SEED_LAYOUT = ["mesh.dp=2", "mesh.pp=4", "mesh.sequence_parallel=false", "zero.stage=1", "remat.policy=full",
                      "pipeline.microbatches=16", "pipeline.virtual_stages=1", "grad_reduce=fp32", "vision.tp=2",
                      "actions.instruction_len=32"]


def dry_run(tmp_path, *args, env=None):
    """(completed process, dry_run.json or None) of a GPU dry run."""
    workdir = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    done = subprocess.run([sys.executable, "-m", "jaxpar.train", "--dry_run", "--workdir", str(workdir), *args],
                          capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    report = workdir / "dry_run.json"
    return done, (json.loads(report.read_text()) if report.exists() else None)


@pytest.mark.slow  # three GPU compiles
def test_cudnn_attention_under_auto_none_with_xla_and_every_bundle_flag_accepted(tmp_path):
    done, report = dry_run(tmp_path, *TINY, "--gpu", "h100")
    assert done.returncode == 0, done.stderr[-2000:]
    layers = report["config"]["model"]["n_layers"]
    assert report["target"] == "h100-80gb" and report["platform"] == "gpu" and report["devices"] == 8
    assert report["kernels"]["attention"] == "cudnn"
    assert report["kernels"]["cudnn_attention_calls"] == 2 * layers  # one forward and one backward per layer
    assert report["kernels"]["cudnn_attention_forward_calls"] == report["kernels"]["cudnn_attention_backward_calls"]
    assert report["hbm_bytes"] == gpu_aot.TARGETS["h100-80gb"].memory_bytes and report["fits"] is True
    assert all(e["async"] == e["count"] for e in report["collectives"])  # a GPU program's collectives are async
    # XLA aborts on a flag it does not know, so a finished compile accepted every one the bundle set
    bundle_line = next(line for line in done.stdout.splitlines() if "XLA flags for GPUs" in line)
    assert all(f"--{name}=" in bundle_line for name, _, _ in GPU_BUNDLE)
    # the schedule walk (jaxpar.compiler.gpu_program) sees the bytes the collectives reader (jaxpar.compiler.hlo_collectives) counts
    summed = {}
    for e in report["collectives"]:
        summed[(e["op"], e["axis"])] = summed.get((e["op"], e["axis"]), 0) + e["bytes"]
    assert {(r["op"], r["axis"]): r["bytes"] for r in report["overlap"]} == summed
    assert all(0 <= r["bytes_overlapped"] <= r["bytes"] for r in report["overlap"])
    est = report["estimate"]
    assert 0 < est["compute_s"] <= est["step_s"] and est["exposed_comm_s"] == est["step_s"] - est["compute_s"]
    parts = est["compute_parts"]  # every kernel is matmul-bound or memory-bound, plus its launch
    assert parts["memory_s"] > 0 and parts["kernels"] > 0  # (llama_tiny's GEMMs are memory-bound too)
    assert parts["matmul_s"] + parts["memory_s"] + parts["launch_s"] == pytest.approx(est["compute_s"], rel=1e-9)
    assert est["mfu"] == report["model_flops_per_device"] / (est["step_s"] * 989e12)
    assert set(report["planner"]) >= {"step_s", "mfu", "peak_bytes"} and "estimated step" in done.stdout

    done, report = dry_run(tmp_path, *TINY, "--gpu", "h100", "--config.model.attention=xla")
    assert done.returncode == 0, done.stderr[-2000:]
    assert report["kernels"] == {"attention": "xla", "cudnn_attention_calls": 0, "cudnn_attention_forward_calls": 0,
                                 "cudnn_attention_backward_calls": 0, "gemm_calls": report["kernels"]["gemm_calls"],
                                 "fp8_gemm_calls": 0}  # bf16: no GEMM is FP8
    assert report["kernels"]["gemm_calls"] > 0


def cudnn_attention_flops(config: dict, forward_calls_per_layer: int) -> float:
    """Matmul FLOPs of cuDNN attention on one device in one step, from the config (llama, pp = 1, one
    microbatch): per layer and call, the forward's QK^T and PV are 4 b h s^2 d over this device's batch
    and heads, halved by the causal mask; the backward is 2.5 times that (jaxpar.compiler.hlo_flops.fmha_flops)."""
    model, mesh, train = config["model"], config["mesh"], config["train"]
    batch, heads, seq = train["global_batch_size"] // mesh["dp"], model["n_heads"] // mesh["tp"], train["seq_len"]
    forward = 4 * batch * heads * seq * seq * (model["d_model"] // model["n_heads"]) / 2
    return model["n_layers"] * (forward_calls_per_layer * forward + 2.5 * forward)


@pytest.mark.slow  # make test's 15 minutes; it keeps the GPU compile of a pipeline's stash
def test_gradient_accumulation_keeps_one_microbatchs_activations(tmp_path):
    """grad_accum scans every microbatch from fp32 zeros: the first one computed before the scan (as it was)
    gave the GPU program a second copy of the layer scan's saved inputs beside the loop's (llama7b at 16,384
    tokens, dp 8 ZeRO-3 full remat, grad_accum 2: 39.03 -> 33.03 GiB). Here the step's temporaries with two
    microbatches stay within one microbatch's plus the fp32 accumulators (the peeled version: 619 against
    407 MiB)."""
    shape = ["--config.mesh.dp=8", "--config.mesh.tp=1", "--config.zero.stage=3", "--config.remat.policy=full",
             "--config.train.seq_len=8192", "--config.model.d_model=512", "--config.model.n_layers=4"]
    temps = {}
    for accum in (1, 2):
        done, report = dry_run(tmp_path, *TINY, "--gpu", "h100", *shape, f"--config.train.grad_accum={accum}",
                               f"--config.train.global_batch_size={8 * accum}")
        assert done.returncode == 0, done.stderr[-2000:]
        temps[accum] = report["per_device_bytes"]["temp"]
    accumulators = 4 * report["param_count"] / 8  # fp32, ZeRO-3's 1/dp shard
    assert temps[2] <= temps[1] + accumulators


@pytest.mark.parametrize("strategy", ["all_gather", pytest.param("ring", marks=pytest.mark.slow)])
def test_context_parallel_attention_runs_causal_or_unmasked_blocks_at_half_the_flops(tmp_path, strategy):
    """Issue 48: under cp every cuDNN call is a causal diagonal block or an unmasked half block (no bias, no
    [S_local, T] mask), and together they execute exactly the causal attention's FLOPs: a device's queries
    are 1/cp of the sequence against all of it, at half. The program holds 1 + 2 (cp - 1) forward calls per
    layer (each non-own block is a cond of two equal branches, jaxpar.layers.ring), of which cp run."""
    cp = 2
    done, report = dry_run(tmp_path, *TINY, "--gpu", "h100", "--config.remat.policy=selective",
                           "--config.mesh.dp=1", f"--config.mesh.cp={cp}", "--config.mesh.tp=4",
                           f"--config.mesh.cp_strategy={strategy}")
    assert done.returncode == 0, done.stderr[-2000:]
    layers, kernels, executed = report["config"]["model"]["n_layers"], report["kernels"], report["executed_flops"]
    assert kernels["attention"] == "cudnn" and "never a bias" in done.stdout
    assert kernels["cudnn_attention_forward_calls"] == kernels["cudnn_attention_backward_calls"] == layers * (2 * cp - 1)
    assert executed["attention"] == cudnn_attention_flops(report["config"], 1) / cp


def live_at_peak(dump: pathlib.Path) -> dict[str, int]:
    """{buffer: bytes} live at the train step's peak, from XLA's live-range dump (XLA_FLAGS=--xla_dump_to)."""
    text = next(dump.glob("*jit_train_step*gpu_after_optimizations-live-range.txt")).read_text()
    at_peak = text[text.index("(peak):"):text.index("Stack trace breakdown")]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^\s+(\S+): (\d+) bytes", at_peak, re.M)}


@pytest.mark.slow  # make test's 15 minutes; it keeps cp's half-FLOP blocks on the GPU compiler
@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_context_parallel_backward_adds_each_blocks_gradients_before_the_next_block(tmp_path, strategy):
    """Each block's backward kernel (a cond: jaxpar.layers.ring) waits for the previous block's dq and dK / dV to be
    added. Left free, XLA's GPU scheduler ran all cp blocks' kernels first and kept every block's fp32 dq and dK
    (and all_gather's dV) until the adds after the last: 15 (ring) and 13 (all_gather) such block-sized conditional
    outputs were live at this peak; now at most one block's three and one more. 2 heads of 128 (cuDNN), 4,096
    tokens a rank: a block's fp32 gradient is 4 MiB."""
    cp, local = 8, 4096
    done, report = dry_run(tmp_path, *TINY, "--gpu", "h100", "--config.mesh.dp=1", "--config.mesh.tp=1",
                           f"--config.mesh.cp={cp}", f"--config.mesh.cp_strategy={strategy}",
                           f"--config.train.seq_len={cp * local}", "--config.train.global_batch_size=1",
                           "--config.model.d_model=256", "--config.model.n_heads=2", "--config.model.n_kv_heads=2",
                           "--config.zero.stage=0", "--config.remat.policy=full",
                           env={"XLA_FLAGS": f"--xla_dump_to={tmp_path / 'dump'}"})
    assert done.returncode == 0, done.stderr[-2000:]
    block_gradient = 4 * local * 2 * 128
    held = [name for name, size in live_at_peak(tmp_path / "dump").items()
            if name.startswith("conditional.") and size == block_gradient]
    assert len(held) <= 4, held


@pytest.mark.parametrize("policy, forward_calls_per_layer", [("selective", 1), pytest.param("dots", 1, marks=pytest.mark.slow),
                                                                  pytest.param("full", 2, marks=pytest.mark.slow)])
def test_remat_keeps_cudnn_attentions_residuals_and_its_flops_are_counted(tmp_path, policy, forward_calls_per_layer):
    """The policies that keep the attention output keep cuDNN's softmax statistics with it (jaxpar.layers.
    attention.cudnn_attention names both), so the backward does not run the flash forward again: one
    forward call per layer, as without remat (it was two before the statistics were named). `full` keeps
    neither and re-runs it. The fMHA calls' matmuls are in the executed FLOPs, exactly the config's count."""
    done, report = dry_run(tmp_path, *TINY, "--gpu", "h100", f"--config.remat.policy={policy}")
    assert done.returncode == 0, done.stderr[-2000:]
    layers, kernels, executed = report["config"]["model"]["n_layers"], report["kernels"], report["executed_flops"]
    assert kernels["attention"] == "cudnn" and kernels["cudnn_attention_backward_calls"] == layers
    assert kernels["cudnn_attention_forward_calls"] == forward_calls_per_layer * layers
    assert executed["attention"] == cudnn_attention_flops(report["config"], forward_calls_per_layer)
    assert executed["uncounted"] == [] and "not counted" not in done.stdout
    assert executed["total"] == executed["dot"] + executed["attention"] == report["executed_flops_per_device"]
    assert report["estimate"]["executed_flops"] == pytest.approx(executed["total"], rel=1e-12)  # the schedule walk's


@pytest.mark.parametrize("policy, forward_calls_per_block", [pytest.param("selective", 1, marks=pytest.mark.slow),
                                                                  pytest.param("full", 2, marks=[pytest.mark.slow,
                                                                                                 pytest.mark.extra])])
# extra: CI's budget; the selective case takes the same cuDNN call
def test_the_vit_keeps_cudnn_attentions_residuals_too(tmp_path, policy, forward_calls_per_block):
    """vla_tiny's encoder takes cuDNN (no mask; its LLM's prefix-LM mask keeps XLA attention under `auto`)
    through the same named-residual call as the LLM (jaxpar.layers.attention.core_attention)."""
    done, report = dry_run(tmp_path, "--config", "vla_tiny", "--config.precision=bf16", "--gpu", "h100",
                           f"--config.vision.remat.policy={policy}")
    assert done.returncode == 0, done.stderr[-2000:]
    blocks, kernels = report["config"]["vision"]["depth"], report["kernels"]
    assert kernels["cudnn_attention_backward_calls"] == blocks
    assert kernels["cudnn_attention_forward_calls"] == forward_calls_per_block * blocks


@pytest.mark.slow  # make test's 15-minute budget (CI runs make test-slow too)
def test_sequence_parallelism_reduce_scatters_and_all_gathers_over_tp(tmp_path):
    done, report = dry_run(tmp_path, *TINY, "--gpu", "a100-80gb", "--config.mesh.sequence_parallel=true")
    assert done.returncode == 0, done.stderr[-2000:]
    ops = {(e["op"], e["axis"]) for e in report["collectives"]}
    assert {("reduce-scatter", "tp"), ("all-gather", "tp")} <= ops
    assert report["target"] == "a100-80gb"


@pytest.mark.parametrize("args, message", [
    (["--gpu", "v100"], "--gpu=v100: no GPU target of that name; use one of"),
    (["--gpu", "h100", "--gpus_per_node", "3"], "--gpus_per_node=3: the mesh's 8 devices do not fill whole nodes"),
])
def test_mistakes_are_one_line(tmp_path, args, message):
    done, report = dry_run(tmp_path, *TINY, *args)
    assert done.returncode != 0 and report is None
    assert done.stderr.strip().splitlines()[-1].startswith(f"jaxpar: error: {message}"), done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_gpu_without_dry_run_and_missing_compiler_are_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "jaxpar.train", *TINY, "--gpu", "h100", "--workdir",
                           str(tmp_path / "w")], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == ("jaxpar: error: --gpu=h100 compiles for GPUs this machine does "
                                                    "not have: add --dry_run")
    assert not (tmp_path / "w" / "config.json").exists()
    if not gpu_aot.LOCAL_PACKAGES.is_dir():
        return  # the packages are in this environment itself: nothing can hide them
    done, _ = dry_run(tmp_path, *TINY, "--gpu", "h100", env={"JAXPAR_GPU_AOT_PATH": str(tmp_path / "none")})
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "--gpu needs XLA's GPU compiler, which is not installed" in done.stderr.strip().splitlines()[-1]
    assert "make gpu-aot" in done.stderr


@pytest.mark.slow  # (test_layout checks fast that the entry points import no JAX before --gpu's set-up)
def test_a_config_whose_validation_imports_model_code_still_finds_the_compiler(tmp_path):
    """A VLA with sequence parallelism is validated with its model code, which imports JAX: the compiler's
    packages must be on the path before that (it failed with "topology not implemented for cuda")."""
    done, report = dry_run(tmp_path, "--config", "vla_tiny", "--config.mesh.sequence_parallel=true",
                           "--config.mesh.dp=4", "--config.mesh.pp=1", "--config.pipeline.microbatches=1", "--gpu", "h100")
    assert done.returncode == 0, done.stderr[-2000:]
    assert report["target"] == "h100-80gb" and report["config"]["mesh"]["sequence_parallel"] is True


def overlap(report, op, axis) -> dict:
    return next(r for r in report["overlap"] if (r["op"], r["axis"]) == (op, axis))


@pytest.mark.slow  # make test's 15-minute budget (CI runs make test-slow too)
def test_zero3_prefetch_gathers_the_next_layer_during_this_layers_gemms(tmp_path):
    done, report = dry_run(tmp_path, *TINY, "--gpu", "h100", "--config.mesh.dp=8", "--config.mesh.tp=1",
                           "--config.zero.stage=3", "--config.remat.policy=full", "--config.model.n_layers=4")
    assert done.returncode == 0, done.stderr[-2000:]
    assert report["components"]["llm"]["zero3_prefetch"] is True
    gathers = overlap(report, "all-gather", "dp")
    assert gathers["bytes_overlapped"] >= gathers["bytes"] / 2 > 0


@pytest.mark.slow  # make test's 15-minute budget (CI runs make test-slow too)
def test_offloaded_parameters_come_in_by_async_copies_inside_the_layer_scan(tmp_path):
    """offload.params (issue 32): each layer's shard is an async slice out of host memory, forward and backward;
    the deviceless program moves the layers' shards to the host once at its start (a GPU run moves the
    updated ones back at its end): 1 + 2 passes of the layers' shards over the host link. (XLA drops the
    to-host-and-back of the embedding, head and final norm, which are not sliced: not counted here.)"""
    done, report = dry_run(tmp_path, *TINY, "--gpu", "h100", "--config.mesh.dp=8", "--config.mesh.tp=1",
                           "--config.zero.stage=3", "--config.remat.policy=full", "--config.model.n_layers=4",
                           "--config.offload.params=true")
    assert done.returncode == 0, done.stderr[-2000:]
    per_device = report["per_device_bytes"]
    assert per_device["params"] == 0 and per_device["params_host"] > 0
    copies = overlap(report, "host-copy", "host")
    vocab, d_model, dp, bf16 = 264, 64, 8, 2  # llama_tiny
    outside_layers = (2 * vocab * d_model + d_model) * bf16 // dp  # embedding, head, final norm
    assert copies["bytes"] == 3 * (per_device["params_host"] - outside_layers)
    assert copies["bytes_overlapped"] > 0


@pytest.mark.slow
def test_remat_offload_copies_are_the_planners_host_link_bytes(tmp_path):
    """remat=offload: each layer forward copies its named linear outputs and cuDNN's softmax statistics
    to the host (an async dynamic-update-slice into a host array, counted by what it moves, not the
    array it writes) and the backward copies them back; the planner's host-link bytes
    (jaxpar.planner.offload.link_bytes) are the compiled program's, byte for byte."""
    overrides = ["mesh.dp=8", "mesh.tp=1", "remat.policy=offload", "model.n_layers=4", "train.seq_len=256"]
    done, report = dry_run(tmp_path, *TINY, "--gpu", "h100", *[f"--config.{o}" for o in overrides])
    assert done.returncode == 0, done.stderr[-2000:]
    config = load_config("llama_tiny.py", ["precision=bf16", *overrides])
    planned = offload.link_bytes(config, compute_capability=9.0)
    assert planned["activations_out"] > 0
    assert overlap(report, "host-copy", "host")["bytes"] == planned["total"]


@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.slow), 1, pytest.param(2, marks=pytest.mark.slow)])
def test_dp_traffic_runs_beside_compute_without_a_pipeline(tmp_path, stage):
    """Issue 30: without a pipeline each layer's gradient is reduced inside the backward's layer scan
    (ZeRO 0-1: all-reduce taps, jaxpar.parallel.zero.reduce_tap; 2: reduce-scatter taps), so with ZeRO
    1-2's gathers of the updated weights at least 70% of the dp bytes overlap compute in the GPU
    schedule: llama_tiny with 4 layers at dp 8 on 8 H100s. Before the taps ZeRO 0 and 1 reduced
    after the backward and overlapped 8 bytes of 1.13 MiB."""
    done, report = dry_run(tmp_path, *TINY, "--gpu", "h100", "--config.mesh.dp=8", "--config.mesh.tp=1",
                           f"--config.zero.stage={stage}", "--config.model.n_layers=4")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [r for r in report["overlap"] if r["axis"] == "dp"]
    moved, hidden = sum(r["bytes"] for r in rows), sum(r["bytes_overlapped"] for r in rows)
    assert hidden >= 0.7 * moved > 0, rows


# A model big enough that XLA's scheduler finds overlapping a gradient reduction worth it (d_model 1024)
MEDIUM = ["--config.model.d_model=1024", "--config.model.d_ff=4096", "--config.model.n_heads=8",
          "--config.model.n_kv_heads=8", "--config.train.seq_len=1024", "--config.model.n_layers=4"]


@pytest.mark.slow
def test_the_pipelines_early_dp_reductions_overlap_the_later_ticks_at_v2(tmp_path):
    """At v = 2 the top chunk's gradients are final before the last tick and reduced there (jaxpar.parallel.
    pipeline): about half the dp bytes run beside the remaining ticks. Without after_on_every_backend
    XLA's all-reduce combiner merged them with the rest into one reduction after the last tick (0 bytes)."""
    done, report = dry_run(tmp_path, *TINY, *MEDIUM, "--gpu", "h100", "--gpus_per_node", "4", "--config.mesh.dp=2",
                           "--config.mesh.pp=2", "--config.mesh.tp=2", "--config.pipeline.virtual_stages=2",
                           "--config.pipeline.microbatches=4")
    assert done.returncode == 0, done.stderr[-2000:]
    reductions = overlap(report, "all-reduce", "dp")
    assert reductions["bytes_overlapped"] >= 0.4 * reductions["bytes"]


# The H200 measurements in BENCHMARKS.md (first section): the 1B Llama, XLA attention, seconds per step
H200_STEP_S = {"none": 0.324, "selective": 0.251, "full": 0.285}


@pytest.mark.slow
@pytest.mark.parametrize("policy", sorted(H200_STEP_S))
def test_the_estimate_is_within_35_percent_of_the_h200_measurements(tmp_path, policy):
    done, report = dry_run(tmp_path, "--config", "llama1b", "--gpu", "h200", "--config.model.attention=xla",
                           f"--config.remat.policy={policy}")
    assert done.returncode == 0, done.stderr[-2000:]
    ratio = report["estimate"]["step_s"] / H200_STEP_S[policy]
    print(f"{policy}: estimated {report['estimate']['step_s']:.3f} s, measured {H200_STEP_S[policy]} s")
    assert 1 / 1.35 < ratio < 1.35, ratio


@pytest.mark.slow
def test_vla70b_on_64_a100s_compiles_in_under_3_minutes(tmp_path):
    start = time.perf_counter()
    done, report = dry_run(tmp_path, "--config", "vla70b", "--gpu", "a100-80gb",
                           *(f"--config.{o}" for o in VLA70B_SEED_LAYOUT))
    seconds = time.perf_counter() - start
    assert done.returncode == 0, done.stderr[-2000:]
    assert report["devices"] == 64 and report["target"] == "a100-80gb" and report["kernels"]["attention"] == "cudnn"
    assert seconds < 180, seconds


@pytest.mark.slow  # one GPU compile of a slim vla70b (~1 minute)
def test_a_tick_with_forward_and_backward_writes_the_stash_in_place(tmp_path):
    """vla70b's layout (pp 8, 10 virtual stages, m 8: 8 ticks run F, L and B) with small widths. The last
    virtual stage's B reads the stash entry its F writes in the same tick; read after that in-place
    write, XLA copied each residual's whole stash buffer (81 entries) in every such tick (4 copies in
    this program before Pipeline._entries_before_forward). No copy of a stash buffer may be left in a
    loop body."""
    slim = ["model.d_model=1024", "model.d_ff=2048", "model.n_heads=8", "model.n_kv_heads=8", "vision.width=256",
            "vision.depth=2", "vision.n_heads=8", "vision.mlp_dim=512", "vision.projector_dim=512"]
    workdir = tmp_path / "slim"
    done = subprocess.run([sys.executable, "scripts/gpu_kernel_table.py", "compile", "--config", "configs/vla70b.py",
                           "--dry_run", "--gpu", "a100-80gb", "--gpus_per_node", "8", "--workdir", str(workdir),
                           *(f"--config.{o}" for o in slim)], capture_output=True, text=True, timeout=600,
                          cwd=pathlib.Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    text = (workdir / "step.hlo.txt").read_text()
    config = load_config("vla70b")
    entries = schedule.build("1f1b", 8, config.pipeline.microbatches, config.pipeline.virtual_stages).stash_slots + 1
    comps, _ = hlo_collectives.parse_module(text)
    bodies = set(re.findall(r"body=%?([\w.\-]+)", text))
    assert bodies
    copies = [ins["name"] for name in bodies for ins in comps.get(name, [])
              if ins["op"] == "copy" and re.match(rf"\w+\[{entries},", ins["shape"])]
    assert copies == []


# The planner against the GPU compiler (issue 27 item 7), as bounds: tests/test_plan_compiled.py.


@pytest.mark.slow  # two llama7b compiles
def test_the_select_nan_guard_updates_in_place_on_the_gpu(tmp_path):
    """XLA's GPU conditional writes the whole new optimizer state to fresh buffers; the guard as a select
    fused into each leaf's update does not (docs/design.md "The NaN guard"), and `auto`, the default, is
    the select on GPUs: llama7b at dp 8 ZeRO-3, whose peak is the update, compiles at least 10% smaller
    than with the cond (measured 24.33 -> 19.61 GB)."""
    layout = ["--config.mesh.dp=8", "--config.mesh.tp=1", "--config.zero.stage=3", "--config.remat.policy=full"]
    peaks = {}
    for guard in ("cond", "auto"):
        done, report = dry_run(tmp_path, "--config", "llama7b", "--gpu", "h100", *layout, f"--config.train.nan_guard={guard}")
        assert done.returncode == 0, done.stderr[-2000:]
        assert report["nan_guard"] == {"cond": "cond", "auto": "select"}[guard]
        peaks[guard] = report["per_device_bytes"]["peak"]
    assert peaks["auto"] < 0.9 * peaks["cond"], peaks


FP8_PROBE = """
import re, sys
from jaxpar.compiler import gpu_aot
gpu_aot.prepare_environment()
import jax, jax.numpy as jnp
device = gpu_aot.gpu_devices(gpu_aot.target(sys.argv[1]), 1, 8)[0]
def scaled_fp8_dot(a, b, sa, sb):  # the quantize / dequantize pattern XLA rewrites into an FP8 GEMM
    a8, b8 = (a / sa).astype(jnp.float8_e4m3fn), (b / sb).astype(jnp.float8_e4m3fn)
    y = jnp.dot(a8.astype(jnp.bfloat16), b8.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    return (y * (sa * sb)).astype(jnp.bfloat16)
s = jax.sharding.SingleDeviceSharding(device)
args = [jax.ShapeDtypeStruct(shape, dtype, sharding=s) for shape, dtype in
        (((256, 512), jnp.bfloat16), ((512, 128), jnp.bfloat16), ((), jnp.float32), ((), jnp.float32))]
text = jax.jit(scaled_fp8_dot).lower(*args).compile().as_text()
from jaxpar.compiler import hlo_flops
print(hlo_flops.executed_flops(text)["dot"])
print(sorted(set(re.findall(r'custom_call_target="([^"]+)"', text))))
"""


@pytest.mark.parametrize("gpu, gemm", [("h100", "__cublas$lt$matmul$f8"), ("a100", "__cublas$lt$matmul")])
def test_the_target_config_names_the_cuda_runtime_so_hopper_forms_fp8_gemms(gpu, gemm):
    """Without `runtime_version` in the target config XLA's GPU compiler never forms an FP8 GEMM (issue
    47): the scaled E4M3 dot stays a bf16 cuBLASLt matmul on H100 too. A100 has no FP8 tensor cores.
    The FP8 GEMM's FLOPs are counted like any GEMM's (2 x 256 x 512 x 128)."""
    assert "runtime_version { major: 12 minor: 9 patch: 0 }" in gpu_aot.target_config(gpu_aot.target("h100"), (12, 9))
    done = subprocess.run([sys.executable, "-c", FP8_PROBE, gpu], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    *_, flops, targets = done.stdout.strip().splitlines()
    assert targets == repr([gemm])
    assert float(flops) == 2 * 256 * 512 * 128


@pytest.mark.slow  # two GPU compiles of a 2-layer llama7b (about 20 s each)
def test_fp8_runs_every_linear_gemm_of_forward_and_backward_in_fp8(tmp_path):
    """precision=fp8 on H100 (issue 47): q, k, v, o, gate, up and down, each as a forward, an input-gradient
    and a weight-gradient GEMM, all FP8 cuBLASLt GEMMs, fed by the FP8 weights ZeRO-3 gathers; the LM head's
    three stay bf16. bf16 forms none."""
    two_layers = ["--config", "configs/llama7b.py", "--config.model.n_layers=2", "--gpu", "h100"]
    done, fp8 = dry_run(tmp_path, *two_layers, "--config.precision=fp8")
    assert done.returncode == 0, done.stderr[-2000:]
    assert fp8["kernels"]["fp8_gemm_calls"] == 2 * 7 * 3
    assert fp8["kernels"]["gemm_calls"] == 2 * 7 * 3 + 3
    assert fp8["cuda_runtime"] == "%d.%d" % gpu_aot.cuda_version()
    # ZeRO-3 (llama7b's dp 8) gathers each layer's linear weights (4 x 4096^2 + 3 x 4096 x 11008) as E4M3, one byte
    # an element, in the forward and again in the backward (fp8.zero3_gather=fp8)
    u8 = [e for e in fp8["collectives"] if e["op"] == "all-gather" and e["dtype"] == "u8"]
    assert sum(e["bytes"] for e in u8) == 2 * 2 * (4 * 4096 ** 2 + 3 * 4096 * 11008) and {e["axis"] for e in u8} == {"dp"}
    done, bf16 = dry_run(tmp_path, *two_layers, "--config.precision=bf16")
    assert done.returncode == 0, done.stderr[-2000:]
    assert bf16["kernels"]["fp8_gemm_calls"] == 0 and bf16["kernels"]["gemm_calls"] == fp8["kernels"]["gemm_calls"]
