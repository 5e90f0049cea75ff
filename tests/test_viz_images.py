"""`rlbench.viz.image_rollouts`: images inlined as base64 PNG next to the escaped prompt, label and responses."""

from __future__ import annotations

import base64
import io
import re

import pytest

pytest.importorskip("PIL")
pytest.importorskip("ipywidgets")
from PIL import Image  # noqa: E402

from rlbench.types import ImageInputs, Sample  # noqa: E402
from rlbench.viz.image_rollouts import image_rollouts_html, image_rows  # noqa: E402


def _png(colour, side=28) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), colour).save(buf, format="PNG")
    return buf.getvalue()


def test_one_img_per_image_inlined_and_text_escaped(tmp_path):
    (tmp_path / "red.png").write_bytes(_png((255, 0, 0)))
    rows = [{"images": ["red.png", Image.new("RGB", (8, 8), (0, 0, 255))], "prompt": "<b>colour?</b>",
             "label": "red", "responses": ["red", "<script>x</script>"], "rewards": [1.0, 0.0]},
            {"images": [_png((0, 255, 0))], "prompt": "a & b", "label": "green", "responses": ["green"],
             "rewards": [1.0]}]
    out = image_rollouts_html(rows, base_dir=str(tmp_path))
    srcs = re.findall(r"<img src='data:image/png;base64,([A-Za-z0-9+/=]+)'", out)
    assert len(srcs) == out.count("<img") == 3
    first = Image.open(io.BytesIO(base64.b64decode(srcs[0])))
    assert first.format == "PNG" and first.size == (28, 28) and first.getpixel((3, 3)) == (255, 0, 0)
    assert Image.open(io.BytesIO(base64.b64decode(srcs[1]))).getpixel((0, 0)) == (0, 0, 255)
    assert "<script>" not in out and "&lt;script&gt;" in out
    assert "&lt;b&gt;colour?&lt;/b&gt;" in out and "a &amp; b" in out
    assert out.count("<b>1</b>") == 2 and out.count("<b>0</b>") == 1


def test_rows_from_samples_group_by_prompt(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(_png((255, 0, 0)))
    im = ImageInputs(pixel_values=None, image_grid_thw=None, sources=["img/a.png", "base64"])
    samples = [Sample(tokens=[1], response_length=1, group_index=g, prompt=f"p{g}", label="red", response=r,
                      reward=w, images=im) for g, r, w in [(0, "red", 1.0), (0, "blue", 0.0), (1, "red", 1.0)]]
    rows = image_rows(samples, base_dir=str(tmp_path))
    assert [(r["prompt"], r["responses"], r["rewards"]) for r in rows] == [("p0", ["red", "blue"], [1.0, 0.0]),
                                                                           ("p1", ["red"], [1.0])]
    assert rows[0]["images"] == [str(tmp_path / "img" / "a.png")]  # inline images are not kept by a Sample
    assert image_rollouts_html(rows).count("<img") == 2
    with pytest.raises(TypeError, match="an image must be a PIL image, image-file bytes or a path, got int"):
        image_rollouts_html([{"images": [3]}])
