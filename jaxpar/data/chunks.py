"""Action chunks: each frame's record carries the next H actions of its episode (actions.chunk, issue 49).

Why around the sources: both formats (jaxpar's episodes, LeRobot datasets) index the frames of
concatenated episodes and know where each episode ends, so a chunk never runs into the next episode.
Steps past the end are padded with the episode's last action and marked invalid (`action_valid` 0, as
LeRobot's `action_is_pad`). The loss leaves them out (jaxpar.models.vla.make_batch). A policy trained
so still sees what the expert does at the end of an episode, and never learns a made-up continuation.
"""

from __future__ import annotations

import numpy as np


def action_chunk(actions_TxA: np.ndarray, step: int, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """(float32 [chunk, dims] actions from `step` on, padded with the last one; float32 [chunk] validity)."""
    taken = actions_TxA[step:step + chunk]
    padding = np.repeat(taken[-1:], chunk - len(taken), axis=0)
    valid = (np.arange(chunk) < len(taken)).astype(np.float32)
    return np.concatenate([taken, padding]).astype(np.float32), valid


class ChunkedSource:
    """A frame source whose records hold the next `chunk` actions ("actions" [chunk, dims]) and their
    "action_valid" [chunk]. Everything else is the wrapped source's, which must have
    `episode_actions(record) -> (its episode's actions [T, dims], the record's step)`."""

    def __init__(self, source, chunk: int):
        self.source, self.chunk = source, chunk

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, record: int) -> dict:
        actions_TxA, step = self.source.episode_actions(int(record))
        actions, valid = action_chunk(actions_TxA, step, self.chunk)
        return {**self.source[record], "actions": actions, "action_valid": valid}

    def __getattr__(self, name: str):
        # "source" is not yet set while unpickling (no recursion below); private and protocol names (grain
        # looks for _getitems) are not forwarded, so no read can skip the chunking
        if name == "source" or name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.source, name)
