"""The image data of ``bench throughput``: one file set, read two ways (cheap and costly).

The bench host writes the set once per bench run (``write_images``), into its scratch dir:

- ``images.bin``: every image JPEG-encoded at ``px`` x ``px`` pixels, back to back (the
  layout of a record file such as a WebDataset shard or a TFRecord);
- ``meta.npz``: ``offsets`` (``n + 1`` byte offsets into ``images.bin``), ``labels``
  (``n`` classes), ``decoded`` (``n`` x 32 x 32 x 3 uint8: each image decoded once and
  resized, for the cheap set).

Both training scripts open it with ``open_images(kind, folder)``:

- ``cheap``: ``decoded`` turned into one normalized float tensor at start; an item is a
  slice of it (microseconds).
- ``costly``: an item is decoded from its JPEG bytes and augmented the way image training
  does (random resized crop to 32 x 32, horizontal flip, brightness jitter), about a
  millisecond each on one core at the default 96 px. Augmentation draws from Python's
  ``random``, which the harness seeds per item (``runtime.loader``) and a plain script
  leaves alone.

Labels are random classes: the bench measures speed, not what the model learns. Limits:
the whole ``images.bin`` is read into memory by each process (a few MB at bench sizes).
"""

from __future__ import annotations

import io
import random
from pathlib import Path

import numpy as np

SIDE = 32  # what the model sees: 3 x 32 x 32
CLASSES = 10
MEAN, STD = 0.5, 0.25
KINDS = ("cheap", "costly")


def synthetic_image(rng: np.random.Generator, px: int) -> np.ndarray:
    """A smooth random RGB image (``px`` x ``px`` x 3 uint8): JPEG-compressible like a photo,
    so decoding costs what a photo's would, not what white noise's would."""
    walk = np.cumsum(rng.normal(0.0, 6.0, (px, px, 3)), axis=1)
    walk += np.cumsum(rng.normal(0.0, 6.0, (px, 1, 3)), axis=0)
    return np.clip(walk + rng.uniform(60, 190, (1, 1, 3)), 0, 255).astype(np.uint8)


def write_images(folder: Path, n: int, px: int, seed: int = 0) -> None:
    """Host side, once per bench: ``images.bin`` and ``meta.npz`` in ``folder``."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    offsets = [0]
    decoded = np.empty((n, SIDE, SIDE, 3), dtype=np.uint8)
    with open(folder / "images.bin", "wb") as f:
        for i in range(n):
            img = Image.fromarray(synthetic_image(rng, px))
            buf = io.BytesIO()
            img.save(buf, format="JPEG", quality=90)
            f.write(buf.getvalue())
            offsets.append(offsets[-1] + buf.tell())
            decoded[i] = np.asarray(img.resize((SIDE, SIDE), Image.BILINEAR))
    labels = rng.integers(0, CLASSES, n)
    np.savez(folder / "meta.npz", offsets=np.asarray(offsets, dtype=np.int64), labels=labels,
             decoded=decoded)


def to_tensor(pixels: np.ndarray):
    """H x W x 3 uint8 (or N x H x W x 3) -> normalized float, channels first."""
    import torch

    x = torch.from_numpy(np.ascontiguousarray(pixels)).float().div_(255.0)
    x = x.movedim(-1, -3)
    return (x - MEAN) / STD


class CheapImages:
    """Pre-decoded images: an item is a tensor slice."""

    def __init__(self, folder: Path) -> None:
        import torch

        meta = np.load(folder / "meta.npz")
        self.x = to_tensor(meta["decoded"]).contiguous()
        self.y = torch.from_numpy(meta["labels"]).long()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class CostlyImages:
    """JPEG bytes: an item is decoded and augmented when fetched."""

    def __init__(self, folder: Path) -> None:
        import torch

        meta = np.load(folder / "meta.npz")
        self.offsets = meta["offsets"]
        self.y = torch.from_numpy(meta["labels"]).long()
        self.blob = (folder / "images.bin").read_bytes()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return augment(self.blob[start:end]), self.y[i]


def augment(jpeg: bytes):
    """One costly item: decode the JPEG, random resized crop to 32 x 32, flip, brightness
    (Python's ``random``); the map-style set and the streaming bench's tar shards share it."""
    from PIL import Image, ImageEnhance

    img = Image.open(io.BytesIO(jpeg)).convert("RGB")
    side = img.width
    crop = random.randint(side // 2, side)
    left, top = random.randint(0, side - crop), random.randint(0, side - crop)
    img = img.resize((SIDE, SIDE), Image.BILINEAR, box=(left, top, left + crop, top + crop))
    if random.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    img = ImageEnhance.Brightness(img).enhance(random.uniform(0.8, 1.2))
    return to_tensor(np.array(img))  # a writable copy: torch wants one


def jpeg_bytes(rng: np.random.Generator, px: int) -> bytes:
    """A ``synthetic_image`` JPEG-encoded as ``write_images`` stores it."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(synthetic_image(rng, px)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def open_images(kind: str, folder: str | Path):
    """The data set of ``kind`` (``cheap`` or ``costly``) over the files in ``folder``."""
    cls = {"cheap": CheapImages, "costly": CostlyImages}[kind]
    return cls(Path(folder))
