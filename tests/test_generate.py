"""Generation with a KV cache (jaxpar.inference.generate, jaxpar.inference.decode), against transformers' generate.

The cache is also checked against jaxpar's own full forward (prefill, then one token at a time, must
give the logits of the whole sequence at once), so a cache bug cannot hide behind a matching prefix.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import require

torch = require("torch")
transformers = require("transformers")

from jaxpar.inference import generate as gen  # noqa: E402
from jaxpar.layers.collectives import Collectives  # noqa: E402
from jaxpar.models import llama  # noqa: E402
from jaxpar.inference import decode
from test_hf import make_hf_model  # noqa: E402

PROMPT = [5, 17, 99, 3, 42]
NEW = 12


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    out = {}
    for variant in ("gqa", "llama3_rope"):
        directory = tmp_path_factory.mktemp(variant)
        out[variant] = (directory, make_hf_model(directory, variant))
    return out


def hf_greedy(model, prompt=PROMPT, new=NEW):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def load(directory, tp):
    return gen.load(gen.parse_args(["--from_hf", str(directory), "--prompt_ids", "1", "--tp", str(tp)]))


@pytest.mark.parametrize("variant,tp", [("gqa", 1), ("gqa", 2), ("gqa", 4), ("llama3_rope", 2)])
def test_greedy_ids_equal_transformers(hf_dirs, variant, tp):
    """tp = 4 over 2 KV heads: replicated KV heads, each rank caching the one its queries use."""
    directory, model = hf_dirs[variant]
    config, weights, mesh, _, _ = load(directory, tp)
    assert gen.generate(config, weights, mesh, PROMPT, NEW) == hf_greedy(model)


def test_cached_decoding_equals_the_full_forward(hf_dirs):
    config, weights, _, _, _ = load(hf_dirs["gqa"][0], 1)
    params = jax.device_get(weights)
    tokens = jnp.asarray([PROMPT + [7, 8, 9, 10]], jnp.int32)
    coll = Collectives()
    full = llama.head_logits(params, llama.run_layers(llama.embed_tokens(params, tokens, coll), params["layers"],
                                                      config, coll), config, coll)
    cache = decode.init_cache(config, 1, tokens.shape[1], config.n_kv_heads)
    logits, cache = decode.forward(params, tokens[:, :5], cache, 0, config, coll)
    steps = [logits]
    for position in range(5, tokens.shape[1]):
        logits, cache = decode.forward(params, tokens[:, position:position + 1], cache, position, config, coll)
        steps.append(logits)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(full))))


def test_greedy_with_the_cache_equals_greedy_without_it(hf_dirs):
    """Without a cache: the whole sequence through the training forward at every step (padded to its
    final length, so one compiled program: causal attention keeps the padding out of the positions
    before it, and the next token is read at the last real one)."""
    config, weights, mesh, _, _ = load(hf_dirs["llama3_rope"][0], 1)
    params, coll, ids = jax.device_get(weights), Collectives(), list(PROMPT)

    @jax.jit
    def logits(tokens):
        x = llama.run_layers(llama.embed_tokens(params, tokens, coll), params["layers"], config, coll)
        return llama.head_logits(params, x, config, coll)[0]

    for _ in range(NEW):
        padded = ids + [0] * (len(PROMPT) + NEW - len(ids))
        ids.append(int(jnp.argmax(logits(jnp.asarray([padded]))[len(ids) - 1])))
    assert gen.generate(config, weights, mesh, PROMPT, NEW) == ids[len(PROMPT):]


def test_nucleus_sampling(hf_dirs):
    config, weights, mesh, _, _ = load(hf_dirs["gqa"][0], 1)
    greedy = gen.generate(config, weights, mesh, PROMPT, NEW)
    # a nucleus this small is the most likely token alone, whatever the temperature
    assert gen.generate(config, weights, mesh, PROMPT, NEW, temperature=5.0, top_p=1e-6, seed=3) == greedy
    a = gen.generate(config, weights, mesh, PROMPT, NEW, temperature=5.0, seed=1)
    assert a == gen.generate(config, weights, mesh, PROMPT, NEW, temperature=5.0, seed=1)  # reproducible
    assert a != gen.generate(config, weights, mesh, PROMPT, NEW, temperature=5.0, seed=2)
    assert a != greedy


def test_stops_at_the_end_of_sequence(hf_dirs):
    config, weights, mesh, _, _ = load(hf_dirs["gqa"][0], 1)
    greedy = gen.generate(config, weights, mesh, PROMPT, NEW)
    assert gen.generate(config, weights, mesh, PROMPT, NEW, eos_id=greedy[3]) == greedy[:4]


def test_cli_json_and_one_line_errors(hf_dirs, capsys):
    directory, model = hf_dirs["gqa"]
    (directory / "config.json").write_text(json.dumps({**json.loads((directory / "config.json").read_text()),
                                                       "eos_token_id": None}))
    assert gen.main(["--from_hf", str(directory), "--prompt_ids", ",".join(map(str, PROMPT)),
                     "--max_new_tokens", str(NEW), "--json"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(line)["new_ids"] == hf_greedy(model)
    assert gen.main(["--from_hf", str(directory), "--prompt", "hello"]) == 2
    assert "--prompt needs a tokenizer" in capsys.readouterr().err
    assert gen.main(["--from_hf", str(directory), "--prompt_ids", "1,x"]) == 2
    assert gen.main(["--from_hf", str(directory), "--prompt_ids", "1", "--tp", "3"]) == 2
    assert "--tp 3 does not divide" in capsys.readouterr().err




@pytest.mark.slow  # trains a VLA, then decodes (make test's 15-minute budget)
def test_vla_episode_action_equals_the_teacher_forced_argmax(tmp_path, capsys):
    """A VLA run predicts step K's action token by token with a KV cache (prefix-LM prefix in one
    call). Fed back as the actions of a training batch, the training forward's argmax over action
    tokens must give the same tokens at every action position."""
    import dataclasses

    from jaxpar.config import load_config
    from jaxpar.data.episodes import make_episode, make_scene
    from jaxpar.data.instructions import utf8_bytes
    from jaxpar.inference.loader import restore_weights
    from jaxpar.training.loop import train
    from jaxpar.parallel.mesh import Layout
    from jaxpar.models import vit, vla

    config = load_config("vla_tiny", ["data.train=", "data.eval=", "data.generate=false", "train.steps=2",
                                      "train.global_batch_size=8", "train.lr=0.01", "eval.rollouts=0",
                                      "mesh.dp=2", "mesh.pp=1", "mesh.tp=1", "pipeline.microbatches=1"])  # decoding, not the layout, is tested
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(config)))
    train(config, Layout.for_config(config).make_mesh(), run_dir, show_progress=False)
    rng = np.random.default_rng(0)
    squares, target = make_scene(rng, 4, 3)
    episode = make_episode(rng, squares, target, size=config.vision.image_size)
    np.savez(tmp_path / "episode_00000.npz", **episode)

    assert gen.main(["--workdir", str(run_dir), "--episode", str(tmp_path / "episode_00000.npz"), "--step", "1",
                     "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ids = np.asarray(out["action_ids"])
    assert len(ids) == config.actions.dims and len(out["action"]) == config.actions.dims

    _, _, params = restore_weights(run_dir)
    image = episode["images"][1][None]  # uint8, as generate and training feed it
    text = utf8_bytes(episode["instruction"], config.actions.instruction_len, "test")[None].astype(np.int32)
    batch = vla.make_batch(config, image, text, np.asarray([out["action"]], np.float32))
    coll = Collectives()
    x = vla.llm_inputs(params, vit.encode(params, batch["images"], config.vision, coll, None, text), batch["inputs"], coll)
    x = llama.run_layers(x, params["layers"], config.model, coll, None, vla.prefix_len(config))
    logits = np.asarray(llama.head_logits(params, x, config.model, coll))[0]
    first_action = config.model.vocab_size - config.actions.bins
    at = np.flatnonzero(batch["mask"][0])
    np.testing.assert_array_equal(batch["targets"][0, at], ids)  # the decoded action maps back to the same tokens
    tokens, scores = decode.predict_actions(params, image, text, config)
    np.testing.assert_array_equal(np.asarray(tokens)[0], ids)
    expected = logits[at, first_action:]
    np.testing.assert_allclose(np.asarray(scores)[0], expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize("cp,tp", [(2, 2), pytest.param(4, 1, marks=pytest.mark.slow)])
def test_prefill_split_over_cp_gives_transformers_greedy_ids(hf_dirs, cp, tp):
    """--cp: the 5-token prompt padded to 2 cp chunks, each rank prefilling its balanced chunks against
    the whole prompt's K / V; the last prompt token's logits come from the rank that holds it."""
    directory, model = hf_dirs["gqa"]
    args = gen.parse_args(["--from_hf", str(directory), "--prompt_ids", "1", "--tp", str(tp), "--cp", str(cp)])
    config, weights, mesh, _, _ = gen.load(args)
    assert dict(mesh.shape)["cp"] == cp
    assert gen.generate(config, weights, mesh, PROMPT, NEW) == hf_greedy(model)
