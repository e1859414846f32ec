"""Weights-only restore (issue 26): `generate --workdir`, `export` and `rollout` read the weights of a
checkpoint, never its optimizer moments, straight into the target layout (orbax's partial restore)."""

import dataclasses
import json
import shutil
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from conftest import TINY_MODEL, builder_for, make_config, replace
from jaxpar import export
from jaxpar.parallel.checkpoint import Checkpointer
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


# A 1B-shaped train state written by jaxpar's Checkpointer (orbax) without its 12.4 GB ever being resident:
# every array is a zero-copy jax.Array over memory that costs (next to) nothing. The fp32 master, what the
# restore reads, holds init-like values (normal, std 0.02; zstd saves ~7% of them): one 64 MB pool of them
# (a memfd) mapped over and over into each leaf's address range, each leaf starting at its own page of it.
# The bf16 params and the Adam moments are the kernel's zero page (a fresh state's moments are zero): with
# random values there too, orbax's save buffers ~9 GB of host memory (measured), and the partial restore
# never reads them. What orbax writes is a real run's checkpoint of that shape: tree, dtypes, shardings,
# metadata, every leaf stored (Checkpointer.restore reads the whole state back).
SAVE_SCRIPT = textwrap.dedent("""
    import ctypes, json, mmap, os, pathlib, sys, zlib
    import jax, numpy as np
    from jaxpar.parallel.checkpoint import Checkpointer
    from jaxpar.config import Config, from_dict
    from jaxpar.parallel.mesh import Layout
    from jaxpar.parallel.step import StepBuilder
    workdir, step = pathlib.Path(sys.argv[1]), int(sys.argv[2])
    config = from_dict(Config, json.loads((workdir / "config.json").read_text()))
    abstract = StepBuilder(config, Layout.for_config(config).make_mesh()).abstract_state()
    POOL, PAGE, MAP_FIXED, MAP_NORESERVE, MAP_POPULATE = 64 << 20, 4096, 0x10, 0x4000, 0x8000
    pool = os.memfd_create("pool")
    os.ftruncate(pool, POOL)
    with mmap.mmap(pool, POOL) as m:
        m[:] = np.random.default_rng(0).normal(0, 0.02, POOL // 4).astype(np.float32).tobytes()  # init-like
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    def mapped(shape, dtype, shift=None):  # read-only: zeros, or the pool repeated from byte `shift` on
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        size = -(-((shift or 0) + nbytes) // POOL) * POOL
        base = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        for offset in range(0, size if shift is not None else 0, POOL):
            if libc.mmap(base + offset, POOL, mmap.PROT_READ, mmap.MAP_SHARED | MAP_FIXED | MAP_POPULATE,
                         pool, 0) != base + offset:
                raise OSError(ctypes.get_errno(), "mmap")
        raw = np.frombuffer((ctypes.c_char * size).from_address(base), np.uint8, nbytes, shift or 0)
        return raw.view(dtype).reshape(shape)
    def leaf(index, path, a):
        if not a.ndim:  # the step, the optimizer's step counts, the skipped steps (none)
            return jax.device_put(np.asarray(0 if path[0].name == "skipped" else step, a.dtype), a.sharding)
        host = mapped(a.shape, a.dtype, index * 37 * PAGE % POOL if path[0].name == "master" else None)
        array = jax.device_put(host, a.sharding)
        if array.addressable_data(0).unsafe_buffer_pointer() != host.ctypes.data:
            raise RuntimeError("jax copied a host array: the whole state would be resident")
        return array
    leaves, tree = jax.tree_util.tree_flatten_with_path(abstract)
    state = jax.tree.unflatten(tree, [leaf(i, p, a) for i, (p, a) in enumerate(leaves)])
    checkpoints = Checkpointer(workdir, config)
    checkpoints.save(step, state)
    checkpoints.close()
    crc = {jax.tree_util.keystr(path): zlib.crc32(np.asarray(w).reshape(-1).view(np.uint8))
           for path, w in jax.tree_util.tree_flatten_with_path(state.master)[0]}
    print(json.dumps(crc))
""")

RSS_SCRIPT = textwrap.dedent("""
    import json, os, pathlib, sys, threading, time, zlib
    import jax, jax.numpy as jnp, numpy as np
    from jaxpar import export
    jnp.ones(8).block_until_ready()  # the runtime is up before the baseline
    def status(field):  # VmHWM: this process's peak resident memory (ru_maxrss would carry the forking parent's)
        line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
        return int(line.split()[1]) * 1024
    before, ceiling = status("VmHWM"), int(sys.argv[2])
    def guard():  # a restore that reads more than the weights stops here, not in the host's OOM killer
        while True:
            if status("VmRSS") - before > ceiling:
                print(f"resident memory rose by more than {ceiling / 1e9:.2f} GB", file=sys.stderr, flush=True)
                os._exit(3)
            time.sleep(0.01)
    threading.Thread(target=guard, daemon=True).start()
    start = time.perf_counter()
    _, _, weights = export.restore_weights(pathlib.Path(sys.argv[1]))
    seconds, added = time.perf_counter() - start, status("VmHWM") - before
    crc = {jax.tree_util.keystr(path): zlib.crc32(np.asarray(w).reshape(-1).view(np.uint8))
           for path, w in jax.tree_util.tree_flatten_with_path(weights)[0]}
    print(json.dumps({"added": added, "seconds": seconds, "crc": crc,
                      "weights": sum(w.nbytes for w in jax.tree.leaves(weights))}))
""")


def _run(script, *args):
    run = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=900)
    return run, (json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0 else None)


@pytest.mark.slow
def test_restoring_the_weights_of_a_1b_checkpoint_leaves_the_optimizer_on_disk(tmp_path):
    """A 1B-shaped bf16 checkpoint (the Llama shape of a 1B model: d_model 2048, 16 layers, 16 heads, 8 KV
    heads, d_ff 5632, vocab 32,000: 886M parameters; fp32 master 3.54 GB, bf16 params 1.77 GB, Adam moments
    7.09 GB: 12.4 GB of state): restoring its weights raises the process's peak memory by well under twice the
    master's bytes, far below the 12.4 GB the old whole-state restore read, and gives back the master's bytes
    exactly (not a moment's, not the bf16 params). A restore that reads more than that is stopped at 2x."""
    model = dataclasses.replace(TINY_MODEL, vocab_size=32000, d_model=2048, n_layers=16, n_heads=16, n_kv_heads=8,
                                d_ff=5632)
    config = make_config(dp=1, tp=1, stage=0, precision="bf16", model=model)
    abstract = builder_for(config).abstract_state()
    whole = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(abstract))
    master = 4 * sum(a.size for a in jax.tree.leaves(abstract.master))
    (tmp_path / "config.json").write_text(json.dumps(to_dict(config)))
    try:
        save, saved = _run(SAVE_SCRIPT, tmp_path, 3)
        assert save.returncode == 0, save.stderr[-3000:]
        on_disk = sum(f.stat().st_size for f in (tmp_path / "checkpoints").rglob("*") if f.is_file())
        restore, measured = _run(RSS_SCRIPT, tmp_path, 2 * master)
    finally:
        shutil.rmtree(tmp_path / "checkpoints", ignore_errors=True)  # GBs: pytest keeps its last 3 tmp dirs
    assert restore.returncode != 3, f"the restore read more than the weights: {restore.stderr[-3000:]}"
    assert restore.returncode == 0, restore.stderr[-3000:]
    print(f"checkpoint {on_disk / 1e9:.2f} GB on disk (whole state {whole / 1e9:.2f} GB); weights "
          f"{measured['weights'] / 1e9:.2f} GB restored in {measured['seconds']:.1f} s, "
          f"peak memory added {measured['added'] / 1e9:.2f} GB")
    assert on_disk > 0.9 * master  # the master's bytes are really there to read
    assert measured["weights"] == master
    assert measured["crc"] == saved  # the master, in model order, not a moment or the bf16 params
    assert measured["added"] < 2 * measured["weights"] < whole  # the whole state would add >= 12.4 GB
