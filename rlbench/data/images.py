"""Prompt rows with images, for a vision-language model (Qwen2-VL / Qwen2.5-VL layout).

    proc = VisionProcessor.load(model_dir)                      # None for a text-only model directory
    ids, images = proc.encode(messages, ["cat.png"], base_dir)  # token ids with expanded image tokens, ImageInputs

A row names its images under `DataConfig.image_key` (default "images"): a list of file paths (relative to the
data file's folder, or absolute) or base64 strings (`data:image/png;base64,...` or bare base64). They are opened
with PIL and converted to RGB; the model's image processor (its `preprocessor_config.json`) turns them into patches
(`pixel_values`, `image_grid_thw`). The chat template renders each image as one `<|image_pad|>` (Qwen's templates
do), which is expanded here to one token per merged patch: `prod(grid_thw) // merge_size**2`, what transformers'
Qwen2.5-VL processor does (its own class also needs a video processor, which needs torchvision).

A str prompt becomes one user message whose content is the images, then the text; a message-list prompt keeps its
own `{"type": "image"}` parts, which must be as many as the row's images.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from dataclasses import dataclass
from typing import Any

from rlbench.types import ImageInputs

IMAGE_TOKEN = "<|image_pad|>"
"""The placeholder a Qwen-VL chat template writes per image (expanded to the image's patch count)."""


def _pil():
    try:
        from PIL import Image
    except ImportError as exc:  # optional extra: only image data needs it
        raise ImportError("image prompts need Pillow: pip install 'rlbench[vision]' (or pip install pillow)") from exc
    return Image


def load_image(spec: Any, base_dir: str, where: str):
    """One image of a row as an RGB PIL image: a path (relative to `base_dir`) or a base64 string.

    Raises ValueError naming `where` (file:line) and the image: not a string, a missing file, undecodable base64,
    or bytes PIL cannot read."""
    image = _pil()
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{where}: image {spec!r} must be a file path or a base64 string")
    data, name = None, spec
    if spec.startswith("data:"):
        data, name = spec.partition(",")[2], "base64 image"
    else:
        path = spec if os.path.isabs(spec) else os.path.join(base_dir, spec)
        if not os.path.isfile(path):
            if len(spec) < 64 or "." in spec[-5:]:  # a path, not inline data
                raise ValueError(f"{where}: image file {path!r} does not exist; fix the path (relative paths are "
                                 "read from the data file's folder)")
            data, name = spec, "base64 image"
        else:
            name = path
    try:
        if data is not None:
            raw = io.BytesIO(base64.b64decode(data, validate=True))
        else:
            raw = path
        with image.open(raw) as img:
            return img.convert("RGB")
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{where}: {name} is not valid base64 ({exc})") from None
    except OSError as exc:  # PIL.UnidentifiedImageError is an OSError
        raise ValueError(f"{where}: {name} is not a readable image ({type(exc).__name__}: {exc}); replace it") from None


def image_messages(prompt: Any, n_images: int, where: str) -> list[dict]:
    """Chat messages of a row's prompt with its `n_images` images (see the module docstring)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": prompt}]}]
    if not (isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt)):
        raise ValueError(f"{where}: prompt must be a string or a list of chat messages, got {prompt!r}")
    parts = sum(1 for m in prompt if isinstance(m.get("content"), list)
                for c in m["content"] if isinstance(c, dict) and c.get("type") == "image")
    if parts != n_images:
        raise ValueError(f"{where}: the messages hold {parts} image parts ({{'type': 'image'}}) for {n_images} "
                         "images; give one image part per image")
    return prompt


@dataclass
class VisionProcessor:
    """A VLM's image processor and tokenizer: chat messages + images -> token ids and `ImageInputs`."""

    image_processor: Any
    """transformers' Qwen2-VL image processor (`merge_size`, `__call__(images=...)`)."""
    tokenizer: Any
    """The model's tokenizer, with `IMAGE_TOKEN` and a chat template that renders image parts."""

    @classmethod
    def load(cls, path: str, tokenizer) -> VisionProcessor | None:
        """The processor of a model directory with a `preprocessor_config.json`; None without one."""
        if not os.path.isfile(os.path.join(path, "preprocessor_config.json")):
            return None
        from transformers import AutoImageProcessor

        return cls(AutoImageProcessor.from_pretrained(path), tokenizer)

    @property
    def image_token_id(self) -> int:
        return int(self.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))

    def encode(self, messages: list[dict], specs: list, base_dir: str, where: str) -> tuple[str, list[int],
                                                                                           ImageInputs]:
        """`(text, token ids, images)` of one prompt: the chat template's text with each `IMAGE_TOKEN` expanded."""
        images = [load_image(s, base_dir, f"{where}: image {i}") for i, s in enumerate(specs)]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if text.count(IMAGE_TOKEN) != len(images):
            raise ValueError(f"{where}: the chat template wrote {text.count(IMAGE_TOKEN)} {IMAGE_TOKEN} for "
                             f"{len(images)} images; use the VLM's own tokenizer and chat template")
        out = self.image_processor(images=images, return_tensors="pt")
        grid = out["image_grid_thw"]
        merge = int(self.image_processor.merge_size) ** 2
        pieces = text.split(IMAGE_TOKEN)
        expanded = pieces[0] + "".join(IMAGE_TOKEN * (int(g.prod()) // merge) + rest
                                       for g, rest in zip(grid, pieces[1:]))
        ids = self.tokenizer(expanded, add_special_tokens=False)["input_ids"]
        sources = [s if not s.startswith("data:") and len(s) < 512 else "base64" for s in specs]
        return text, ids, ImageInputs(out["pixel_values"], grid, sources)


def tiny_image_processor(patch_size: int = 7, merge_size: int = 2, max_side: int = 56):
    """A Qwen2-VL image processor for tiny CPU VLMs: `patch_size` pixels a patch, images resized to at most
    `max_side` x `max_side` (a 28 x 28 image with patch 7 is a 4 x 4 grid: 4 tokens after the 2 x 2 merge)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    side = patch_size * merge_size
    return Qwen2VLImageProcessorPil(patch_size=patch_size, merge_size=merge_size, temporal_patch_size=2,
                                    min_pixels=side * side, max_pixels=max_side * max_side)
