"""The planner: analytic estimates against the compiled program, the recommender, the CLI's errors.

The agreement cases compile tiny fp32 models on the 8 emulated CPU devices (fast compile, as in
test_dry_run.py) with sequences long enough that attention activations dominate, and compare the
estimated peak (target "cpu": what XLA:CPU allocates) with the dry run's compiled peak.
"""

import dataclasses
import json
import subprocess
import sys
from unittest import mock

import jax
import pytest

from conftest import builder_for
from jaxpar import dry_run as dr
from jaxpar.config import (Config, MeshConfig, ModelConfig, PipelineConfig, RematConfig, TrainConfig, ZeroConfig,
                           load_config, validate)
from jaxpar.planner import cost, hardware, memory, recommend

MODEL = ModelConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=8, n_kv_heads=8, d_ff=256)
FAST_COMPILE = {"xla_backend_optimization_level": 0}
_compile = jax.stages.Lowered.compile


def _fast_compile(self, compiler_options=None, **kwargs):
    return _compile(self, {**FAST_COMPILE, **(compiler_options or {})}, **kwargs)


def tiny(dp=1, pp=1, tp=1, stage=0, remat="none", m=1, precision="fp32") -> Config:
    config = Config(mesh=MeshConfig(dp, pp, tp), zero=ZeroConfig(stage), precision=precision,
                    train=TrainConfig(global_batch_size=16, seq_len=128), model=MODEL, remat=RematConfig(remat),
                    pipeline=PipelineConfig("1f1b", m))
    validate(config)
    return config


def compiled_peak(config: Config) -> int:
    builder = builder_for(config)
    with mock.patch.object(jax.stages.Lowered, "compile", _fast_compile):
        return dr.dry_run(config, builder.mesh)["per_device_bytes"]["peak"]


AGREEMENT = [  # attention-heavy (none), Megatron selective, ZeRO-2 with full remat, 1F1B x tp x dp
    dict(dp=2, tp=4, remat="none"),
    dict(dp=2, tp=4, remat="selective", stage=1, precision="bf16"),
    dict(dp=8, stage=2, remat="full"),
    dict(dp=2, pp=2, tp=2, stage=1, remat="full", m=4),
]


@pytest.mark.parametrize("layout", AGREEMENT, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_estimated_peak_within_20_percent_of_compiled(layout):
    config = tiny(**layout)
    estimate = memory.estimate(config, target="cpu")["per_device_bytes"]["peak"]
    assert estimate == pytest.approx(compiled_peak(config), rel=0.20)


def test_state_terms_are_the_zero_table():
    """params + master + Adam = (2 + 12) Psi / N where sharded, Psi counted from the shapes."""
    config = load_config("llama7b.py", ["mesh.dp=8", "mesh.tp=1", "zero.stage=1"])
    per_device = memory.estimate(config)["per_device_bytes"]
    psi = 6_738_415_616
    assert per_device["params"] == 2 * psi
    assert per_device["master"] + per_device["optimizer"] == pytest.approx(12 * psi / 8)


def test_activations_order_by_remat_policy_and_1f1b_is_flat_in_m():
    acts = {p: memory.estimate(tiny(dp=2, tp=4, remat=p))["per_device_bytes"]["activations"]
            for p in ("none", "dots", "selective", "full")}
    assert acts["none"] > acts["dots"] > acts["selective"] > acts["full"]
    one_f_one_b = [memory.estimate(tiny(pp=2, m=m, remat="none"))["per_device_bytes"]["activations"] for m in (2, 8)]
    gpipe = [memory.estimate(dataclasses.replace(tiny(pp=2, m=m, remat="none"), pipeline=PipelineConfig("gpipe", m)))
             ["per_device_bytes"]["activations"] for m in (2, 8)]
    microbatch_ratio = 4  # m = 2 -> 8 divides each microbatch by 4
    assert one_f_one_b[1] * microbatch_ratio == pytest.approx(one_f_one_b[0], rel=0.01)
    assert gpipe[1] * microbatch_ratio > 2 * gpipe[0]


def test_recommend_ranks_by_throughput_and_drops_what_does_not_fit():
    config = load_config("llama7b.py")
    hw = hardware.get("a100-80gb")
    result = recommend.recommend(config, 8, 8, hw, top=5)
    speeds = [r["tokens_per_s"] for r in result["ranked"]]
    assert speeds == sorted(speeds, reverse=True)
    assert all(r["peak"] <= hw.usable_bytes for r in result["ranked"])
    everything = [recommend.evaluate(c, hw, 8) for c in recommend.candidates(config, 8)]
    assert any(not r["fits"] for r in everything)  # e.g. plain DP over 8 with no remat
    assert max(r["tokens_per_s"] for r in everything if r["fits"]) == speeds[0]


def test_seed_16_gpu_70b_vla_question_has_a_definite_answer():
    """Seed 8.1: '16 x A100-80GB (PP=4, TP=4, DP=1)' as the minimum for a 70B VLA. With DP=1 ZeRO shards
    nothing, so each device holds 16 bytes x 4.5B parameters of state: it does not fit with the state on
    the device; only layouts that keep the optimizer state in host memory fit 16 GPUs; 64 fit as configured."""
    hw = hardware.get("a100-80gb")
    sixteen = load_config("vla70b.py", ["mesh.dp=1", "mesh.pp=4", "mesh.tp=4"])
    assert memory.estimate(sixteen)["per_device_bytes"]["peak"] > 80e9
    layouts = [recommend.evaluate(c, hw, 8) for c in recommend.candidates(load_config("vla70b.py"), 16)]
    assert not any(r["fits"] for r in layouts if not r["config"].offload.optimizer)
    assert all(r["config"].offload.optimizer for r in recommend.recommend(load_config("vla70b.py"), 16, 8, hw)["ranked"])
    assert memory.estimate(load_config("vla70b.py"))["per_device_bytes"]["peak"] < hw.usable_bytes


def test_step_time_parts_and_inter_node_links():
    config = load_config("vla70b.py")
    hw = hardware.get("a100-80gb")
    t = cost.step_time(config, hw, 8)
    assert t["links"] == {"tp": "NVLink", "dp": "inter-node", "pp": "inter-node"}
    parts = t["compute_s"] + t["bubble_s"] + t["tp_comm_s"] + t["dp_comm_s"] + t["pp_comm_s"]
    assert t["step_s"] == pytest.approx(parts)
    assert t["bubble_s"] / (t["compute_s"] + t["bubble_s"]) == pytest.approx(3 / 19)
    faster = cost.step_time(config, hardware.get("h100-80gb"), 8)
    assert faster["compute_s"] < t["compute_s"]


def plan_cli(*args):
    return subprocess.run([sys.executable, "-m", "jaxpar.plan", *args], capture_output=True, text=True, timeout=60)


def test_cli_json_has_peak_and_hardware_override():
    out = plan_cli("--config", "llama_tiny.py", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["per_device_bytes"]["peak"] > 0
    slow = plan_cli("--config", "llama_tiny.py", "--json", "--hardware_json", '{"a100-80gb": {"peak_tflops": 31.2}}')
    assert json.loads(slow.stdout)["step_time"]["compute_s"] == pytest.approx(10 * report["step_time"]["compute_s"])


@pytest.mark.parametrize("args, expect", [
    (["--config", "llama7b.py", "--gpu", "v100"], "unknown GPU 'v100'; known: a100-80gb, h100-80gb, h200"),
    (["--config", "llama7b.py", "--recommend", "--gpus", "4", "--gpus_per_node", "8"],
     "--gpus_per_node=8 is more than --gpus=4"),
    (["--config", "vla70b.py", "--recommend", "--gpus", "8"], "no layout of 8 x a100-80gb fits"),
    (["--config", "llama7b.py", "--config.zero.stage=7"], "zero.stage=7 is out of range"),
])
def test_cli_errors_are_one_line(args, expect):
    out = plan_cli(*args)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1 and expect in out.stderr
