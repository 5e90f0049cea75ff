"""The engine's prefill of prompts with images (Qwen2-VL / Qwen2.5-VL): the model's own vision encoder and M-RoPE.

A VLM's decoder is a plain text decoder whose RoPE takes three position rows (temporal, height, width:
"M-RoPE"). Text tokens have all three equal; an image's tokens get its patch grid's coordinates. After the prompt
every position is the cache index plus a per-sequence offset (`rope_delta`, the model's `rope_deltas`), so decode
only needs that offset per slot: `ModelRunner` adds it to the decode positions, and the decode step (compiled,
CUDA-graphed) stays the text decoder's.

At prefill (`image_prefill`): the prompt's images run through the model's vision tower (`get_image_features`), their
embeddings replace the embeddings of the image placeholder tokens in order (as the HF forward's `masked_scatter`),
and the 3-D positions and offsets come from the model's own `get_rope_index`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlbench.models.vlm import image_token_id, mrope_positions
from rlbench.types import ImageInputs


def text_model(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (`.layers`, `.embed_tokens`, `.norm`, `.rotary_emb`) of a causal LM or of a VLM."""
    base = getattr(model, "model", None)
    return getattr(base, "language_model", base)


def merge_image_embeddings(model, hidden: torch.Tensor, ids: torch.Tensor,
                           images: Sequence[ImageInputs | None]) -> torch.Tensor:
    """hidden `[B, T, D]` (the token embeddings of `ids` `[B, T]`) with each image placeholder's row replaced by the
    vision tower's embedding of its image patch, row by row in order; rows of `images` that are None keep theirs."""
    given = [im for im in images if im is not None]
    if not given:
        return hidden
    dev = hidden.device
    dtype = next(model.model.visual.parameters()).dtype
    pixels = torch.cat([im.pixel_values for im in given]).to(dev, dtype)
    grid = torch.cat([im.image_grid_thw for im in given]).to(dev)
    embeds = torch.cat(list(model.model.get_image_features(pixels, grid).pooler_output)).to(hidden.dtype)  # [N, D]
    rows = torch.tensor([im is not None for im in images], device=dev)[:, None]
    mask = (ids == image_token_id(model)) & rows  # [B, T]
    if int(mask.sum()) != embeds.shape[0]:
        raise ValueError(f"the prompts hold {int(mask.sum())} image tokens for {embeds.shape[0]} image embeddings; "
                         "build image prompts with the model's processor (rlbench.data.images.VisionProcessor)")
    return hidden.masked_scatter(mask[..., None], embeds)


@torch.inference_mode()
def image_prefill(model, hidden: torch.Tensor, ids: torch.Tensor, lengths: Sequence[int],
                  images: Sequence[ImageInputs | None]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """`(hidden [B, T, D], positions [3, B, T], rope deltas [B])` of a right-padded prefill batch `ids` `[B, T]`:
    image embeddings merged, M-RoPE positions per row (padding continues the row's last text position)."""
    hidden = merge_image_embeddings(model, hidden, ids, images)
    b, t = ids.shape
    pos = torch.empty(3, b, t, dtype=torch.long, device=ids.device)
    deltas = []
    for row, (n, im) in enumerate(zip(lengths, images)):
        p, delta = mrope_positions(model, ids[row, :n], im)
        pos[:, row, :n] = p
        pos[:, row, n:] = torch.arange(n, t, device=ids.device) + delta
        deltas.append(delta)
    return hidden, pos, deltas
