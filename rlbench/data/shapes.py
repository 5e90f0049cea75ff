"""A synthetic image task a tiny VLM can learn on a CPU: coloured shapes drawn with PIL, exact labels.

    train, held_out = write_shapes_task("runs/data/shapes", kind="colour", n_train=512, n_eval=64, seed=0)

Each row is `{"prompt": "colour?", "label": "red", "images": ["img/00017.png"], "metadata": {"rm_type": "exact"}}`
(slime's layout plus `images`, paths relative to the jsonl). kind "colour": one filled square of one of `COLOURS`,
the answer its name; kind "count": 1 to `MAX_COUNT` squares of one colour, the answer the count as a digit. Images
are `side` x `side` pixels (28 by default: 4 tokens for the tiny-vl preset). The split is by row: the held-out rows
are drawn from the same distribution with another seed stream, and no image file is shared.
"""

from __future__ import annotations

import os

import numpy as np

from rlbench.data.tasks import write_jsonl

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220), "yellow": (230, 200, 20)}
"""Colour names (the "colour" answers) and their RGB values."""
MAX_COUNT = 4
"""Most squares in a "count" image (a 2 x 2 grid of cells)."""
KINDS = {"colour": "colour?", "count": "how many?"}
"""Task kinds and their prompt text."""


def shape_image(rng: np.random.Generator, colour: str, count: int, side: int = 28):
    """A white `side` x `side` RGB image with `count` squares of `colour`, one per cell of a 2 x 2 grid, each at a
    random size and offset inside its cell."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (side, side), "white")
    draw = ImageDraw.Draw(img)
    cell = side // 2
    for c in rng.choice(4, size=count, replace=False).tolist():
        size = int(rng.integers(cell // 2, cell - 1))
        x0 = (c % 2) * cell + int(rng.integers(0, cell - size))
        y0 = (c // 2) * cell + int(rng.integers(0, cell - size))
        draw.rectangle((x0, y0, x0 + size - 1, y0 + size - 1), fill=COLOURS[colour])
    return img


def make_shapes(n: int, kind: str, seed: int, image_dir: str, rel_dir: str, side: int = 28) -> list[dict]:
    """`n` rows of `kind`, their images written as PNG files into `image_dir` (named in the rows as `rel_dir/...`)."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; use one of {sorted(KINDS)}")
    rng = np.random.default_rng(seed)
    os.makedirs(image_dir, exist_ok=True)
    names = list(COLOURS)
    rows = []
    for i in range(n):
        colour = names[int(rng.integers(len(names)))]
        count = 1 if kind == "colour" else int(rng.integers(1, MAX_COUNT + 1))
        file = f"{i:05d}.png"
        shape_image(rng, colour, count, side).save(os.path.join(image_dir, file))
        rows.append({"prompt": KINDS[kind], "label": colour if kind == "colour" else str(count),
                     "images": [f"{rel_dir}/{file}"], "metadata": {"rm_type": "exact"}})
    return rows


def write_shapes_task(out_dir: str, *, kind: str = "colour", n_train: int = 512, n_eval: int = 64, seed: int = 0,
                      side: int = 28) -> tuple[str, str]:
    """Write the train and held-out jsonl files (and their images) under `out_dir` once; returns their paths."""
    stem = f"{kind}-s{seed}-{side}px"
    paths = tuple(os.path.join(out_dir, f"{stem}-{split}{n}.jsonl")
                  for split, n in (("train", n_train), ("eval", n_eval)))
    if all(os.path.isfile(p) for p in paths):
        return paths
    for path, split, n, stream in zip(paths, ("train", "eval"), (n_train, n_eval), (0, 1)):
        rel = f"{stem}-{split}{n}-img"
        write_jsonl(make_shapes(n, kind, seed * 2 + stream, os.path.join(out_dir, rel), rel, side), path)
    return paths
