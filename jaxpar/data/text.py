"""Text as token shards: tokenizers, the shard format, a grain source and the unigram baseline.

On-disk format (written by scripts/prepare_text.py): a split directory holds `tokens_NNNNN.npy`
(uint16, or uint32 for vocabularies over 65536) and `meta.json` with the tokenizer, its vocabulary
size, the EOS id that separates documents, and the split's byte and token counts (bits per byte
needs bytes per token). Documents are concatenated, EOS after each; training examples are
consecutive non-overlapping windows of seq_len + 1 tokens within a shard (GPT-style packing).

Tokenizers: `byte` (UTF-8 bytes 0-255, EOS 256, PAD 257: vocabulary 258, nothing to download), or a
local model file: `*.model` for sentencepiece, `*.json` for Hugging Face `tokenizers`.

Special tokens: a `tokenizers` file encodes with its own post-processor, so a Llama tokenizer.json puts
BOS (`<s>`, `<|begin_of_text|>`) before every document, as the model was pretrained and as transformers'
`tokenizer(text)` and jaxpar.inference.generate's prompts do; EOS is appended unless the template already
ended the document with it. meta.json's `special_tokens` says which way a split was encoded (absent:
shards written before it was recorded, encoded without), so generation from a run encodes its prompts
as its training text was. A sentencepiece `.model` carries no template (the library adds nothing by
default) and is encoded as it is; for a Hugging Face model, prepare its text with its tokenizer.json.
"""

from __future__ import annotations

import hashlib
import json
import math
import pathlib

import numpy as np

from jaxpar.data import NPY_LOCK
from jaxpar.errors import ConfigError

BYTE_EOS, BYTE_PAD, BYTE_VOCAB = 256, 257, 258
META = "meta.json"
SHARD_TOKENS = 1 << 24  # tokens per shard file


class ByteTokenizer:
    name, vocab_size, eos_id = "byte", BYTE_VOCAB, BYTE_EOS

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    def __init__(self, path: pathlib.Path):
        import sentencepiece

        self.name, self.model = str(path), sentencepiece.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = self.model.get_piece_size()
        self.eos_id = self.model.eos_id() if self.model.eos_id() >= 0 else self.model.pad_id()
        if self.eos_id < 0:
            raise ConfigError(f"{path} has no eos (or pad) id to separate documents; retrain it with eos_id >= 0")

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.model.encode(text), np.int64)

    def decode(self, ids) -> str:
        return self.model.decode([int(i) for i in ids])


END_OF_DOCUMENT = ("</s>", "<|end_of_text|>", "<|endoftext|>", "[SEP]", "<eos>")  # <|end_of_text|>: Llama 3


class HFTokenizer:
    """A Hugging Face `tokenizers` file. `special_tokens` (default): encode() runs the file's
    post-processor (a Llama's BOS), as transformers' `tokenizer(text)` does, so text means to the
    model what it meant in pretraining; False: the bare pieces (chat templates, which write the
    special tokens themselves, and shards written before meta.json recorded `special_tokens`).
    `need_eos`: training data needs an end-of-document id to separate documents; generation does
    not (it reads its stop ids from the model's generation_config.json / config.json)."""

    def __init__(self, path: pathlib.Path, special_tokens: bool = True, need_eos: bool = True):
        import tokenizers

        self.name, self.model = str(path), tokenizers.Tokenizer.from_file(str(path))
        self.vocab_size, self.special_tokens = self.model.get_vocab_size(), special_tokens
        specials = [self.model.token_to_id(t) for t in END_OF_DOCUMENT]
        self.eos_id = next((i for i in specials if i is not None), None)
        if self.eos_id is None and need_eos:
            raise ConfigError(f"{path} has none of the end-of-document tokens {', '.join(END_OF_DOCUMENT)}; "
                              f"add one to the tokenizer so documents can be separated")

    def encode(self, text: str, special_tokens: bool | None = None) -> np.ndarray:
        special = self.special_tokens if special_tokens is None else special_tokens
        return np.asarray(self.model.encode(text, add_special_tokens=special).ids, np.int64)

    def decode(self, ids) -> str:
        return self.model.decode([int(i) for i in ids])


def load_tokenizer(spec: str, special_tokens: bool = True):
    """'byte', or a local sentencepiece (.model) / Hugging Face tokenizers (.json) file;
    `special_tokens`: whether a tokenizers file's template (BOS) is applied (HFTokenizer)."""
    if spec == "byte":
        return ByteTokenizer()
    path = pathlib.Path(spec)
    if not path.is_file():
        raise ConfigError(f"tokenizer '{spec}' is neither 'byte' nor a file; pass a local .model (sentencepiece) "
                          f"or .json (tokenizers) file; nothing is downloaded")
    kinds = {".model": (SentencePieceTokenizer, "sentencepiece"), ".json": (HFTokenizer, "tokenizers")}
    if path.suffix not in kinds:
        raise ConfigError(f"tokenizer {path}: unknown kind '{path.suffix}'; use a sentencepiece .model or a "
                          f"tokenizers .json file")
    cls, package = kinds[path.suffix]
    try:
        return cls(path, special_tokens) if cls is HFTokenizer else cls(path)
    except ImportError:
        raise ConfigError(f"tokenizer {path} needs the '{package}' package: pip install {package}") from None


# ----------------------------------------------------------------------------- writing


def is_heldout(relative_path: str, fraction: float) -> bool:
    """A stable per-file split: the same file lands in the same split on every machine and run."""
    digest = int(hashlib.sha256(relative_path.encode()).hexdigest()[:8], 16)
    return digest < fraction * 0x1_0000_0000


class ShardWriter:
    """Appends documents (each followed by EOS) and writes fixed-size shards plus meta.json."""

    def __init__(self, directory: pathlib.Path, tokenizer):
        self.directory, self.tokenizer = directory, tokenizer
        self.dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
        self.buffer, self.buffered, self.shards, self.tokens, self.bytes, self.files = [], 0, 0, 0, 0, 0
        directory.mkdir(parents=True, exist_ok=True)
        for old in [*directory.glob("tokens_*.npy"), directory / META]:  # an earlier run's shards
            old.unlink(missing_ok=True)

    def add(self, text: str) -> None:
        ids = self.tokenizer.encode(text)  # with the tokenizer's template (a Llama's BOS): see the module docstring
        if not len(ids) or ids[-1] != self.tokenizer.eos_id:
            ids = np.append(ids, self.tokenizer.eos_id)
        ids = ids.astype(self.dtype)
        self.buffer.append(ids)
        self.buffered += len(ids)
        self.tokens, self.bytes, self.files = self.tokens + len(ids), self.bytes + len(text.encode()), self.files + 1
        if self.buffered >= SHARD_TOKENS:
            self._flush()

    def _flush(self) -> None:
        if self.buffer:
            np.save(self.directory / f"tokens_{self.shards:05d}.npy", np.concatenate(self.buffer))
            self.buffer, self.buffered, self.shards = [], 0, self.shards + 1

    def close(self, **extra) -> dict:
        self._flush()
        meta = {"format": "jaxpar-tokens-v1", "tokenizer": self.tokenizer.name,
                "vocab_size": self.tokenizer.vocab_size, "eos_id": self.tokenizer.eos_id,
                "special_tokens": bool(getattr(self.tokenizer, "special_tokens", False)), "files": self.files,
                "bytes": self.bytes, "tokens": self.tokens, "shards": self.shards, **extra}
        (self.directory / META).write_text(json.dumps(meta, indent=1))
        return meta


def prepare_text(source: pathlib.Path, train_dir: pathlib.Path, heldout_dir: pathlib.Path, tokenizer: str = "byte",
                 heldout_fraction: float = 0.05, pattern: str = "**/*", max_bytes: int = 0,
                 skip_dirs: tuple[str, ...] = ()) -> dict:
    """Tokenize every text file under `source` into a train and a held-out split (whole files
    each); returns both metas."""
    source = pathlib.Path(source)
    if not source.is_dir():
        raise ConfigError(f"text directory {source} does not exist; pass a directory of text files")
    files = sorted(p for p in source.glob(pattern)
                   if p.is_file() and not set(p.relative_to(source).parts[:-1]) & set(skip_dirs))
    tok = load_tokenizer(tokenizer)
    writers = {"train": ShardWriter(train_dir, tok), "heldout": ShardWriter(heldout_dir, tok)}
    total = 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary or unreadable files are not text
        if not text.strip():
            continue
        relative = path.relative_to(source).as_posix()
        writers["heldout" if is_heldout(relative, heldout_fraction) else "train"].add(text)
        total += len(text.encode())
        if max_bytes and total >= max_bytes:
            break
    for name, writer in writers.items():
        if writer.tokens == 0:
            raise ConfigError(f"no text files under {source} went to the {name} split ({len(files)} files seen); "
                              f"pass a directory with more UTF-8 text files or change the held-out fraction")
    metas = {name: writer.close(source=str(source)) for name, writer in writers.items()}
    metas["heldout"]["unigram_bits_per_byte"] = unigram_bits_per_byte(train_dir, heldout_dir)
    (heldout_dir / META).write_text(json.dumps(metas["heldout"], indent=1))
    return metas


# ----------------------------------------------------------------------------- reading


def read_meta(directory: pathlib.Path) -> dict:
    path = pathlib.Path(directory) / META
    if not path.is_file():
        raise ConfigError(f"{directory} holds no {META} of token shards; make it with "
                          f"scripts/prepare_text.py TEXT_DIR OUT or set data.generate=true")
    meta = json.loads(path.read_text())
    if meta.get("format") != "jaxpar-tokens-v1":
        raise ConfigError(f"{path}: format {meta.get('format')!r} is not jaxpar-tokens-v1; re-run scripts/prepare_text.py")
    return meta


def split_tokenizer(directory: pathlib.Path):
    """The tokenizer a split's shards were made with, encoding as they were encoded (meta.json's
    `special_tokens`; absent: written before it was recorded, without), so a prompt means to a run
    what its training text did. None when the directory holds no meta.json."""
    path = pathlib.Path(directory) / META
    if not path.is_file():
        return None
    meta = json.loads(path.read_text())
    return load_tokenizer(meta.get("tokenizer", "byte"), bool(meta.get("special_tokens", False)))


def load_shards(directory: pathlib.Path) -> list[np.ndarray]:
    meta = read_meta(directory)
    paths = sorted(pathlib.Path(directory).glob("tokens_*.npy"))
    if len(paths) != meta["shards"]:
        raise ConfigError(f"{directory}: {len(paths)} tokens_*.npy files but meta.json lists {meta['shards']}; "
                          f"re-run scripts/prepare_text.py")
    return [np.load(p, mmap_mode="r") for p in paths]


class TokenSource:
    """grain random-access source: record i is a window of seq_len + 1 tokens (memory-mapped)."""

    def __init__(self, directory: str | pathlib.Path, seq_len: int, vocab_size: int):
        self.directory, self.window = pathlib.Path(directory), seq_len + 1
        self.meta = read_meta(self.directory)
        if self.meta["vocab_size"] > vocab_size:
            raise ConfigError(f"{self.directory} was tokenized with a vocabulary of {self.meta['vocab_size']} but "
                              f"model.vocab_size={vocab_size}; set model.vocab_size >= {self.meta['vocab_size']}")
        counts = [len(shard) // self.window for shard in load_shards(self.directory)]
        if sum(counts) == 0:
            raise ConfigError(f"{self.directory} has {self.meta['tokens']} tokens, fewer than one example of "
                              f"train.seq_len + 1 = {self.window}; add text or lower train.seq_len")
        self.starts = np.concatenate([[0], np.cumsum(counts)])
        self._shards = None

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, record: int) -> np.ndarray:
        if self._shards is None:  # opened lazily: grain workers map the files themselves
            with NPY_LOCK:
                self._shards = self._shards or load_shards(self.directory)
        shard = int(np.searchsorted(self.starts, record, side="right")) - 1
        offset = (record - int(self.starts[shard])) * self.window
        return np.asarray(self._shards[shard][offset:offset + self.window], np.int32)

    def __getstate__(self):
        return {**self.__dict__, "_shards": None}

    @property
    def bytes_per_token(self) -> float:
        return self.meta["bytes"] / self.meta["tokens"]


def unigram_bits_per_byte(train_dir: pathlib.Path, heldout_dir: pathlib.Path) -> float:
    """Cross-entropy of the held-out text under the train split's token frequencies (add-one
    smoothing), in bits per byte: what a model that ignores context scores."""
    meta = read_meta(train_dir)
    counts = np.ones(meta["vocab_size"], np.float64)
    for shard in load_shards(train_dir):
        counts += np.bincount(shard, minlength=len(counts))
    log_probs = np.log2(counts / counts.sum())
    held = read_meta(heldout_dir)
    bits = -sum(float(log_probs[np.asarray(s)].sum()) for s in load_shards(heldout_dir))
    return bits / held["bytes"] if held["bytes"] else math.nan
