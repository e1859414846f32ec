"""The VLA: action tokens, the loss mask, prefix-LM attention, and parallel == single device."""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from jaxpar.config import ConfigError, MeshConfig, ZeroConfig, load_config, validate
from jaxpar.parallel.mesh import Layout
from jaxpar.models import vit, vla
from jaxpar.parallel.step import StepBuilder

BASE = load_config("vla_tiny")
# vla70b's default layout until 2026-12-02 (the seed's table 6.2, configs/vla70b.py's docstring): these tests' subject
VLA70B_SEED_LAYOUT = ["mesh.dp=2", "mesh.pp=4", "mesh.sequence_parallel=false", "zero.stage=1", "remat.policy=full",
                      "pipeline.microbatches=16", "pipeline.virtual_stages=1", "grad_reduce=fp32", "vision.tp=2",
                      "actions.instruction_len=32"]


def with_values(config, **groups):
    return dataclasses.replace(config, **{k: dataclasses.replace(getattr(config, k), **v) for k, v in groups.items()})


def test_action_tokens_round_trip_and_sit_at_the_end_of_the_vocabulary():
    tokenizer = vla.ActionTokenizer(BASE.actions, BASE.model.vocab_size)
    bins = np.arange(BASE.actions.bins)
    tokens = tokenizer.bins_to_tokens(bins)
    assert tokens.min() == BASE.model.vocab_size - BASE.actions.bins and tokens.max() == BASE.model.vocab_size - 1
    np.testing.assert_array_equal(tokenizer.tokens_to_bins(tokens), bins)
    per_dim = np.repeat(bins[:, None], BASE.actions.dims, axis=1)  # [bins, dims]: every bin of every dim
    np.testing.assert_array_equal(tokenizer.to_bins(tokenizer.from_bins(per_dim)), per_dim)  # centres map back
    actions = np.random.default_rng(0).uniform(-1, 1, (100, 7))
    width = (BASE.actions.high - BASE.actions.low) / BASE.actions.bins
    assert np.abs(tokenizer.from_bins(tokenizer.to_bins(actions)) - actions).max() <= width / 2 + 1e-9
    clipped = tokenizer.to_bins(np.array([[-5.0] * 7, [5.0] * 7]))
    assert clipped[:, 0].tolist() == [0, BASE.actions.bins - 1]


def test_quantile_ranges_are_per_dimension_and_a_fixed_dimension_decodes_to_its_value():
    """Each dim's bins split its own [q01, q99]; a dim with q01 == q99 (a padded dim) takes the
    middle bin and decodes to exactly its value, whatever it is given."""
    q01, q99 = (-2.0, 0.0, 0.5, 3.0), (2.0, 10.0, 0.5, 3.0)
    cfg = dataclasses.replace(BASE.actions, dims=4, bins=8, normalization="quantile", q01=q01, q99=q99)
    tokenizer = vla.ActionTokenizer(cfg, BASE.model.vocab_size)
    actions = np.array([[-2.0, 0.0, 0.5, 3.0], [1.9, 9.9, 7.0, -4.0], [0.1, 5.1, 0.5, 3.0]])
    bins = tokenizer.to_bins(actions)
    assert bins.tolist() == [[0, 0, 4, 4], [7, 7, 4, 4], [4, 4, 4, 4]]
    decoded = tokenizer.from_bins(bins)
    np.testing.assert_allclose(decoded[:, 2:], [[0.5, 3.0]] * 3)  # fixed dims: their one value
    np.testing.assert_allclose(decoded[:, :2], [[-1.75, 0.625], [1.75, 9.375], [0.25, 5.625]])  # bin centres


def test_loss_mask_covers_exactly_the_action_tokens():
    batch = vla.synthetic_batch(BASE, 0, 4)
    n_image, prefix, seq = vla.sequence_layout(BASE)
    assert batch["targets"].shape == (4, seq) and batch["inputs"].shape == (4, seq - n_image)
    tokenizer = vla.ActionTokenizer(BASE.actions, BASE.model.vocab_size)
    is_action = tokenizer.is_action(batch["targets"])
    np.testing.assert_array_equal(batch["mask"], is_action.astype(np.float32))
    assert batch["mask"].sum(axis=1).tolist() == [BASE.actions.dims] * 4
    assert (batch["mask"][:, : prefix - 1] == 0).all()  # nothing in the image + instruction prefix
    with_text = vla.synthetic_batch(with_values(BASE, model=dict(text_loss=True, prefix_lm=False)), 0, 4)
    assert with_text["mask"].sum(axis=1).tolist() == [BASE.actions.dims + BASE.actions.instruction_len] * 4


def test_several_cameras_concatenate_their_patch_tokens():
    config = with_values(BASE, mesh=dict(dp=1, pp=1, tp=1), pipeline=dict(microbatches=1), vision=dict(cameras=2))
    params = single_device_params(config)
    batch = vla.synthetic_batch(config, 0, 2)
    assert batch["images"].shape == (2, 2, 16, 16, 3)
    tokens = vla.encode_images(params, batch, config)
    assert tokens.shape == (2, 2 * 16, config.model.d_model)
    loss, count = vla.loss_sum(params, batch, config)
    assert np.isfinite(float(loss)) and float(count) == 2 * config.actions.dims


def single_device_params(config):
    return jax.device_get(builder(dataclasses.replace(config, mesh=MeshConfig())).init_state(0).params)


def test_sincos_position_init_codes_row_and_column_separately():
    code = np.asarray(vit.sincos_2d(4, 16))  # patch i is at row i // 4, column i % 4
    rows, cols = code[:, :8], code[:, 8:]
    np.testing.assert_allclose(rows[0:4], np.broadcast_to(rows[0], (4, 8)))  # one row, one row code
    np.testing.assert_allclose(cols[0::4], np.broadcast_to(cols[0], (4, 8)))  # one column, one column code
    assert len({tuple(r.round(6)) for r in rows}) == 4 and len({tuple(c.round(6)) for c in cols}) == 4
    np.testing.assert_allclose(code[5, [0, 4]], [np.sin(1.0), np.cos(1.0)], rtol=1e-6)  # row 1, top frequency
    params = vit.init(BASE.vision, BASE.model.d_model, jax.random.key(0))
    grid = BASE.vision.image_size // BASE.vision.patch_size
    np.testing.assert_array_equal(params["vit"]["pos_embed"], vit.sincos_2d(grid, BASE.vision.width))
    random = vit.init(with_values(BASE, vision=dict(pos_init="normal")).vision, BASE.model.d_model, jax.random.key(0))
    assert np.abs(np.asarray(random["vit"]["pos_embed"]) - np.asarray(params["vit"]["pos_embed"])).max() > 0.5


@pytest.mark.parametrize("film", [True, False])
def test_film_makes_the_image_tokens_depend_on_the_instruction_bytes_only(film):
    config = with_values(BASE, mesh=dict(dp=1, pp=1, tp=1), pipeline=dict(microbatches=1), vision=dict(film=film))
    params = single_device_params(config)
    assert ("film_embed" in params["vit"]) == film
    batch = vla.synthetic_batch(config, 0, 2)
    batch["inputs"][:, :8] = np.frombuffer(b"move to ", np.uint8)
    batch["inputs"][:, 8:config.actions.instruction_len] = 0  # padding
    tokens = np.asarray(vla.encode_images(params, batch, config))
    renamed = {**batch, "inputs": batch["inputs"].copy()}
    renamed["inputs"][:, 3] = ord("x")  # another instruction
    actions_only = {**batch, "inputs": batch["inputs"].copy()}
    actions_only["inputs"][:, config.actions.instruction_len:] += 1  # after the instruction
    np.testing.assert_array_equal(vla.encode_images(params, actions_only, config), tokens)
    change = np.abs(np.asarray(vla.encode_images(params, renamed, config)) - tokens).max()
    assert change > 1e-3 if film else change == 0.0


def test_prefix_lm_lets_the_prefix_see_ahead_but_keeps_actions_causal():
    config = with_values(BASE, mesh=dict(dp=1, pp=1, tp=1), pipeline=dict(microbatches=1))
    params = single_device_params(config)
    batch = vla.synthetic_batch(config, 0, 2)
    image_tokens = vla.encode_images(params, batch, config)

    def hidden(cfg, inputs):
        x = vla.llm_inputs(params, image_tokens, inputs, vla.Collectives())
        return np.asarray(vla.llama.run_layers(x, params["layers"], cfg.model, vla.Collectives(),
                                               prefix_len=vla.prefix_len(cfg)))

    n_image, prefix, _ = vla.sequence_layout(config)
    changed = batch["inputs"].copy()
    changed[:, prefix - n_image - 1] += 1  # the last instruction token
    for cfg, sees_ahead in ((config, True), (with_values(config, model=dict(prefix_lm=False)), False)):
        before, after_change = hidden(cfg, batch["inputs"]), hidden(cfg, changed)
        early = slice(0, prefix - 1)  # positions before the changed token
        assert (not np.allclose(before[:, early], after_change[:, early])) == sees_ahead
    last_action = batch["inputs"].copy()
    last_action[:, -1] += 1
    before, after_change = hidden(config, batch["inputs"]), hidden(config, last_action)
    np.testing.assert_allclose(before[:, :-1], after_change[:, :-1], atol=1e-6)  # actions stay causal


def builder(config):
    return StepBuilder(config, Layout.for_config(config).make_mesh())


def run(config, steps=3, single=None):
    """`steps` train steps from the single-device model's initial state (`single`: SINGLE's config); the state
    and gradients moved between the model's layer order and an interleaved pipeline's (pipeline.layer_order)."""
    b = builder(config)
    state = jax.device_put(b.from_model_order(reference_state(single or SINGLE)), b.state_shardings())
    step = b.jit_train_step(with_grads=True)
    losses, grads0 = [], None
    for i in range(steps):
        batch = jax.device_put(vla.synthetic_batch(config, i, config.train.global_batch_size), b.batch_sharding())
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        grads0 = grads0 or b.to_model_order(jax.device_get(metrics["grads"]))
    return np.array(losses), grads0, state


SINGLE = with_values(BASE, mesh=dict(dp=1, pp=1, tp=1), pipeline=dict(microbatches=1), zero=dict(stage=0),
                     vision=dict(zero=ZeroConfig(stage=0)))


@functools.lru_cache(maxsize=None)
def reference_state(single=SINGLE):
    return jax.device_get(builder(single).init_state(0))


@functools.lru_cache(maxsize=None)
def reference(single=SINGLE):
    return run(single, single=single)


def on_layout(config, mesh, schedule, vision_tp):
    """`config` on mesh (dp, pp, tp): a pipeline with `schedule`, or without one ZeRO stage `schedule[-1]` ("zeroN")."""
    pipe = dict(schedule=schedule) if mesh[1] > 1 else dict(microbatches=1)
    return with_values(config, mesh=dict(dp=mesh[0], pp=mesh[1], tp=mesh[2]), vision=dict(tp=vision_tp),
                       pipeline=pipe, zero=dict(stage=int(schedule[-1]) if schedule.startswith("zero") else 1))


def assert_action_head_split_like_the_vocabulary(state, mesh):
    """The l1 / flow head's MLP: its hidden dim over the head's pp x tp, as the vocabulary."""
    w1 = state.params["action_head"]["w1"]
    assert {s.data.shape[1] for s in w1.addressable_shards} == {w1.shape[1] // (mesh[1] * mesh[2])}


def assert_matches_reference(losses, grads, ref):
    """Losses within 1e-5 and every gradient within float32 rounding of the single-device `ref` (reference())."""
    ref_losses, ref_grads, _ = ref
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)

    def check(path, a, e):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5 * np.max(np.abs(e)), err_msg=jax.tree_util.keystr(path))
    jax.tree_util.tree_map_with_path(check, grads, ref_grads)


# (2,2,2) with 1F1B (vision tp 1 and 2) and GPipe are `slow`: `make test` trains that layout in
# tests/test_hf_siglip.py (vision tp 2, SigLIP); the VLA under cp is in tests/test_context_parallel.py.
# The LLM's ZeRO-3 with vision tp 1 is slow too (make test's 15-minute budget; CI runs both).
@pytest.mark.parametrize("mesh,schedule,vision_tp", [
    pytest.param((2, 2, 2), "1f1b", 1, marks=pytest.mark.slow),
    pytest.param((2, 2, 2), "1f1b", 2, marks=pytest.mark.slow), pytest.param((2, 2, 2), "gpipe", 2, marks=pytest.mark.slow),
    pytest.param((2, 2, 2), "zb", 2, marks=pytest.mark.slow),  # zb's split backward with the prefix mask
    pytest.param((1, 2, 4), "1f1b", 2, marks=pytest.mark.slow),  # vision tp 2 inside tp 4: tp split into ("tp", "tpv"); slow:
    # make test's 15 minutes (it keeps a pipelined VLA in tests/test_vla_head.py and vision tp 2 in test_hf_siglip)
    ((2, 1, 4), "zero1", 2),  # no pipeline: the LLM's ZeRO-1 reduce-scatters in the backward (grad taps)
    pytest.param((2, 1, 4), "zero2", 2, marks=pytest.mark.slow),  # the LLM's ZeRO-2 grad taps with image tokens
    pytest.param((4, 1, 2), "zero3", 1, marks=pytest.mark.slow),  # no pipeline: the LLM's ZeRO-3 gathers with image tokens
])
def test_vla_matches_single_device(mesh, schedule, vision_tp):
    losses, grads, state = run(on_layout(BASE, mesh, schedule, vision_tp))
    assert_matches_reference(losses, grads, reference())
    wq = state.params["vit"]["blocks"]["wq"]  # [depth, width, heads, head_dim]
    assert {s.data.shape[2] for s in wq.addressable_shards} == {wq.shape[2] // vision_tp}
    w1, w2 = state.params["projector"]["w1"], state.params["projector"]["w2"]  # a column / row pair over vision tp
    assert {s.data.shape for s in w1.addressable_shards} == {(w1.shape[0], w1.shape[1] // vision_tp)}
    assert {s.data.shape for s in w2.addressable_shards} == {(w2.shape[0] // vision_tp, w2.shape[1])}
    mu = state.opt_state[1][0].mu["vit"]["blocks"]["w_in"].addressable_shards[0].data  # [depth, width, mlp]
    data_ways = 8 // vision_tp  # vision ZeRO-2 shards the encoder's optimizer state over its data axes
    assert mu.shape[1] == BASE.vision.width // data_ways
    layers_wq = state.params["layers"]["wq"]  # the LLM keeps its full tp over the (possibly split) axis
    assert {s.data.shape[2] for s in layers_wq.addressable_shards} == {layers_wq.shape[2] // mesh[2]}


@pytest.mark.parametrize("mesh,vision_tp", [pytest.param((2, 1, 4), 1, marks=pytest.mark.slow),
                                             pytest.param((1, 2, 4), 4, marks=pytest.mark.slow)])
def test_vla_with_fewer_kv_heads_than_tp_matches_single_device(mesh, vision_tp):
    """tp 4 over 2 KV heads splits the tp axis into ("tp", "tpv") = (2, 2) for the LLM's KV heads
    (jaxpar.sharding.kv_head_ways); the encoder is then data-parallel over both parts (vision tp 1) or
    tensor-parallel over both (vision tp 4)."""
    single = with_values(SINGLE, model=dict(n_kv_heads=2))
    ref_losses, ref_grads, _ = reference(single)
    pipe = dict(schedule="1f1b") if mesh[1] > 1 else dict(microbatches=1)
    config = with_values(BASE, mesh=dict(dp=mesh[0], pp=mesh[1], tp=mesh[2]), vision=dict(tp=vision_tp),
                         pipeline=pipe, model=dict(n_kv_heads=2))
    losses, grads, state = run(config, single=single)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)

    def check(path, a, e):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5 * np.max(np.abs(e)), err_msg=jax.tree_util.keystr(path))
    jax.tree_util.tree_map_with_path(check, grads, ref_grads)
    wk = state.params["layers"]["wk"]  # [layers, embed, kv_heads, head_dim]: one KV head per rank
    assert {s.data.shape[2] for s in wk.addressable_shards} == {1}
    wq = state.params["vit"]["blocks"]["wq"]
    assert {s.data.shape[2] for s in wq.addressable_shards} == {wq.shape[2] // vision_tp}
    mu = state.opt_state[1][0].mu["vit"]["blocks"]["w_in"].addressable_shards[0].data  # [depth, width, mlp]
    assert mu.shape[1] == BASE.vision.width // (8 // vision_tp)  # images and ZeRO-2 over every other device


VLA_MISTAKES = {
    "patch": (dict(vision=dict(image_size=18)), "vision.image_size=18 is not divisible by vision.patch_size=4"),
    "vision tp": (dict(vision=dict(tp=3, n_heads=3, width=66, mlp_dim=129)), "vision.tp=3 does not divide mesh.tp=2"),
    "vision heads": (dict(vision=dict(n_heads=3, width=66, tp=2)), "vision.tp=2 does not divide vision.n_heads=3"),
    "bins vs vocab": (dict(actions=dict(bins=600)), "actions.bins=600 reserves the last 600"),
    "kind": (dict(model=dict(kind="diffusion")), "model.kind='diffusion' is unknown"),
    "vision zero 3": (dict(vision=dict(zero=ZeroConfig(stage=3))), "vision.zero.stage=3"),
    "grad accum": (dict(mesh=dict(pp=1, dp=4), pipeline=dict(microbatches=1), train=dict(grad_accum=2)),
                   "train.grad_accum=2: a VLA encodes the whole batch once"),
    "pos init": (dict(vision=dict(pos_init="rope")), "vision.pos_init='rope' is unknown"),
    "sincos width": (dict(vision=dict(width=66, n_heads=3, tp=1)), "vision.pos_init=sincos2d needs vision.width"),
    "text loss in prefix": (dict(model=dict(text_loss=True)), "set model.prefix_lm=false"),
}


@pytest.mark.parametrize("changes,expected", VLA_MISTAKES.values(), ids=VLA_MISTAKES.keys())
def test_vla_config_mistakes_are_one_line_errors(changes, expected):
    with pytest.raises(ConfigError) as err:
        validate(with_values(BASE, **changes))
    assert "\n" not in str(err.value) and expected in str(err.value), str(err.value)


@pytest.mark.slow  # make test's 15-minute budget (CI runs make test-slow too)
def test_dry_run_reports_each_component():
    from jaxpar.compiler.dry_run import dry_run

    report = dry_run(BASE, builder(BASE).mesh)
    llm, vision = report["components"]["llm"], report["components"]["vision+projector"]
    assert (llm["dp"], llm["pp"], llm["tp"], llm["schedule"]) == (2, 2, 2, "1f1b")
    assert vision["data_parallel"] == 8 and vision["zero_stage"] == 2
    assert report["per_device_bytes"]["params"] == llm["params_bytes"] + vision["params_bytes"]
    assert report["param_count"] == vla.llama.param_count(BASE.model) + vit.param_count(BASE.vision, 64)


@pytest.mark.parametrize("name,devices,vision_tp", [pytest.param("vla70b", 64, 2, marks=pytest.mark.slow),
                                                     pytest.param("vla7b", 8, 1, marks=pytest.mark.slow),
                                                     pytest.param("vla_openvla", 8, 1, marks=pytest.mark.slow)])
def test_big_vla_dry_run_compiled_peak_is_under_80gb(tmp_path, name, devices, vision_tp):
    """The real step compiled for the real mesh on emulated CPU devices (a subprocess: it needs its own
    device count); the seed's 64-GPU layout's compiled peak on XLA:CPU must stay under 80 GB (a GPU fit is
    for a GPU to measure)."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "jaxpar.train", "--config", f"{name}.py", "--dry_run",
                           "--workdir", str(tmp_path),
                           *(f"--config.{o}" for o in (VLA70B_SEED_LAYOUT if name == "vla70b" else []))],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "dry_run.json").read_text())
    assert report["devices"] == devices
    assert report["per_device_bytes"]["peak"] < 80e9
    llm, vision = report["components"]["llm"], report["components"]["vision+projector"]
    assert (vision["tp"], vision["data_parallel"], vision["zero_stage"]) == (vision_tp, devices // vision_tp, 2)
    if name == "vla70b":
        assert (llm["tp"], llm["pp"], llm["dp"], llm["zero_stage"]) == (8, 4, 2, 1)
        assert 69e9 < report["param_count"] < 72e9
    if name == "vla_openvla":  # Llama-2-7B (6.74B) + the SigLIP-so400m tower and projector (0.43B)
        assert 7.1e9 < report["param_count"] < 7.25e9
