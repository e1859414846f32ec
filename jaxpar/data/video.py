"""Video frames for the LeRobot reader (jaxpar.data.lerobot): decoding an episode's frames from an
mp4 with PyAV (one seek to the keyframe before the first wanted time, one forward decode; each frame
matched to the decoded frame nearest its time), resizing them as the encoder expects (vision.resize),
and the cache of decoded segments.
"""

from __future__ import annotations

import collections
import fractions
import pathlib
import threading

import numpy as np
from PIL import Image

from jaxpar.errors import ConfigError

FIX = "re-download or re-convert the dataset"


def resize(image: Image.Image, size: int, method: str = "area") -> np.ndarray:
    """uint8 [size, size, 3], untouched at size. `method` (vision.resize): "area" is the box filter (the
    area average) down and bilinear up, jaxpar's choice for an encoder trained from scratch; any other
    is that PIL filter, used both ways. An encoder from Hugging Face (init.vision_from_hf) gets its
    image processor's filter, bicubic for SigLIP (SiglipImageProcessor resizes the uint8 image with PIL
    BICUBIC before rescaling), so the frames it sees are resampled as the ones it was trained on."""
    if image.size != (size, size):
        if method == "area":
            shrink = image.size[0] >= size and image.size[1] >= size
            image = image.resize((size, size), Image.BOX if shrink else Image.BILINEAR)
        else:
            image = image.resize((size, size), Image.Resampling[method.upper()])
    return np.asarray(image.convert("RGB"), np.uint8)


def decode_video(path: pathlib.Path, times: np.ndarray, size: int, tolerance: float,
                 method: str = "area") -> np.ndarray:
    """uint8 [len(times), size, size, 3]: the frames nearest `times` (seconds in the file), from one
    seek to the keyframe before the first and one forward decode through the last. PyAV is imported here, not
    with the module: only a LeRobot dataset's video needs it (a VLA on its own episodes or synthetic data does not)."""
    import av

    got_t, got = [], []
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            first, last = float(times.min()), float(times.max())
            time_base = as_fraction(stream.time_base)
            container.seek(max(int(first / time_base) - 1, 0), backward=True, any_frame=False, stream=stream)
            for frame in container.decode(stream):
                if frame.pts is None:
                    continue
                t = float(frame.pts * time_base)
                if t >= first - tolerance:
                    got_t.append(t)
                    got.append(resize(frame.to_image(), size, method))
                if t >= last - tolerance:
                    break
    except (av.FFmpegError, IndexError, OSError) as err:
        raise ConfigError(f"{path}: cannot decode the video ({err}); {FIX}") from None
    if not got:
        raise ConfigError(f"{path}: no frame at or after t={times.min():.4f}s: the frame indices / timestamps in the "
                          f"parquet run past the video's end; {FIX}")
    got_t = np.asarray(got_t)  # presentation order: ascending
    after = np.clip(np.searchsorted(got_t, times), 0, len(got_t) - 1)
    before = np.maximum(after - 1, 0)
    nearest = np.where(np.abs(got_t[before] - times) < np.abs(got_t[after] - times), before, after)
    off = np.abs(got_t[nearest] - times)
    if off.max() > tolerance:
        bad = int(off.argmax())
        raise ConfigError(f"{path}: no frame within {tolerance:.4f}s of t={times[bad]:.4f}s (nearest decoded: "
                          f"{got_t[nearest[bad]]:.4f}s, last decoded: {got_t[-1]:.4f}s): the parquet's timestamps run "
                          f"past the video's end or disagree with it; {FIX}")
    return np.stack([got[i] for i in nearest])


class FrameCache:
    """Decoded segments, least recently used dropped first once they pass `limit` bytes."""

    def __init__(self, limit: int):
        self.limit, self.bytes, self.items = limit, 0, collections.OrderedDict()
        self.lock = threading.Lock()

    def get(self, key):
        with self.lock:
            value = self.items.get(key)
            if value is not None:
                self.items.move_to_end(key)
            return value

    def put(self, key, value: np.ndarray) -> None:
        with self.lock:
            if key in self.items:
                return
            self.items[key], self.bytes = value, self.bytes + value.nbytes
            while self.bytes > self.limit and len(self.items) > 1:
                self.bytes -= self.items.popitem(last=False)[1].nbytes


def as_fraction(rate) -> fractions.Fraction:
    """A PyAV rational as a Fraction: PyAV up to 18 returns Fraction, 19 its own AVRational (no int())."""
    return fractions.Fraction(rate.numerator, rate.denominator)
