"""A vision-language model's packed training inputs: the pack's images and M-RoPE positions.

A packed micro-batch of a Qwen2-VL/2.5-VL model carries, besides its tokens, each sample's images (`Pack.images`)
and 4-row position ids `[4, 1, T]`: row 0 the text positions restarting per sample (transformers builds the
per-document causal mask from it, so packed samples stay apart), rows 1-3 the M-RoPE (temporal, height, width)
positions each sample's prompt gets from the model's own `get_rope_index` (text-only samples: their text positions
in every row). The images' pixel values are concatenated in pack order, the order of their placeholder tokens, which
is how the HF forward scatters the vision tower's embeddings.
"""

from __future__ import annotations

import torch

from rlbench.models.vlm import mrope_positions


def pack_vision_inputs(model, pack, tokens: torch.Tensor, positions: torch.Tensor) -> dict:
    """Model kwargs of one VLM pack on the device of `tokens` `[T]` / `positions` `[T]` (the pack's text positions):
    `position_ids [4, 1, T]`, and `pixel_values` / `image_grid_thw` when a sample has images."""
    rows = positions.expand(3, -1).clone()  # [3, T]
    bounds = pack.cu_seqlens.tolist()
    images = pack.images or [None] * pack.num_sequences
    for start, end, n, im in zip(bounds[:-1], bounds[1:], pack.seq_lengths.tolist(), images):
        if im is None:
            continue
        pos, delta = mrope_positions(model, tokens[start : start + n], im)
        rows[:, start : start + n] = pos
        rows[:, start + n : end] = torch.arange(n, end - start, device=rows.device) + delta  # alignment pads
    out = {"position_ids": torch.cat([positions[None], rows])[:, None]}  # [4, 1, T]
    given = [im for im in images if im is not None]
    if given:
        out["pixel_values"] = torch.cat([im.pixel_values for im in given]).to(tokens.device)
        out["image_grid_thw"] = torch.cat([im.image_grid_thw for im in given]).to(tokens.device)
    return out
