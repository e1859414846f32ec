"""The GPU lane's generation check (issue 45): greedy decoding with the KV cache (`python -m jaxpar.generate`) of an
imported Hugging Face Llama gives the same ids on the GPU as on XLA:CPU and in transformers.

The GPU side runs at jax's `highest` matmul precision: the check is of the program (the cache, its positions and
masks, RoPE, GQA), and a random tiny model's logits are close enough that TF32's rounding (jax's default for fp32
matmuls on a GPU) may flip an argmax; the ids at the default precision are recorded beside it. The CPU side runs in
every `make test` (the unmarked test below).
"""

import json
import pathlib
import subprocess
import sys

import pytest

from conftest import lane_subprocess_env, require

torch = require("torch")
transformers = require("transformers")

from test_generate import NEW, PROMPT, hf_greedy  # noqa: E402
from test_hf import make_hf_model  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A tiny GQA Llama saved by transformers, with no end-of-sequence id (every run decodes NEW tokens)."""
    directory = tmp_path_factory.mktemp("gqa")
    model = make_hf_model(directory, "gqa")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "eos_token_id": None}))
    return directory, model


def generated_ids(directory: pathlib.Path, platform: str, precision: str = "highest") -> list[int]:
    """The new ids of `python -m jaxpar.generate --json` on `platform` ("cpu" or the lane's GPU)."""
    env = lane_subprocess_env(platform, JAX_DEFAULT_MATMUL_PRECISION=precision)
    done = subprocess.run([sys.executable, "-m", "jaxpar.generate", "--from_hf", str(directory), "--prompt_ids",
                           ",".join(map(str, PROMPT)), "--max_new_tokens", str(NEW), "--json"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["new_ids"]


@pytest.mark.gpu
def test_greedy_ids_on_the_gpu_equal_xla_cpu_and_transformers(hf_llama, record_property):
    directory, model = hf_llama
    gpu, cpu = generated_ids(directory, "gpu"), generated_ids(directory, "cpu")
    record_property("ids", f"gpu {gpu} cpu {cpu}")
    record_property("gpu_ids_at_default_precision_equal", str(generated_ids(directory, "gpu", "default") == gpu))
    assert gpu == cpu == hf_greedy(model)


def test_the_gpu_checks_cpu_side_gives_transformers_ids(hf_llama):
    directory, model = hf_llama
    assert generated_ids(directory, "cpu") == hf_greedy(model)
