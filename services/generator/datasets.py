"""Vision task datasets built from data that ships inside packages (no downloads).

Every head task is a closed-set classification over small RGB PIL images (56x56 by default, i.e. 4
Qwen2-VL image tokens), with fixed train/val/test splits drawn from a fixed seed:

    digit           scikit-learn's `load_digits` (1797 8x8 scans), 10 labels "0".."9"
    parity          same images, "even" / "odd"
    ge5             same images, "no" / "yes" (is the digit >= 5)
    digit-rot90     the digits rotated 90 degrees clockwise, 10 labels
    digit-inverted  the digits with inverted intensities (dark ink on white), 10 labels
    digit-noisy     the digits under Gaussian pixel noise (sigma 4 of 16), 10 labels
    count           synthetic: 1..5 white squares on black, "1".."5"
    colour          the digits drawn in one of 4 ink colours, "red" / "green" / "blue" / "yellow"
    square-colour   a text task (answered in generated text, no head): one coloured 2x2 square on
                    black, "What colour is the square?" -> "red" / "green" / "blue" / "yellow"

A head task (kind "head") is a closed-set classification read by a linear head; a text task
(kind "text", VQA-style) is answered by the language model itself and scored by normalised exact
match (services/generator/answers.py): its `labels` are its distinct reference answers.

Splits are by source image (60/20/20 %), so `digit`, `parity` and `digit-rot90` share the same
held-out scans. Builders are pure functions of (name, seed, image size): calling one twice gives
identical images, labels and splits.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import numpy as np
from PIL import Image

SPLIT_SEED = 20251129
SPLIT_FRACTIONS = (0.6, 0.2, 0.2)
DEFAULT_IMAGE_SIZE = 56
SPLITS = ("train", "val", "test")
HEAD, TEXT = "head", "text"  # task kinds: a head reads the label; text: the answer is generated


@dataclass(frozen=True)
class TaskData:
    """One task: its prompt, label names, and per split the images and integer labels.

    A text task (`kind` TEXT) is trained and answered in generated text: `labels` are its
    distinct reference answers (targets index them) and `questions`, when not None, holds each
    example's own question per split (else every example asks `prompt`)."""

    name: str
    prompt: str
    labels: tuple[str, ...]
    images: dict[str, list[Image.Image]]
    targets: dict[str, np.ndarray]  # split -> int64 label indices
    kind: str = HEAD
    questions: dict[str, list[str]] | None = None

    def size(self, split: str) -> int:
        return len(self.targets[split])

    def question(self, split: str, i: int) -> str:
        """The question example `i` of `split` asks."""
        return self.questions[split][i] if self.questions else self.prompt

    def answers(self, split: str) -> list[str]:
        """The reference label / answer text of each example of `split`."""
        return [self.labels[int(i)] for i in self.targets[split]]


@dataclass(frozen=True)
class TaskSpec:
    """How to build a task: the grayscale/RGB source arrays and labels (all samples), its prompt."""

    name: str
    prompt: str
    labels: tuple[str, ...]
    build: Callable[[int], tuple[np.ndarray, np.ndarray]]  # seed -> (uint8 images N,H,W[,3], labels N)
    description: str
    kind: str = HEAD


@lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.images.astype(np.float32) / 16.0), d.target.astype(np.int64)  # (1797, 8, 8) in [0, 1]


def _to_u8(x: np.ndarray) -> np.ndarray:
    return (np.clip(x, 0.0, 1.0) * 255.0).round().astype(np.uint8)


def _digit_identity(seed: int):
    x, y = _digits()
    return _to_u8(x), y


def _parity(seed: int):
    x, y = _digits()
    return _to_u8(x), (y % 2).astype(np.int64)


def _ge5(seed: int):
    x, y = _digits()
    return _to_u8(x), (y >= 5).astype(np.int64)


def _rot90(seed: int):
    x, y = _digits()
    return _to_u8(np.rot90(x, k=-1, axes=(1, 2))), y


def _inverted(seed: int):
    x, y = _digits()
    return _to_u8(1.0 - x), y


def _noisy(seed: int):
    x, y = _digits()
    rng = np.random.default_rng(seed + 1)
    return _to_u8(x + rng.normal(0.0, 0.25, size=x.shape).astype(np.float32)), y


def _count(seed: int, n: int = 1500, grid: int = 8):
    """n synthetic 8x8 canvases with 1..5 distinct lit cells (random positions); label = count-1."""
    rng = np.random.default_rng(seed + 2)
    y = rng.integers(0, 5, size=n).astype(np.int64)
    x = np.zeros((n, grid, grid), dtype=np.float32)
    for i, k in enumerate(y):
        cells = rng.choice(grid * grid, size=int(k) + 1, replace=False)
        x[i].flat[cells] = rng.uniform(0.7, 1.0, size=len(cells))
    return _to_u8(x), y


_COLOURS = np.array([[1.0, 0.15, 0.15], [0.15, 0.9, 0.15], [0.2, 0.3, 1.0], [1.0, 0.9, 0.1]], dtype=np.float32)


def _colour(seed: int):
    x, _ = _digits()
    rng = np.random.default_rng(seed + 3)
    y = rng.integers(0, len(_COLOURS), size=len(x)).astype(np.int64)
    rgb = x[..., None] * _COLOURS[y][:, None, None, :]
    return _to_u8(rgb), y


def _square_colour(seed: int, n: int = 1000, grid: int = 8):
    """n 8x8 black canvases with one 2x2 square of one of the 4 colours at a random position."""
    rng = np.random.default_rng(seed + 4)
    y = rng.integers(0, len(_COLOURS), size=n).astype(np.int64)
    x = np.zeros((n, grid, grid, 3), dtype=np.float32)
    rows, cols = rng.integers(0, grid - 1, size=n), rng.integers(0, grid - 1, size=n)
    for i in range(n):
        x[i, rows[i] : rows[i] + 2, cols[i] : cols[i] + 2] = _COLOURS[y[i]]
    return _to_u8(x), y


_DIGITS = tuple(str(i) for i in range(10))
TASKS: dict[str, TaskSpec] = {
    s.name: s
    for s in (
        TaskSpec(
            "digit", "Which digit is this?", _DIGITS, _digit_identity, "handwritten digit identity (sklearn digits)"
        ),
        TaskSpec("parity", "Is the digit even or odd?", ("even", "odd"), _parity, "parity of a handwritten digit"),
        TaskSpec("ge5", "Is the digit at least five?", ("no", "yes"), _ge5, "is the handwritten digit >= 5"),
        TaskSpec("digit-rot90", "Which digit is this?", _DIGITS, _rot90, "digit identity, images rotated 90 degrees"),
        TaskSpec("digit-inverted", "Which digit is this?", _DIGITS, _inverted, "digit identity, inverted intensities"),
        TaskSpec("digit-noisy", "Which digit is this?", _DIGITS, _noisy, "digit identity under Gaussian pixel noise"),
        TaskSpec(
            "count",
            "How many squares are there?",
            ("1", "2", "3", "4", "5"),
            _count,
            "count 1..5 lit squares (synthetic)",
        ),
        TaskSpec(
            "colour",
            "What colour is the digit?",
            ("red", "green", "blue", "yellow"),
            _colour,
            "ink colour of a handwritten digit",
        ),
        TaskSpec(
            "square-colour",
            "What colour is the square?",
            ("red", "green", "blue", "yellow"),
            _square_colour,
            "colour of one square, answered in text (a text task: no head)",
            kind=TEXT,
        ),
    )
}
DEFAULT_TASKS = ("digit", "parity", "ge5", "digit-rot90", "digit-inverted", "count", "colour")


def split_indices(n: int, seed: int = SPLIT_SEED) -> dict[str, np.ndarray]:
    """Deterministic 60/20/20 split of range(n) (sorted index arrays per split)."""
    perm = np.random.default_rng(seed).permutation(n)
    a = int(round(n * SPLIT_FRACTIONS[0]))
    b = a + int(round(n * SPLIT_FRACTIONS[1]))
    return {"train": np.sort(perm[:a]), "val": np.sort(perm[a:b]), "test": np.sort(perm[b:])}


def render(pixels: np.ndarray, size: int = DEFAULT_IMAGE_SIZE) -> Image.Image:
    """uint8 (h, w) or (h, w, 3) array -> size x size RGB PIL image (nearest-neighbour upscale)."""
    img = Image.fromarray(pixels, mode="RGB" if pixels.ndim == 3 else "L")
    return img.convert("RGB").resize((size, size), Image.NEAREST)


def build_task(
    name: str, seed: int = SPLIT_SEED, image_size: int = DEFAULT_IMAGE_SIZE, limit: int | None = None
) -> TaskData:
    """The named task with its splits. `limit` caps each split's size (for quick tests)."""
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; known: {sorted(TASKS)}")
    spec = TASKS[name]
    pixels, labels = spec.build(seed)
    splits = split_indices(len(labels), seed)
    images, targets = {}, {}
    for split, idx in splits.items():
        if limit is not None:
            idx = idx[:limit]
        images[split] = [render(pixels[i], image_size) for i in idx]
        targets[split] = labels[idx].copy()
    return TaskData(name=name, prompt=spec.prompt, labels=spec.labels, images=images, targets=targets, kind=spec.kind)


def shifted_copies(
    images: list[Image.Image], copies: int, seed: int, step: int | None = None
) -> list[list[Image.Image]]:
    """Label-preserving augmentation: `copies` versions of `images`, each image cyclically shifted
    by a random (dy, dx) in {-1, 0, 1}^2 source pixels (`step` image pixels each, default size/8).
    Cyclic, so a counted square never leaves the canvas; digits have empty borders."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(copies):
        batch = []
        for img in images:
            st = step or img.size[0] // 8
            dy, dx = rng.integers(-1, 2, size=2) * st
            batch.append(Image.fromarray(np.roll(np.asarray(img), (int(dy), int(dx)), axis=(0, 1))))
        out.append(batch)
    return out


def build_tasks(
    names=DEFAULT_TASKS, seed: int = SPLIT_SEED, image_size: int = DEFAULT_IMAGE_SIZE, limit: int | None = None
) -> dict[str, TaskData]:
    return {n: build_task(n, seed, image_size, limit) for n in names}
