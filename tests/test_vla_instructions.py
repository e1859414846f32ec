"""A VLA's instruction as its LLM reads it (jaxpar.data.instructions), against transformers' tokenizer.

A VLA whose LLM comes from Hugging Face gets its instruction encoded as transformers'
`tokenizer(text)` encodes it (BOS first), left-padded with the end-of-text id, in every path that
builds one: the LeRobot and episode sources, the training batch, the rollout policy and
`generate --episode`; FiLM keeps reading the UTF-8 bytes, carried beside the ids. A VLA trained from
scratch reads bytes, as before. The tokenizer is a tiny word-level `tokenizers` file with a BOS
template, saved with transformers' PreTrainedTokenizerFast (nothing downloaded).
"""

import numpy as np
import pytest

from conftest import require

torch = require("torch")
transformers = require("transformers")
tokenizers = require("tokenizers")

from jaxpar.data.instructions import InstructionEncoder, utf8_bytes  # noqa: E402
from jaxpar.data.pipeline import episode_batch, make_source  # noqa: E402
from jaxpar.errors import ConfigError  # noqa: E402
from jaxpar.interop.pretrained import load_run_config  # noqa: E402
from jaxpar.robot import env as task  # noqa: E402
from test_lerobot import EPISODE_TASK, TASKS, TOP, write_v30  # noqa: E402

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
LENGTH = 28  # >= the longest instruction's bytes (FiLM reads them)


def make_word_tokenizer(directory):
    """Every word of the LeRobot tasks and the rollout instructions, BOS put first by the template."""
    words = sorted({w for text in TASKS + [task.instruction(c) for c in task.COLOUR_NAMES] for w in text.split()})
    vocab = {w: i for i, w in enumerate(["<unk>", BOS, EOS, *words])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in (BOS, EOS)])
    tok.post_processor = tokenizers.processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                         unk_token="<unk>").save_pretrained(directory)
    return transformers.AutoTokenizer.from_pretrained(directory)


def transformers_ids(tokenizer, text: str) -> list[int]:
    """transformers' ids for `text`, left-padded to LENGTH with the end-of-text id."""
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    return [tokenizer.eos_token_id] * (LENGTH - len(ids)) + ids


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)  # vla_tiny's LLM shape (as tests/test_hf_siglip.py)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, rms_norm_eps=1e-5, rope_theta=10000.0)).save_pretrained(directory)
    return directory, make_word_tokenizer(directory)


def vla_config(llm_dir, *extra):
    return load_run_config("vla_tiny", [f"init.llm_from_hf={llm_dir}",
                                        f"actions.instruction_len={LENGTH}", "vision.film=true", "data.train=",
                                        "data.eval=", "data.generate=false", f"data.cameras={TOP}", *extra])


def test_the_lerobot_batch_carries_the_tokenizers_ids_for_the_llm_and_bytes_for_film(pretrained, tmp_path):
    llm_dir, tokenizer = pretrained
    config = vla_config(llm_dir)
    assert config.actions.instruction_tokenizer == str((llm_dir / "tokenizer.json").resolve())  # recorded resolved
    write_v30(tmp_path / "data")
    source = make_source(config, str(tmp_path / "data"))
    records = [source[i] for i in (0, 5, 9)]  # episodes 0, 1, 2: tasks A, B, A
    batch = episode_batch(config, {k: np.stack([r[k] for r in records]) for k in records[0]})
    texts = [TASKS[EPISODE_TASK[e]] for e in (0, 1, 2)]
    np.testing.assert_array_equal(batch["inputs"][:, :LENGTH], [transformers_ids(tokenizer, t) for t in texts])
    np.testing.assert_array_equal(batch["instruction_bytes"], [utf8_bytes(t, LENGTH, "") for t in texts])

    # from scratch (no pretrained LLM): bytes for the LLM, and nothing beside them
    scratch = InstructionEncoder(LENGTH, None, False).encode(texts[0], "")
    assert list(scratch) == ["instruction"] and bytes(scratch["instruction"]).rstrip(b"\0").decode() == texts[0]
    with pytest.raises(ConfigError, match=r"is 6 tokens of tokenizer.json .* longer than actions.instruction_len=5"):
        InstructionEncoder(5, config.actions.instruction_tokenizer).encode(texts[0], "tasks.parquet")


def test_rollouts_and_generate_encode_the_instruction_as_training_did(pretrained, tmp_path, monkeypatch):
    """The rollout policy and `generate --episode` hand the decoder the ids the training batch held
    (a fake decoder records them)."""
    import jax

    from jaxpar.inference import decode, generate, loader
    from jaxpar.robot import rollout

    llm_dir, tokenizer = pretrained
    config = vla_config(llm_dir)
    seen = []

    def fake_predict(weights, pixels, ids, config, film):
        seen.append((np.asarray(ids), np.asarray(film)))
        first = config.model.vocab_size - config.actions.bins
        return np.full((len(ids), config.actions.dims), first, np.int32), None

    shape = task.TaskShape.from_config(config)
    env = task.TaskEnv(shape, task.draw_scenes(6, 0, shape))
    rollout.model_policy(config, {}, fake_predict)(env.render(), env.instructions)
    np.testing.assert_array_equal(seen[-1][0], [transformers_ids(tokenizer, t) for t in env.instructions])
    np.testing.assert_array_equal(seen[-1][1], [utf8_bytes(t, LENGTH, "") for t in env.instructions])

    episode = tmp_path / "episode_00000.npz"
    images = np.zeros((2, 1, config.vision.image_size, config.vision.image_size, 3), np.uint8)
    np.savez(episode, images=images, instruction=np.array(TASKS[1]), actions=np.zeros((2, 7), np.float32))
    monkeypatch.setattr(loader, "restore_weights", lambda workdir, step: (config, 1, {}))
    monkeypatch.setattr(decode, "predict_actions", fake_predict)
    monkeypatch.setattr(jax, "jit", lambda fn, **kwargs: fn)
    generate.predict_episode_action(type("Args", (), {"workdir": str(tmp_path), "checkpoint_step": None,
                                                      "episode": str(episode), "step": 1})())
    np.testing.assert_array_equal(seen[-1][0], [transformers_ids(tokenizer, TASKS[1])])
    np.testing.assert_array_equal(seen[-1][1], [utf8_bytes(TASKS[1], LENGTH, "")])


def test_film_reads_the_bytes_and_the_llm_the_ids(pretrained):
    """With a tokenizer the encoder's FiLM conditioning comes from instruction_bytes alone, and the
    action targets are found by place, not by id: a tokenizer's id may fall among the action bins'."""
    import jax

    from jaxpar.models import vit, vla

    config = vla_config(pretrained[0])
    params = vit.init(config.vision, config.model.d_model, jax.random.key(0))
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (2, 1, config.vision.image_size, config.vision.image_size, 3), np.uint8)
    first_action = config.model.vocab_size - config.actions.bins
    ids = np.full((2, LENGTH), first_action + 3, np.int32)  # text ids inside the action range
    raw = rng.integers(1, 256, (2, LENGTH))
    batch = vla.make_batch(config, images, ids, np.zeros((2, config.actions.dims)), raw)
    assert batch["mask"].sum() == 2 * config.actions.dims and batch["mask"][:, -config.actions.dims:].all()
    tokens = vla.encode_images(params, batch, config)
    other_ids = vla.encode_images(params, {**batch, "inputs": batch["inputs"] + 1}, config)
    other_bytes = vla.encode_images(params, {**batch, "instruction_bytes": batch["instruction_bytes"][::-1]}, config)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(other_ids))
    assert np.abs(np.asarray(tokens) - np.asarray(other_bytes)).max() > 1e-3


@pytest.mark.slow  # two VLA compiles
def test_a_layout_with_tokenizer_ids_and_film_bytes_equals_one_device(pretrained):
    """vla_tiny's (2, 2, 2) 1F1B layout trains on the tokenizer's ids with FiLM reading the bytes
    beside them exactly as one device does: the bytes travel with the batch's dp shards."""
    import jax

    from jaxpar.models import vla
    from jaxpar.parallel.mesh import Layout
    from jaxpar.parallel.step import StepBuilder

    llm_dir, tokenizer = pretrained
    single = vla_config(llm_dir, "mesh.dp=1", "mesh.pp=1", "mesh.tp=1", "pipeline.microbatches=1", "zero.stage=0",
                        "vision.zero.stage=0", "train.global_batch_size=8")
    parallel = vla_config(llm_dir, "train.global_batch_size=8", "pipeline.microbatches=2")
    texts = [TASKS[i % 2] for i in range(8)]
    encoder = InstructionEncoder.for_config(single)
    ids, film = encoder.encode_batch(texts, "")
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (8, 1, single.vision.image_size, single.vision.image_size, 3), np.uint8)
    host = vla.make_batch(single, images, ids, rng.uniform(-1, 1, (8, single.actions.dims)), film)
    losses = []
    for config in (single, parallel):
        builder = StepBuilder(config, Layout.for_config(config).make_mesh())
        state = builder.init_state(0)
        _, metrics = builder.jit_train_step()(state, jax.device_put(host, builder.batch_sharding()))
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all()
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
