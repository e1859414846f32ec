"""The data layer without training: text shards, the grain pipeline, the demo data and the scripts.

Oracles are independent of the code under test: token streams are rebuilt from the raw files,
the unigram baseline is recomputed with numpy, action bins are written out by hand, and the
per-process sharding is checked by comparing the rows several shards read with the rows one reads.
"""

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import time
import tomllib

import grain
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import TINY_MODEL, builder_for, make_config, replace, require
from jaxpar.data.instructions import InstructionEncoder
from jaxpar.config import DataConfig, EvalConfig, load_config
from jaxpar.data import demo, pipeline, text
from jaxpar.data.episodes import DONE_MARKER, EpisodeSource, write_split
from jaxpar.data.synthetic import SyntheticData
from jaxpar.data.pipeline import (EvalData, GrainData, episode_batch, make_source, process_shard,
                                  text_batch, train_data)
from jaxpar.data.text import TokenSource, is_heldout, prepare_text, read_meta
from jaxpar.errors import ConfigError
from jaxpar.parallel.mesh import Layout

REPO = pathlib.Path(__file__).resolve().parent.parent
TEXT_MODEL = dataclasses.replace(TINY_MODEL, vocab_size=264)  # byte tokenizer: 258 ids, padded for tp <= 8
EOS = 256  # the byte tokenizer's end of document

CORPUS = {  # relative path -> text; whole files go to one split
    "a.txt": "hello world\n" * 5,
    "b.py": "def f(x):\n    return x * 2\n\n\nprint(f(21))\n",
    "sub/c.md": "# caf\u00e9 \u2014 notes on \u00fcber-things\n" * 2,  # non-ASCII: bytes != characters
    "sub/deeper/d.txt": "the quick brown fox jumps over the lazy dog\n" * 3,
    "e.txt": "lorem ipsum dolor sit amet, consectetur adipiscing elit\n" * 2,
    "f.txt": "zzz 123 456 789\n" * 4,
    "g.txt": "pack my box with five dozen liquor jugs\n" * 2,
    "h.txt": "sphinx of black quartz, judge my vow\n" * 3,
}
FRACTION = 0.5


def write_corpus(directory: pathlib.Path, files=CORPUS) -> pathlib.Path:
    for relative, content in files.items():
        (directory / relative).parent.mkdir(parents=True, exist_ok=True)
        (directory / relative).write_text(content, encoding="utf-8")
    (directory / "whitespace.txt").write_text("  \n\t\n")  # no text: skipped
    (directory / "blob.bin").write_bytes(b"\xff\xfe\x00\x9c")  # not UTF-8: skipped
    return directory


def split_of(relative: str) -> str:
    return "heldout" if is_heldout(relative, FRACTION) else "train"


def byte_stream(split: str, files=CORPUS) -> np.ndarray:
    """The split's tokens rebuilt from the raw text: sorted files, UTF-8 bytes, EOS after each."""
    parts = []
    for relative in sorted(files, key=lambda r: pathlib.Path(r).parts):
        if split_of(relative) == split:
            parts += list(files[relative].encode("utf-8")) + [EOS]
    return np.array(parts, np.int64)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The corpus prepared with the byte tokenizer into out/train and out/heldout."""
    assert {split_of(r) for r in CORPUS} == {"train", "heldout"}, "the test corpus must fill both splits"
    root = tmp_path_factory.mktemp("text")
    source = write_corpus(root / "src")
    metas = prepare_text(source, root / "out" / "train", root / "out" / "heldout", heldout_fraction=FRACTION)
    return root, metas


def shard_files(directory: pathlib.Path) -> list[np.ndarray]:
    return [np.load(p) for p in sorted(directory.glob("tokens_*.npy"))]


def text_config(out: pathlib.Path, dp=2, tp=4, batch=4, seq_len=8, **eval_cfg):
    config = make_config(dp=dp, tp=tp, model=TEXT_MODEL, seq_len=seq_len, global_batch_size=batch)
    return replace(config, data=DataConfig(train=str(out / "train"), eval=str(out / "heldout")),
                   eval=EvalConfig(**eval_cfg))


# ----------------------------------------------------------------------------- text: preparing shards


def test_prepare_text_counts_bytes_tokens_and_files_of_each_split(corpus):
    """Bytes are UTF-8 bytes (not characters); tokens = bytes + one EOS per file; skipped files don't count."""
    root, metas = corpus
    for split in ("train", "heldout"):
        files = [r for r in CORPUS if split_of(r) == split]
        n_bytes = sum(len(CORPUS[r].encode("utf-8")) for r in files)
        meta = read_meta(root / "out" / split)
        assert meta == metas[split]  # what prepare_text returned is what it wrote
        assert (meta["files"], meta["bytes"], meta["tokens"]) == (len(files), n_bytes, n_bytes + len(files))
        assert (meta["tokenizer"], meta["vocab_size"], meta["eos_id"], meta["shards"]) == ("byte", 258, 256, 1)
        assert meta["source"] == str(root / "src")
    assert metas["train"]["bytes"] + metas["heldout"]["bytes"] > sum(len(t) for t in CORPUS.values())  # é, —, ü


def test_each_file_lands_whole_in_one_split_in_sorted_order(corpus):
    root, _ = corpus
    for split in ("train", "heldout"):
        (shard,) = shard_files(root / "out" / split)
        assert shard.dtype == np.uint16
        np.testing.assert_array_equal(shard, byte_stream(split))


def test_the_split_of_a_file_depends_only_on_its_path(tmp_path):
    """Changing every file's content moves no file to the other split; fraction 0 / 1 hold none / all out."""
    changed = {relative: content.upper() + "more text\n" for relative, content in CORPUS.items()}
    metas = prepare_text(write_corpus(tmp_path / "src", changed), tmp_path / "train", tmp_path / "heldout",
                         heldout_fraction=FRACTION)
    for split in ("train", "heldout"):
        assert metas[split]["files"] == sum(split_of(r) == split for r in CORPUS)
        np.testing.assert_array_equal(shard_files(tmp_path / split)[0], byte_stream(split, changed))
    assert not any(is_heldout(r, 0.0) for r in CORPUS) and all(is_heldout(r, 1.0) for r in CORPUS)
    held = [r for r in CORPUS if is_heldout(r, 0.3)]
    assert set(held) <= {r for r in CORPUS if is_heldout(r, FRACTION)}  # a larger fraction only adds files


def test_unigram_baseline_is_the_add_one_cross_entropy_per_held_out_byte(corpus):
    """Recomputed from the raw text: counts of the train bytes + EOS, plus one for each of the 258 ids."""
    _, metas = corpus
    counts = np.ones(258)
    np.add.at(counts, byte_stream("train"), 1)
    probs = counts / counts.sum()
    held = byte_stream("heldout")
    held_bytes = sum(len(CORPUS[r].encode("utf-8")) for r in CORPUS if split_of(r) == "heldout")
    expected = -np.log2(probs[held]).sum() / held_bytes
    assert metas["heldout"]["unigram_bits_per_byte"] == pytest.approx(expected, rel=1e-12)
    assert 1.0 < expected < 8.0


def test_token_source_windows_are_consecutive_slices_of_seq_len_plus_one(corpus):
    root, _ = corpus
    stream = byte_stream("train")
    source = TokenSource(root / "out" / "train", seq_len=8, vocab_size=264)
    assert len(source) == len(stream) // 9
    for record in range(len(source)):
        assert source[record].dtype == np.int32
        np.testing.assert_array_equal(source[record], stream[9 * record:9 * record + 9])
    assert source.bytes_per_token == pytest.approx(
        sum(len(CORPUS[r].encode()) for r in CORPUS if split_of(r) == "train") / len(stream))


def test_token_source_maps_records_across_several_shards(tmp_path, monkeypatch):
    """With tiny shards (documents are never split), windows stay inside a shard and skip its tail."""
    monkeypatch.setattr(text, "SHARD_TOKENS", 150)
    metas = prepare_text(write_corpus(tmp_path / "src"), tmp_path / "train", tmp_path / "heldout",
                         heldout_fraction=FRACTION)
    shards = shard_files(tmp_path / "train")
    assert len(shards) == metas["train"]["shards"] >= 2
    np.testing.assert_array_equal(np.concatenate(shards), byte_stream("train"))
    expected = [shard[i * 9:(i + 1) * 9] for shard in shards for i in range(len(shard) // 9)]
    source = TokenSource(tmp_path / "train", seq_len=8, vocab_size=258)
    assert len(source) == len(expected)
    for record, window in enumerate(expected):
        np.testing.assert_array_equal(source[record], window)


def test_prepare_text_errors_name_the_directory_and_the_fix(tmp_path):
    with pytest.raises(ConfigError, match=f"text directory {tmp_path / 'nope'} does not exist"):
        prepare_text(tmp_path / "nope", tmp_path / "train", tmp_path / "heldout")
    source = write_corpus(tmp_path / "src")
    with pytest.raises(ConfigError, match="went to the heldout split .*held-out fraction"):
        prepare_text(source, tmp_path / "t1", tmp_path / "h1", heldout_fraction=0.0)
    with pytest.raises(ConfigError, match="went to the train split"):
        prepare_text(source, tmp_path / "t2", tmp_path / "h2", heldout_fraction=1.0)
    with pytest.raises(ConfigError, match="no text files"):
        prepare_text(source, tmp_path / "t3", tmp_path / "h3", pattern="**/*.rst")
    with pytest.raises(ConfigError, match="tokenizer 'gpt2' is neither 'byte' nor a file.*nothing is downloaded"):
        prepare_text(source, tmp_path / "t4", tmp_path / "h4", tokenizer="gpt2")
    (tmp_path / "vocab.txt").write_text("a b c")
    with pytest.raises(ConfigError, match="unknown kind '.txt'"):
        prepare_text(source, tmp_path / "t5", tmp_path / "h5", tokenizer=str(tmp_path / "vocab.txt"))


def test_token_source_errors_name_the_directory_and_the_fix(corpus, tmp_path):
    root, _ = corpus
    train = root / "out" / "train"
    with pytest.raises(ConfigError, match="vocabulary of 258 but model.vocab_size=128; set model.vocab_size >= 258"):
        TokenSource(train, seq_len=8, vocab_size=128)
    n_tokens = read_meta(train)["tokens"]
    with pytest.raises(ConfigError, match=f"{n_tokens} tokens, fewer than one example of train.seq_len \\+ 1"):
        TokenSource(train, seq_len=n_tokens, vocab_size=264)
    assert len(TokenSource(train, seq_len=n_tokens - 1, vocab_size=264)) == 1  # exactly one window fits
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=f"{tmp_path / 'empty'} holds no meta.json.*prepare_text.py"):
        TokenSource(tmp_path / "empty", seq_len=8, vocab_size=264)
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "meta.json").write_text((train / "meta.json").read_text())
    with pytest.raises(ConfigError, match="0 tokens_\\*.npy files but meta.json lists 1"):
        TokenSource(copy, seq_len=8, vocab_size=264)
    np.save(copy / "tokens_00000.npy", np.load(train / "tokens_00000.npy"))
    np.save(copy / "tokens_00001.npy", np.load(train / "tokens_00000.npy"))
    with pytest.raises(ConfigError, match="2 tokens_\\*.npy files but meta.json lists 1"):
        TokenSource(copy, seq_len=8, vocab_size=264)
    (copy / "meta.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ConfigError, match="is not jaxpar-tokens-v1"):
        TokenSource(copy, seq_len=8, vocab_size=264)


def test_preparing_a_smaller_corpus_into_the_same_directory_replaces_the_old_shards(tmp_path, monkeypatch):
    monkeypatch.setattr(text, "SHARD_TOKENS", 150)
    source = write_corpus(tmp_path / "src")
    prepare_text(source, tmp_path / "out" / "train", tmp_path / "out" / "heldout", heldout_fraction=FRACTION)
    assert len(list((tmp_path / "out" / "train").glob("tokens_*.npy"))) >= 2
    small = {r: c for r, c in CORPUS.items() if r in ("a.txt", "sub/c.md", "b.py", "e.txt")}
    assert {split_of(r) for r in small} == {"train", "heldout"}
    source = write_corpus(tmp_path / "small", small)
    metas = prepare_text(source, tmp_path / "out" / "train", tmp_path / "out" / "heldout", heldout_fraction=FRACTION)
    assert metas["train"]["shards"] == 1
    source = TokenSource(tmp_path / "out" / "train", seq_len=8, vocab_size=258)
    np.testing.assert_array_equal(source[0], byte_stream("train", small)[:9])


# ----------------------------------------------------------------------------- text: local tokenizer models


def corpus_text() -> str:
    return "".join(CORPUS.values())


def test_prepare_text_with_a_local_hugging_face_tokenizer(tmp_path):
    """A BPE trained here (nothing downloaded): tokens are its ids plus its <eos> after each file."""
    tokenizers = require("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS.values(), tokenizers.trainers.BpeTrainer(vocab_size=120,
                                                                               special_tokens=["<unk>", "<eos>"]))
    path = tmp_path / "tok.json"
    tok.save(str(path))
    metas = prepare_text(write_corpus(tmp_path / "src"), tmp_path / "train", tmp_path / "heldout",
                         tokenizer=str(path), heldout_fraction=FRACTION)
    eos = tok.token_to_id("<eos>")
    meta = metas["train"]
    assert (meta["tokenizer"], meta["vocab_size"], meta["eos_id"]) == (str(path), tok.get_vocab_size(), eos)
    expected = []
    for relative in sorted(CORPUS, key=lambda r: pathlib.Path(r).parts):
        if split_of(relative) == "train":
            expected += tok.encode(CORPUS[relative], add_special_tokens=False).ids + [eos]
    np.testing.assert_array_equal(shard_files(tmp_path / "train")[0], expected)
    assert meta["tokens"] == len(expected) < meta["bytes"]  # merges: fewer tokens than bytes
    assert len(TokenSource(tmp_path / "train", seq_len=4, vocab_size=tok.get_vocab_size())) == len(expected) // 5


def test_prepare_text_with_a_local_sentencepiece_model(tmp_path):
    spm = require("sentencepiece")
    (tmp_path / "corpus.txt").write_text(corpus_text())
    spm.SentencePieceTrainer.train(input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=60, model_type="bpe", minloglevel=2)
    model = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    metas = prepare_text(write_corpus(tmp_path / "src"), tmp_path / "train", tmp_path / "heldout",
                         tokenizer=str(tmp_path / "sp.model"), heldout_fraction=FRACTION)
    meta = metas["heldout"]
    assert (meta["vocab_size"], meta["eos_id"]) == (60, model.eos_id()) and model.eos_id() >= 0
    expected = []
    for relative in sorted(CORPUS, key=lambda r: pathlib.Path(r).parts):
        if split_of(relative) == "heldout":
            expected += model.encode(CORPUS[relative]) + [model.eos_id()]
    np.testing.assert_array_equal(shard_files(tmp_path / "heldout")[0], expected)
    assert meta["tokens"] == len(expected) != meta["bytes"] + meta["files"]
    assert np.isfinite(meta["unigram_bits_per_byte"])


def test_a_sentencepiece_model_without_an_eos_or_pad_id_is_refused_before_writing(tmp_path):
    """eos_id=-1 (and sentencepiece's default pad_id=-1): no id can separate the documents, so
    SentencePieceTokenizer refuses the model, naming it and the fix, before any split is written."""
    spm = require("sentencepiece")
    (tmp_path / "corpus.txt").write_text(corpus_text())
    spm.SentencePieceTrainer.train(input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=60, model_type="bpe", eos_id=-1, minloglevel=2)
    model = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    assert (model.eos_id(), model.pad_id()) == (-1, -1)
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'sp.model'} has no eos (or pad) id to separate "
                                                    "documents; retrain it with eos_id >= 0")):
        prepare_text(write_corpus(tmp_path / "src"), tmp_path / "train", tmp_path / "heldout",
                     tokenizer=str(tmp_path / "sp.model"), heldout_fraction=FRACTION)
    assert not (tmp_path / "train").exists() and not (tmp_path / "heldout").exists()


# ----------------------------------------------------------------------------- pipeline: sharding


@pytest.mark.parametrize("dp, pp, tp", [(1, 1, 8), (2, 1, 4), (8, 1, 1), (2, 2, 2)])
def test_a_single_process_is_the_only_data_shard(dp, pp, tp):
    mesh = Layout(dp=dp, pp=pp, tp=tp).make_mesh()
    for spec in (P("dp", None), P(None, None)):
        assert process_shard(NamedSharding(mesh, spec), 16) == (0, 1)


class ProcessView:
    """A sharding as one process of a multi-host job sees it: only its own devices are addressable."""

    def __init__(self, sharding, devices):
        self.sharding, self.devices = sharding, set(devices)

    def addressable_devices_indices_map(self, shape):
        return {d: i for d, i in self.sharding.devices_indices_map(shape).items() if d in self.devices}


def test_each_process_of_a_multi_host_layout_reads_its_own_block_of_rows():
    """dp=4 x tp=2 over two 'hosts' of 4 devices each: host h holds dp ranks 2h, 2h+1 = rows [8h, 8h + 8)."""
    mesh = Layout(dp=4, tp=2).make_mesh()
    sharding = NamedSharding(mesh, P("dp", None))
    devices = list(mesh.devices.flat)
    assert process_shard(ProcessView(sharding, devices[:4]), 16) == (0, 2)
    assert process_shard(ProcessView(sharding, devices[4:]), 16) == (1, 2)
    assert process_shard(ProcessView(sharding, devices[2:4]), 16) == (1, 4)  # one dp rank per host
    with pytest.raises(ConfigError, match="not one aligned contiguous block"):  # dp ranks 0 and 2
        process_shard(ProcessView(sharding, devices[0:2] + devices[4:6]), 16)


def shard_rows(source, seed: int, shards: int, batch: int, steps: int) -> list[list]:
    """Per step, the records all shards read (built as GrainData builds each shard's dataset)."""
    per_shard = []
    for k in range(shards):
        dataset = grain.MapDataset.source(source).shuffle(seed=seed).repeat()[k::shards].batch(batch // shards)
        per_shard.append([np.asarray(dataset[s]).tolist() for s in range(steps)])
    return [sum((per_shard[k][s] for k in range(shards)), []) for s in range(steps)]


@pytest.mark.parametrize("shards", [2, 4])
def test_shards_together_read_exactly_the_rows_of_one_reader_across_epochs(shards):
    """13 records, batch 8: step 1 straddles the first epoch boundary; 6 steps cover 3+ epochs."""
    source, batch, steps = list(range(13)), 8, 6
    (one,) = [shard_rows(source, 5, 1, batch, steps)]
    many = shard_rows(source, 5, shards, batch, steps)
    for s in range(steps):
        assert sorted(many[s]) == sorted(one[s]) and len(many[s]) == batch
    order = sum(one, [])
    epochs = [order[e * 13:(e + 1) * 13] for e in range(3)]
    assert all(sorted(e) == source for e in epochs)  # every record once per epoch
    assert epochs[0] != epochs[1] and epochs[0] != source  # shuffled, and reshuffled each epoch


def windows(local: dict) -> list[tuple]:
    """The seq_len + 1 windows of a text batch, as hashable rows."""
    full = np.concatenate([np.asarray(local["inputs"]), np.asarray(local["targets"])[:, -1:]], axis=1)
    return [tuple(row) for row in full.tolist()]


@pytest.mark.parametrize("shards", [2, 4])
def test_grain_data_shards_of_other_processes_read_the_rows_of_one_process(corpus, monkeypatch, shards):
    """GrainData itself, told it is shard k of S: its local rows over k are the one-process rows."""
    root, _ = corpus
    config = text_config(root / "out", dp=1, tp=1, batch=4)
    sharding = NamedSharding(Layout().make_mesh(), P(None, None))
    steps = len(TokenSource(root / "out" / "train", 8, 264)) // 4 + 2  # into the second epoch
    one = GrainData(config, sharding)
    expected = [windows(one.next_local()) for _ in range(steps)]
    got = [[] for _ in range(steps)]
    for k in range(shards):
        monkeypatch.setattr(pipeline, "process_shard", lambda sharding, batch, k=k: (k, shards))
        data = GrainData(config, sharding)
        for s in range(steps):
            local = data.next_local()
            assert local["inputs"].shape == (4 // shards, 8)
            got[s] += windows(local)
    for s in range(steps):
        assert sorted(got[s]) == sorted(expected[s])


def test_grain_data_reads_every_window_once_per_epoch_in_a_seeded_shuffled_order(corpus):
    root, _ = corpus
    config = text_config(root / "out", dp=2, tp=4, batch=4)
    sharding = builder_for(config).batch_sharding()
    source = TokenSource(root / "out" / "train", 8, 264)
    every = sorted(tuple(source[i].tolist()) for i in range(len(source)))
    steps = -(-2 * len(source) // 4)

    def order(config):
        data = GrainData(config, sharding)
        return sum((windows(data.next_batch()) for _ in range(steps)), [])

    rows = order(config)
    assert sorted(rows[:len(source)]) == every and sorted(rows[len(source):2 * len(source)]) == every
    assert rows[:len(source)] != [tuple(source[i].tolist()) for i in range(len(source))]  # shuffled
    assert order(config) == rows  # deterministic
    reseeded = replace(config, train=dataclasses.replace(config.train, seed=1))
    assert order(reseeded) != rows  # the order follows train.seed


def test_grain_batches_are_global_arrays_split_over_dp(corpus):
    root, _ = corpus
    config = text_config(root / "out", dp=2, tp=4, batch=4)
    sharding = builder_for(config).batch_sharding()
    data = train_data(config, sharding)
    assert isinstance(data, GrainData)
    batch = data.next_batch()
    assert set(batch) == {"inputs", "targets", "mask"}
    for key, array in batch.items():
        assert isinstance(array, jax.Array) and array.shape == (4, 8) and array.sharding == sharding
        assert len(array.addressable_shards) == 8
        host = np.asarray(array)
        starts = set()
        for shard in array.addressable_shards:
            assert shard.data.shape == (2, 8)  # half the batch per dp rank, replicated over tp
            np.testing.assert_array_equal(np.asarray(shard.data), host[shard.index])
            starts.add(shard.index[0].start or 0)
        assert starts == {0, 2}
    assert batch["inputs"].dtype == np.int32 and batch["mask"].dtype == np.float32
    single = text_config(root / "out", dp=1, tp=8, batch=4)
    other = GrainData(single, builder_for(single).batch_sharding()).next_batch()
    for key in batch:  # the layout changes where rows live, never which rows
        np.testing.assert_array_equal(np.asarray(other[key]), np.asarray(batch[key]))


@pytest.mark.parametrize("n, m", [(2, 3), (5, 6)])
def test_grain_state_resumes_exactly_where_it_was_saved(corpus, n, m):
    """Read n batches, save, read m more; a fresh pipeline restored from the state reads those m."""
    root, _ = corpus
    config = text_config(root / "out", dp=2, tp=4, batch=4)
    sharding = builder_for(config).batch_sharding()
    data = GrainData(config, sharding)
    for _ in range(n):
        data.next_batch()
    state = json.loads(json.dumps(data.get_state()))  # it goes into checkpoint metadata as JSON
    expected = [data.next_batch() for _ in range(m)]
    resumed = GrainData(config, sharding)
    resumed.set_state(state)
    for want in expected:
        got = resumed.next_batch()
        assert set(got) == set(want)
        for key in want:
            np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]))
    fresh = GrainData(config, sharding).next_batch()
    assert not np.array_equal(np.asarray(fresh["inputs"]), np.asarray(expected[0]["inputs"]))


def test_text_batch_shifts_targets_by_one():
    windows_BxL = np.arange(2 * 6, dtype=np.int32).reshape(2, 6)
    batch = text_batch(windows_BxL)
    np.testing.assert_array_equal(batch["inputs"], [[0, 1, 2, 3, 4], [6, 7, 8, 9, 10]])
    np.testing.assert_array_equal(batch["targets"], [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11]])
    assert batch["mask"].shape == (2, 5) and (batch["mask"] == 1).all()


def test_text_eval_data_reads_the_held_out_windows_in_order(corpus):
    root, metas = corpus
    config = text_config(root / "out", dp=2, tp=4, batch=4)
    evaluation = EvalData(config, builder_for(config).batch_sharding())
    stream = byte_stream("heldout")
    available = (len(stream) // 9) // 4
    assert evaluation.batches == available >= 1
    rows = sum((windows(b) for b in evaluation), [])
    assert rows == [tuple(stream[9 * i:9 * i + 9].tolist()) for i in range(4 * available)]
    assert evaluation.unigram_bits_per_byte == metas["heldout"]["unigram_bits_per_byte"]
    assert evaluation.bytes_per_token == pytest.approx(metas["heldout"]["bytes"] / metas["heldout"]["tokens"])


# ----------------------------------------------------------------------------- pipeline: episodes


@pytest.fixture(scope="module")
def episodes(tmp_path_factory):
    """vla_tiny's shape (16-pixel images, 4 x 4 patches of 4, 7-D actions); episodes end on the
    square, so their lengths vary: count steps with total_steps()."""
    root = tmp_path_factory.mktemp("episodes")
    seen = write_split(root / "train", 8, seed=0, size=16, grid=4, dims=7)
    write_split(root / "heldout", 8, seed=1, exclude=seen, size=16, grid=4, dims=7)
    return root


def total_steps(directory: pathlib.Path) -> int:
    """Steps of every episode in `directory`, read with plain numpy (not through EpisodeSource)."""
    total = 0
    for path in directory.glob("episode_*.npz"):
        with np.load(path) as data:
            total += len(data["actions"])
    return total


def vla_config(root: pathlib.Path, *overrides: str):
    return load_config("vla_tiny.py", [f"data.train={root / 'train'}", f"data.eval={root / 'heldout'}",
                                       "data.generate=false", "train.global_batch_size=8", *overrides])


HAND_BINS = {-3: 0, -2: 42, -1: 85, 0: 128, 1: 170, 2: 213, 3: 255}  # floor((k/3 + 1) / 2 * 256), 256 -> 255


def test_episode_batch_keeps_uint8_images_and_puts_action_bins_in_the_last_256_ids(episodes):
    config = vla_config(episodes)
    source = EpisodeSource(episodes / "train", InstructionEncoder(config.actions.instruction_len))
    items = [source[i] for i in range(8)]
    records = {k: np.stack([item[k] for item in items]) for k in items[0]}
    batch = episode_batch(config, records, with_values=True)
    assert batch["images"].dtype == np.uint8  # scaled on the device, in the encoder (jaxpar.models.vit)
    np.testing.assert_array_equal(batch["images"], records["images"])
    assert batch["images"].max() == 255  # the white effector
    thirds = np.rint(records["actions"] * 3).astype(int)
    np.testing.assert_allclose(records["actions"], thirds / 3, atol=1e-6)  # the grid-4 task moves in thirds
    bins = np.vectorize(HAND_BINS.get)(thirds)
    assert config.model.vocab_size == 512
    np.testing.assert_array_equal(batch["targets"][:, -7:], 256 + bins)
    np.testing.assert_array_equal(batch["inputs"][:, -6:], 256 + bins[:, :-1])
    np.testing.assert_array_equal(batch["inputs"][:, :32], records["instruction"])
    assert (batch["targets"][:, :-7] < 256).all()
    assert (batch["mask"][:, -7:] == 1).all() and (batch["mask"][:, :-7] == 0).all()
    np.testing.assert_array_equal(batch["values"][:, -7:], records["actions"])
    assert (batch["values"][:, :-7] == 0).all()
    assert "values" not in episode_batch(config, records)


def test_vla_grain_batches_are_steps_of_the_episodes(episodes):
    config = vla_config(episodes)
    sharding = builder_for(config).batch_sharding()
    data = GrainData(config, sharding)
    source = EpisodeSource(episodes / "train", InstructionEncoder(32))
    for _ in range(4):  # 24 records, 8 per step: into the second epoch
        batch = data.next_batch()
        assert set(batch) == {"images", "inputs", "targets", "mask"}
        assert batch["images"].shape == (8, 1, 16, 16, 3) and batch["images"].sharding == sharding
        assert {s.data.shape[0] for s in batch["images"].addressable_shards} == {4}  # dp = 2
        assert batch["images"].dtype == np.uint8  # uint8 reaches the device
        images = np.asarray(batch["images"])
        first_id = 512 - 256
        bins = np.asarray(batch["targets"])[:, -7:] - first_id
        for row in range(8):
            matches = [i for i in range(len(source)) if np.array_equal(source[i]["images"], images[row])]
            assert matches, "every image row is a step of some episode"
            want = np.floor((source[matches[0]]["actions"] + 1) * 128).clip(0, 255)
            np.testing.assert_array_equal(bins[row], want)


def test_vla_grain_state_resumes_exactly(episodes):
    config = vla_config(episodes)
    sharding = builder_for(config).batch_sharding()
    data = GrainData(config, sharding)
    data.next_batch()
    data.next_batch()
    state = data.get_state()
    expected = [data.next_batch() for _ in range(3)]
    resumed = GrainData(config, sharding)
    resumed.set_state(state)
    for want in expected:
        got = resumed.next_batch()
        for key in want:
            np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]))


@pytest.mark.parametrize("batches", [0, 1, 5])
def test_vla_eval_data_reads_all_or_the_first_eval_batches_in_file_order(episodes, batches):
    """Held-out steps // a global batch of 8 whole batches (the rest is not read), or eval.batches."""
    whole = total_steps(episodes / "heldout") // 8
    assert whole >= 2
    expected = min(batches, whole) if batches else whole
    config = vla_config(episodes, f"eval.batches={batches}")
    evaluation = EvalData(config, builder_for(config).batch_sharding())
    assert evaluation.batches == expected
    read = list(evaluation)
    assert len(read) == expected
    source = EpisodeSource(episodes / "heldout", InstructionEncoder(32))
    for step, batch in enumerate(read):
        assert set(batch) == {"images", "inputs", "targets", "mask", "values"}
        for row in range(8):
            record = source[8 * step + row]
            np.testing.assert_array_equal(np.asarray(batch["images"][row]), record["images"])
            np.testing.assert_allclose(np.asarray(batch["values"][row, -7:]), record["actions"])
    assert evaluation.bytes_per_token is None and evaluation.unigram_bits_per_byte is None


def test_eval_data_smaller_than_one_global_batch_is_a_clear_error(episodes, tmp_path):
    write_split(tmp_path / "heldout", 1, seed=3, size=16, grid=4, dims=7)  # at most 4 steps < a batch of 8
    steps = total_steps(tmp_path / "heldout")
    config = load_config("vla_tiny.py", [f"data.train={episodes / 'train'}", f"data.eval={tmp_path / 'heldout'}",
                                         "data.generate=false", "train.global_batch_size=8"])
    with pytest.raises(ConfigError, match=f"{tmp_path / 'heldout'} holds {steps} held-out examples, fewer than one "
                                          f"global batch of 8"):
        EvalData(config, builder_for(config).batch_sharding())


def test_episodes_of_another_shape_than_the_config_are_refused(episodes):
    config = vla_config(episodes, "vision.image_size=32", "vision.patch_size=8")
    with pytest.raises(ConfigError, match=r"episodes have images \(1, 16, 16, 3\).*config expects \(1, 32, 32, 3\)"):
        make_source(config, config.data.train)
    config = vla_config(episodes, "actions.dims=5")
    with pytest.raises(ConfigError, match=r"actions \(7,\) per step.*\(5,\) \(actions.dims\)"):
        GrainData(config, builder_for(config).batch_sharding())


def test_an_instruction_longer_than_the_config_fails_at_start_naming_the_file(episodes):
    config = vla_config(episodes, "actions.instruction_len=8")
    with pytest.raises(ConfigError, match="episode_00000.npz: instruction 'move to the .* square' is .* bytes, "
                                          "longer than actions.instruction_len=8"):
        make_source(config, config.data.eval)


def test_synthetic_iterator_state_round_trips():
    config = make_config(dp=2, tp=4)
    sharding = builder_for(config).batch_sharding()
    data = train_data(config, sharding)
    assert isinstance(data, SyntheticData)
    first = [data.next_batch() for _ in range(3)]
    state = data.get_state()
    assert state == {"synthetic_step": 3}
    expected = [data.next_batch() for _ in range(2)]
    resumed = SyntheticData(config, sharding)
    resumed.set_state(json.loads(json.dumps(state)))
    for want in expected:
        got = resumed.next_batch()
        for key in want:
            np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]))
    assert not np.array_equal(np.asarray(first[0]["inputs"]), np.asarray(expected[0]["inputs"]))


# ----------------------------------------------------------------------------- demo data


def demo_config(tmp_path, generate=True, kind="vla"):
    name = "vla_tiny.py" if kind == "vla" else "llama_tiny.py"
    return load_config(name, [f"data.train={tmp_path / 'd' / 'train'}", f"data.eval={tmp_path / 'd' / 'heldout'}",
                              f"data.generate={str(generate).lower()}"])


@pytest.mark.parametrize("key", ["train", "eval"])
def test_check_paths_names_the_key_of_a_missing_or_empty_directory(tmp_path, key):
    (tmp_path / "d" / "train").mkdir(parents=True)
    (tmp_path / "d" / "heldout").mkdir()
    other = {"train": "heldout", "eval": "train"}[key]
    (tmp_path / "d" / other / "episode_00000.npz").write_bytes(b"")
    config = demo_config(tmp_path, generate=False)
    path = config.data.train if key == "train" else config.data.eval
    with pytest.raises(ConfigError) as empty:
        demo.check_paths(config)
    assert f"data.{key}={path} is empty" in str(empty.value) and "make_vla_data.py" in str(empty.value)
    pathlib.Path(path).rmdir()
    with pytest.raises(ConfigError) as missing:
        demo.check_paths(config)
    assert f"data.{key}={path}: no such directory; set data.generate=true" in str(missing.value)
    for err in (empty.value, missing.value):
        assert "\n" not in str(err)


def test_check_paths_suggests_prepare_text_for_an_empty_text_directory(tmp_path):
    (tmp_path / "d" / "train").mkdir(parents=True)
    with pytest.raises(ConfigError, match="data.train=.* is empty; fill it with scripts/prepare_text.py"):
        demo.check_paths(demo_config(tmp_path, generate=False, kind="llama"))


def test_ensure_demo_data_generates_both_vla_splits_once(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "VLA_EPISODES", {"train": 3, "heldout": 2})
    config = demo_config(tmp_path)
    demo.ensure_demo_data(config)
    train, heldout = pathlib.Path(config.data.train), pathlib.Path(config.data.eval)
    assert len(list(train.glob("episode_*.npz"))) == 3 and len(list(heldout.glob("episode_*.npz"))) == 2
    assert (train / DONE_MARKER).exists() and (heldout / DONE_MARKER).exists()
    assert sorted(p.name for p in train.parent.iterdir()) == ["heldout", "train"]  # no .partial- left
    demo.check_paths(config)
    source = make_source(config, config.data.train)  # shaped as the config wants
    assert len(source) == total_steps(train)
    snapshot = {p: p.stat().st_mtime_ns for p in train.parent.rglob("*")}

    def must_not_run(*args):
        raise AssertionError("generated again")

    monkeypatch.setattr(demo, "_generate", must_not_run)
    demo.ensure_demo_data(config)
    assert {p: p.stat().st_mtime_ns for p in train.parent.rglob("*")} == snapshot


def test_an_interrupted_generation_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "VLA_EPISODES", {"train": 2, "heldout": 1})
    from jaxpar.data import episodes
    real = episodes.write_split

    def fail_on_heldout(directory, *args, **kwargs):
        if directory.name.startswith("heldout"):
            directory.mkdir(parents=True)
            raise KeyboardInterrupt
        return real(directory, *args, **kwargs)

    monkeypatch.setattr(episodes, "write_split", fail_on_heldout)
    config = demo_config(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        demo.ensure_demo_data(config)
    assert not (tmp_path / "d").exists() or list((tmp_path / "d").iterdir()) == []


def test_ensure_demo_data_refuses_when_only_one_split_exists(tmp_path):
    config = demo_config(tmp_path)
    pathlib.Path(config.data.train).mkdir(parents=True)
    with pytest.raises(ConfigError, match="only one of .*train and .*heldout exists; remove it"):
        demo.ensure_demo_data(config)
    assert not pathlib.Path(config.data.eval).exists()


def test_ensure_demo_data_does_nothing_without_data_generate(tmp_path):
    demo.ensure_demo_data(demo_config(tmp_path, generate=False))
    assert not (tmp_path / "d").exists()


# ----------------------------------------------------------------------------- scripts


def run_script(name: str, *args, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, str(REPO / "scripts" / name), *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_prepare_text_script_writes_both_splits(tmp_path):
    source = write_corpus(tmp_path / "src")
    proc = run_script("prepare_text.py", source, tmp_path / "out", "--heldout", FRACTION, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for split in ("train", "heldout"):
        np.testing.assert_array_equal(np.load(tmp_path / "out" / split / "tokens_00000.npy"), byte_stream(split))
    assert "unigram baseline on the held-out split" in proc.stdout


def test_prepare_text_script_on_a_missing_directory_is_one_line(tmp_path):
    proc = run_script("prepare_text.py", tmp_path / "nope", tmp_path / "out", cwd=tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert lines[0].startswith("prepare_text: error: text directory") and str(tmp_path / "nope") in lines[0]
    assert not (tmp_path / "out").exists()


def test_make_vla_data_script_writes_both_splits(tmp_path):
    proc = run_script("make_vla_data.py", tmp_path / "out", "--episodes", 3, "--heldout", 2, "--image_size", 8,
                      "--grid", 2, "--steps", 2, "--dims", 4, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    train, heldout = EpisodeSource(tmp_path / "out" / "train", InstructionEncoder(32)), EpisodeSource(tmp_path / "out" / "heldout", InstructionEncoder(32))
    assert (len(train), len(heldout)) == (total_steps(tmp_path / "out" / "train"),
                                          total_steps(tmp_path / "out" / "heldout"))
    assert train.shapes == {"images": (1, 8, 8, 3), "actions": (4,)}
    bad = run_script("make_vla_data.py", tmp_path / "bad", "--image_size", 10, "--grid", 4, cwd=tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().startswith("make_vla_data: error: cannot draw 3 squares on a 4x4 grid")


def test_plot_metrics_script_draws_train_and_eval_curves(tmp_path):
    records = [{"step": s, "loss": 3.0 / s, "grad_norm": 1.0} for s in range(1, 21)]
    records += [{"step": s, "eval_loss": 3.5 / s, "eval_action_accuracy": s / 20, "eval_action_l1": 1 / s}
                for s in (10, 20)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    proc = run_script("plot_metrics.py", tmp_path / "metrics.jsonl", "--out", tmp_path / "plots" / "c.png",
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    png = (tmp_path / "plots" / "c.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    missing = run_script("plot_metrics.py", tmp_path / "nope.jsonl", cwd=tmp_path)
    assert missing.returncode != 0 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr


def test_grain_is_a_declared_dependency():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = {dep.split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower()
             for dep in project["dependencies"]}
    assert "grain" in names


def test_two_jobs_asking_for_the_same_demo_data_at_once_generate_it_once(tmp_path, monkeypatch):
    """Two independent jobs (here threads; each opens the directory itself, as two processes would)
    start on missing demo data together: one generates, the other waits and finds it made."""
    import threading

    config = demo_config(tmp_path)
    calls, started = [], threading.Event()

    def slow_generate(config, train, heldout):
        calls.append(train)
        started.set()
        time.sleep(0.5)  # the other job arrives while this one is still writing
        for d in (train, heldout):
            d.mkdir(parents=True)
            (d / "x").write_text("data")

    monkeypatch.setattr(demo, "_generate", slow_generate)
    errors = []

    def job():
        try:
            demo.ensure_demo_data(config)
        except Exception as err:  # noqa: BLE001 - the test reports whatever a job raised
            errors.append(err)

    first = threading.Thread(target=job)
    first.start()
    started.wait(10)
    second = threading.Thread(target=job)
    second.start()
    first.join(10)
    second.join(10)
    assert errors == [] and len(calls) == 1
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["heldout", "train"]
