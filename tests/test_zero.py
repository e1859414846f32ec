"""ZeRO-3 prefetch (jaxpar.parallel.zero.prefetching_layer_scan): equal to one device, and overlappable.

The prefetching layer scan gathers layer i+1's weights before layer i computes, in the forward and in
the backward, and reduce-scatters layer i+1's gradient while layer i is differentiated. Overlap itself
is a GPU scheduling matter; what CPU can show is the precondition in the compiled program: inside the
layer loops, no weight all-gather (and no gradient reduce-scatter) depends on or feeds a matmul of the
same iteration, so nothing forces the collective to wait for the layer or the layer for it.
"""

import dataclasses
import re

import jax
import numpy as np
import pytest

from conftest import TINY_MODEL, builder_for, make_config, replace
from jaxpar.compiler import hlo_collectives
from jaxpar.config import RematConfig, ZeroConfig
from jaxpar.layers.order import ordering
from test_equivalence import LOSS_RTOL, assert_grads_close, batches, run


def zero3_config(dp, tp, n_layers=2, remat="full", prefetch=True, **overrides):
    model = dataclasses.replace(TINY_MODEL, n_layers=n_layers)
    config = make_config(dp=dp, tp=tp, stage=3, model=model, **overrides)
    return replace(config, remat=RematConfig(policy=remat), zero=ZeroConfig(stage=3, prefetch=prefetch))


def single_device(n_layers):
    model = dataclasses.replace(TINY_MODEL, n_layers=n_layers)
    return run(replace(make_config(model=model), remat=RematConfig(policy="full")))


# the software pipeline's edges: no loop, empty loop (slow: make test's budget), a loop
@pytest.mark.parametrize("n_layers", [1, pytest.param(2, marks=pytest.mark.slow), 3])
def test_prefetch_matches_single_device(n_layers):
    ref_grads, ref_losses, _ = single_device(n_layers)
    config = zero3_config(4, 2, n_layers)
    assert builder_for(config).zero.prefetches
    grads, losses, _ = run(config)
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_grads_close(grads, ref_grads)


@pytest.mark.slow  # make test's 15-minute budget (CI runs make test-slow too)
def test_prefetch_with_sequence_parallel_and_accumulation_matches_single_device():
    ref_grads, ref_losses, _ = single_device(3)
    config = zero3_config(2, 4, 3, grad_accum=2)
    config = replace(config, mesh=dataclasses.replace(config.mesh, sequence_parallel=True))
    grads, losses, _ = run(config)
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_grads_close(grads, ref_grads)


# ----------------------------------------------------------------------------- the compiled program

def _computes(comps: dict, ins: dict, memo: dict) -> bool:
    """A matmul, or a fusion / call whose computation (recursively) has one."""
    if ins["op"] in ("dot", "convolution"):
        return True
    for called in hlo_collectives._called(ins):
        if called not in memo:
            memo[called] = False
            memo[called] = any(_computes(comps, i, memo) for i in comps.get(called, []))
        if memo[called]:
            return True
    return False


def loop_collectives(text: str, ops: tuple[str, ...]) -> list[dict]:
    """Each `ops` collective inside a while-loop body of the compiled program, with whether a matmul
    of the same iteration is among its inputs (`after_compute`) or consumes it (`feeds_compute`)."""
    comps, _ = hlo_collectives.parse_module(text)
    bodies = {m for instrs in comps.values() for i in instrs if i["op"] == "while"
              for m in re.findall(r"body=%?([\w.\-]+)", i["attrs"])}
    memo, out = {}, []
    for body in bodies:
        instrs = {i["name"]: i for i in comps[body]}
        users: dict[str, list[str]] = {}
        for i in instrs.values():
            for a in i["args"]:
                users.setdefault(a, []).append(i["name"])

        def reach(start, step):
            seen, stack = set(), [start]
            while stack:
                for n in step(stack.pop()):
                    if n in instrs and n not in seen:
                        seen.add(n)
                        stack.append(n)
            return seen

        for ins in instrs.values():
            if ins["op"].removesuffix("-start") in ops:
                ancestors = reach(ins["name"], lambda n: instrs[n]["args"])
                descendants = reach(ins["name"], lambda n: users.get(n, []))
                out.append({"body": body, "op": ins["op"].removesuffix("-start"),
                            "after_compute": any(_computes(comps, instrs[n], memo) for n in ancestors),
                            "feeds_compute": any(_computes(comps, instrs[n], memo) for n in descendants)})
    return out


def compiled_text(config) -> str:
    """The step as a GPU gets it: traced without XLA:CPU's collective ordering (jaxpar.layers.order),
    which would make each layer wait for its prefetched gathers on CPU meshes."""
    builder = builder_for(config)
    with ordering(False):
        lowered = builder.jit_train_step().lower(builder.abstract_state(), builder.abstract_batch())
    return lowered.compile().as_text()


N_LAYERS = 4
WEIGHTS_PER_LAYER = 9


def test_compiled_prefetch_gathers_do_not_wait_for_the_layer():
    found = loop_collectives(compiled_text(zero3_config(8, 1, N_LAYERS)), ("all-gather", "reduce-scatter"))
    gathers = [c for c in found if c["op"] == "all-gather"]
    # one loop body for the forward, one for the backward, each gathering one layer's weights
    assert len({c["body"] for c in gathers}) == 2 and len(gathers) == 2 * WEIGHTS_PER_LAYER
    assert not any(c["after_compute"] or c["feeds_compute"] for c in gathers)
    # the backward's reduce-scatters reduce the previous iteration's gradient: no matmul before them
    scatters = [c for c in found if c["op"] == "reduce-scatter"]
    assert len(scatters) == WEIGHTS_PER_LAYER and not any(c["after_compute"] for c in scatters)


def test_the_saved_layer_inputs_are_never_copied_whole():
    """The forward keeps each layer's input for the backward (full remat) as the scan's stacked output; the
    last layer's input is kept beside it, not concatenated onto it (issue 46: that copied every input)."""
    config = zero3_config(8, 1, N_LAYERS)
    builder = builder_for(config)
    lowered = builder.jit_train_step().lower(builder.abstract_state(), builder.abstract_batch())
    batch, seq = config.train.global_batch_size // 8, config.train.seq_len
    stacked = re.compile(rf"= f32\[{N_LAYERS},{batch},{seq},{config.model.d_model}\]\S* concatenate\(")
    text = lowered.as_text(dialect="hlo")
    assert f"f32[{N_LAYERS - 1},{batch},{seq},{config.model.d_model}]" in text  # the scan's saved inputs
    assert not stacked.search(text)


@pytest.mark.parametrize("remat,prefetch", [("full", False), ("selective", True)])
def test_without_prefetch_each_gather_feeds_its_own_layer(remat, prefetch):
    """The control: gathering on use (prefetch off, or a remat policy that keeps activations) puts
    each gather in front of the matmuls of the same iteration, which the test above rules out."""
    config = zero3_config(8, 1, N_LAYERS, remat=remat, prefetch=prefetch)
    assert not builder_for(config).zero.prefetches
    gathers = [c for c in loop_collectives(compiled_text(config), ("all-gather",)) if c["op"] == "all-gather"]
    assert gathers and all(c["feeds_compute"] for c in gathers)


# ----------------------------------------------------------------------------- the gradient norm

@pytest.mark.parametrize("dp,tp,stage", [pytest.param(4, 2, 0, marks=pytest.mark.slow),  # make test's budget:
                                         pytest.param(4, 2, 1, marks=pytest.mark.slow),  # (8, 1, 1) and (4, 2, 3) stay
                                         (8, 1, 1), pytest.param(4, 2, 2, marks=pytest.mark.slow), (4, 2, 3)])
def test_grad_norm_is_the_norm_of_the_step_gradient(dp, tp, stage):
    """StepBuilder._global_norm (one all-reduce) equals the L2 norm of the reduced gradient; under ZeRO-1
    each device sums only its dp shard of the all-reduced gradient, each shard counted once."""
    config = make_config(dp=dp, tp=tp, stage=stage)
    builder = builder_for(config)
    state = builder.init_state(config.train.seed)
    batch = jax.device_put(batches(config)[0], builder.batch_sharding())
    _, metrics = builder.jit_train_step(with_grads=True)(state, batch)
    grads = jax.tree.leaves(jax.device_get(metrics["grads"]))
    expected = np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64))) for g in grads))
    np.testing.assert_allclose(float(metrics["grad_norm"]), expected, rtol=1e-5)
