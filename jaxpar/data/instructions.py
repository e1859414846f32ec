"""How a VLA's instruction reaches the model: ids for the LLM, and bytes for FiLM.

A VLA whose LLM starts from Hugging Face (init.llm_from_hf) learned language through that model's
tokenizer, so its instruction is encoded by the model's tokenizer.json with the tokenizer's own
special tokens (a Llama's BOS first), as transformers' `tokenizer(text)` encodes it. The ids are
padded on the left to actions.instruction_len with the tokenizer's pad id (its end-of-text id when it
has no pad token): the action tokens then follow the instruction's last token directly, as in
OpenVLA's prompt, and the pads sit before BOS. A VLA trained from scratch reads the instruction as
UTF-8 bytes, 0-padded on the right, as jaxpar always has (checkpoints trained so keep their meaning).
FiLM (vision.film) reads UTF-8 bytes either way: its table has 256 rows whatever the LLM reads, so
with a tokenizer the batch carries the bytes beside the ids ("instruction_bytes").

`actions.instruction_tokenizer` says which: "bytes", a tokenizers file, or "auto", which is
resolved where the run is assembled (jaxpar.interop.pretrained: the LLM's tokenizer.json when
init.llm_from_hf has one, else bytes) and recorded resolved in WORKDIR/config.json, so rollouts and
`generate --episode` encode a run's instructions as its training did. Every path (episodes, LeRobot,
the rollout environment, generate) encodes through `InstructionEncoder`.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from jaxpar.config import carries_instruction_bytes, instruction_tokenizer_file
from jaxpar.errors import ConfigError


def utf8_bytes(instruction: str, length: int, where: pathlib.Path | str) -> np.ndarray:
    """The instruction as UTF-8 bytes, 0-padded to `length`; too long is an error naming `where`."""
    text = instruction.encode()
    if len(text) > length:
        raise ConfigError(f"{where}: instruction '{instruction}' is {len(text)} bytes, longer than "
                          f"actions.instruction_len={length}; raise actions.instruction_len")
    ids = np.zeros(length, np.uint8)
    ids[:len(text)] = np.frombuffer(text, np.uint8)
    return ids


def _pad_id(path: pathlib.Path, tokenizer) -> int:
    """tokenizer_config.json's pad token beside the file, else the end-of-text id, else 0."""
    config = path.parent / "tokenizer_config.json"
    if config.is_file():
        pad = json.loads(config.read_text()).get("pad_token")
        pad = pad.get("content") if isinstance(pad, dict) else pad
        if isinstance(pad, str) and tokenizer.model.token_to_id(pad) is not None:
            return int(tokenizer.model.token_to_id(pad))
    return 0 if tokenizer.eos_id is None else int(tokenizer.eos_id)


class InstructionEncoder:
    """Instruction text -> the record fields the batch is built from: "instruction" (the LLM's ids:
    uint8 bytes, or int32 tokenizer ids) and, with a tokenizer and FiLM, "instruction_bytes".
    Pickles without the loaded tokenizer (grain workers load their own)."""

    def __init__(self, length: int, tokenizer_file: str | None = None, bytes_apart: bool = False):
        self.length, self.bytes_apart = length, bytes_apart
        self.tokenizer_file = None if tokenizer_file is None else pathlib.Path(tokenizer_file)
        self._tokenizer = None

    @classmethod
    def for_config(cls, config) -> "InstructionEncoder":
        return cls(config.actions.instruction_len, instruction_tokenizer_file(config), carries_instruction_bytes(config))

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokenizer": None}

    def _loaded(self):
        if self._tokenizer is None:
            from jaxpar.data.text import HFTokenizer

            if not self.tokenizer_file.is_file():
                raise ConfigError(f"actions.instruction_tokenizer={self.tokenizer_file} is not a file; the run's "
                                  f"instructions were encoded with it: put it back or point the key at a copy")
            self._tokenizer = HFTokenizer(self.tokenizer_file, special_tokens=True, need_eos=False)
            self._pad = _pad_id(self.tokenizer_file, self._tokenizer)
        return self._tokenizer

    def llm_ids(self, instruction: str, where: pathlib.Path | str) -> np.ndarray:
        """The ids the LLM reads after the image tokens, [instruction_len]."""
        if self.tokenizer_file is None:
            return utf8_bytes(instruction, self.length, where)
        tokens = self._loaded().encode(instruction)
        if len(tokens) > self.length:
            raise ConfigError(f"{where}: instruction '{instruction}' is {len(tokens)} tokens of "
                              f"{self.tokenizer_file.name} (with its special tokens), longer than "
                              f"actions.instruction_len={self.length}; raise actions.instruction_len")
        ids = np.full(self.length, self._pad, np.int32)
        ids[self.length - len(tokens):] = tokens
        return ids

    def encode(self, instruction: str, where: pathlib.Path | str) -> dict:
        """{"instruction": llm_ids} (+ "instruction_bytes" for FiLM when the LLM reads a tokenizer's ids)."""
        record = {"instruction": self.llm_ids(instruction, where)}
        if self.bytes_apart:
            record["instruction_bytes"] = utf8_bytes(instruction, self.length, where)
        return record

    def encode_batch(self, instructions: list[str], where: pathlib.Path | str) -> tuple[np.ndarray, np.ndarray | None]:
        """Several instructions as the model's inputs: (the LLM's ids int32 [B, instruction_len], the
        bytes FiLM reads int32 [B, instruction_len], or None when FiLM reads the LLM's ids)."""
        records = [self.encode(text, where) for text in instructions]
        ids = np.stack([r["instruction"] for r in records]).astype(np.int32)
        film = np.stack([r["instruction_bytes"] for r in records]).astype(np.int32) if self.bytes_apart else None
        return ids, film
