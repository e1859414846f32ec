"""Weights-only restore (issue 26): `generate --workdir`, `export` and `rollout` read the weights of a
checkpoint, never its optimizer moments, straight into the target layout (orbax's partial restore)."""

import dataclasses
import json
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from conftest import TINY_MODEL, builder_for, make_config, replace
from jaxpar import export
from jaxpar.checkpoint import Checkpointer
from jaxpar.config import PipelineConfig, to_dict


def _saved_run(tmp_path, config, step=3):
    """A run directory with config.json and a checkpoint of a freshly initialised state (its Adam moments
    made nonzero, so a mix-up with the weights would show)."""
    builder = builder_for(config)
    state = builder.init_state(1)
    state = state.replace(opt_state=jax.tree.map(lambda a: a + 0.5 if a.dtype == np.float32 else a, state.opt_state))
    (tmp_path / "config.json").write_text(json.dumps(to_dict(config)))
    checkpoints = Checkpointer(tmp_path, config)
    checkpoints.save(step, state)
    checkpoints.close()
    return builder, state


def test_restore_weights_reads_the_weights_of_any_layout_in_model_order(tmp_path):
    """A bf16 run on an interleaved pipeline (layers stored by device, ZeRO-1 master): the fp32 master
    comes back alone, in model layer order, equal to the full restore's."""
    model = dataclasses.replace(TINY_MODEL, n_layers=4)
    config = replace(make_config(dp=2, pp=2, tp=2, stage=1, precision="bf16", model=model),
                     pipeline=PipelineConfig(microbatches=4, virtual_stages=2))
    builder, state = _saved_run(tmp_path, config)
    _, step, weights = export.restore_weights(tmp_path)
    assert step == 3
    want = jax.device_get(builder.to_model_order(state.master))
    assert jax.tree.structure(weights) == jax.tree.structure(want)
    jax.tree.map(np.testing.assert_array_equal, weights, want)
    assert not np.array_equal(weights["layers"]["wq"], jax.device_get(state.master["layers"]["wq"]))  # reordered


RSS_SCRIPT = textwrap.dedent("""
    import json, pathlib, sys
    import jax, jax.numpy as jnp
    from jaxpar import export
    jnp.ones(8).block_until_ready()  # the runtime is up before the baseline
    def peak():  # VmHWM: this process's peak resident memory (ru_maxrss would carry the forking parent's)
        line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    before = peak()
    _, _, weights = export.restore_weights(pathlib.Path(sys.argv[1]))
    print(json.dumps({"added": peak() - before, "weights": sum(w.nbytes for w in jax.tree.leaves(weights))}))
""")


@pytest.mark.slow
def test_restoring_the_weights_of_a_134m_checkpoint_leaves_the_optimizer_on_disk(tmp_path):
    """A 134M-parameter bf16 checkpoint (fp32 master 0.54 GB, bf16 params 0.27 GB, Adam moments 1.07 GB:
    1.9 GB): restoring its weights raises the process's peak memory by about the master's bytes, far
    below the 1.9 GB the old whole-state restore read (and about a 7B run's 28 GB instead of 112)."""
    model = dataclasses.replace(TINY_MODEL, vocab_size=32000, d_model=768, n_layers=12, n_heads=12, n_kv_heads=12,
                                d_ff=2048)
    config = make_config(dp=1, tp=1, stage=0, precision="bf16", model=model)
    _, state = _saved_run(tmp_path, config)
    whole = sum(a.nbytes for a in jax.tree.leaves(state))
    master_shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state.master)
    del state
    run = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"weights {measured['weights'] / 1e9:.2f} GB, peak memory added {measured['added'] / 1e9:.2f} GB, "
          f"whole state {whole / 1e9:.2f} GB")
    assert measured["weights"] == 4 * sum(a.size for a in jax.tree.leaves(master_shapes))
    assert measured["added"] < 2 * measured["weights"] < whole  # the whole state would add >= 1.88 GB
