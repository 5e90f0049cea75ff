"""Images with their prompts and rollouts as one HTML table (a vision-language model's samples, for notebooks).

    rows = image_rows(trainer.last_rollout.samples, base_dir="runs/data/shapes")
    display(HTML(image_rollouts_html(rows)))

A row is plain data, `{"images": [...], "prompt": str, "label": ..., "responses": [str], "rewards": [float]}`; an
image is a PIL image, the bytes of an image file, or a file path (relative paths resolved against `base_dir`). Each
image is inlined as a base64 PNG (`<img src="data:image/png;base64,...">`), so the HTML stands alone; all text is
escaped.
"""

from __future__ import annotations

import base64
import html
import io
import os
from collections.abc import Sequence
from typing import Any

REWARD_COLOURS = ("hsl(0, 75%, 88%)", "hsl(120, 55%, 82%)")
"""Background of a response with reward <= 0 and > 0."""


def png_base64(image: Any, base_dir: str = ".") -> str:
    """The base64 text of `image` (a PIL image, image-file bytes or a path) re-encoded as PNG."""
    from PIL import Image

    if isinstance(image, (str, os.PathLike)):
        image = Image.open(os.path.join(base_dir, os.fspath(image)))
    elif isinstance(image, (bytes, bytearray)):
        image = Image.open(io.BytesIO(image))
    elif not isinstance(image, Image.Image):
        raise TypeError(f"an image must be a PIL image, image-file bytes or a path, got {type(image).__name__}")
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def image_rows(samples: Sequence[Any], base_dir: str = ".") -> list[dict]:
    """One row per prompt group of `samples` (rlbench `Sample`s with `images`, in group order): the images their
    data row named (`images.sources`; inline base64 images are not kept by the Sample and are left out), the
    prompt, the label and every sample's response and reward."""
    rows: dict[int, dict] = {}
    for s in samples:
        row = rows.get(s.group_index)
        if row is None:
            sources = s.images.sources if s.images is not None else []
            row = rows[s.group_index] = {
                "images": [os.path.join(base_dir, p) for p in sources if p != "base64"],
                "prompt": s.prompt if isinstance(s.prompt, str) else str(s.prompt),
                "label": s.label, "responses": [], "rewards": []}
        row["responses"].append(s.response)
        row["rewards"].append(float(s.reward) if s.reward is not None else float("nan"))
    return list(rows.values())


def _responses_html(responses: Sequence[str], rewards: Sequence[float]) -> str:
    cells = []
    for text, reward in zip(responses, rewards):
        colour = REWARD_COLOURS[reward > 0]
        cells.append(f"<span style='background:{colour};padding:1px 4px;margin:1px;display:inline-block;"
                     f"font-family:monospace'>{html.escape(repr(text))} <b>{reward:g}</b></span>")
    return " ".join(cells)


def image_rollouts_html(rows: Sequence[dict], base_dir: str = ".", size: int = 84) -> str:
    """An HTML table, one line per row: its images (`size` pixels wide, pixelated), the prompt, the label and the
    responses each with its reward (green background when > 0). Missing keys render empty."""
    lines = ["<table style='border-collapse:collapse'>",
             "<tr><th>image</th><th>prompt</th><th>label</th><th>responses (reward)</th></tr>"]
    for row in rows:
        imgs = "".join(f"<img src='data:image/png;base64,{png_base64(im, base_dir)}' width='{size}' "
                       "style='image-rendering:pixelated;border:1px solid #ccc;margin:1px'>"
                       for im in row.get("images", []))
        prompt = html.escape(str(row.get("prompt", ""))).replace("\n", "↵<br>")
        label = html.escape(str(row.get("label", "")))
        responses = _responses_html(row.get("responses", []), row.get("rewards", []))
        lines.append(f"<tr style='border-top:1px solid #ddd'><td>{imgs}</td><td style='font-family:monospace;"
                     f"font-size:80%'>{prompt}</td><td>{label}</td><td>{responses}</td></tr>")
    lines.append("</table>")
    return "\n".join(lines)
