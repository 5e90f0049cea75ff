"""Attention masks for packed micro-batches.

sdpa / eager: transformers builds a per-document causal mask from `position_ids` when no attention mask
and no KV cache are given (`use_cache=False`); nothing to do here. flex_attention: we build the
document-causal `BlockMask` ourselves from the pack's position ids and pass it as `attention_mask`
(transformers forwards a ready 4-D BlockMask untouched, in every 5.x version we support). Fully masked
128x128 blocks (other documents) are skipped by the kernel, so attention costs O(Σ len_i²), not O(T²).
"""

from __future__ import annotations

import torch


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """`[T]` long: index of the sequence each token belongs to (a new one wherever positions do not step by 1)."""
    step = torch.diff(position_ids, prepend=position_ids[:1] - 1)  # [T]
    return (step != 1).cumsum(0)


def document_block_mask(position_ids: torch.Tensor):
    """Causal, same-document `BlockMask` of shape `[1, 1, T, T]` for one packed micro-batch.

    Args:
        position_ids: `[T]` on the compute device; positions restart (or jump) at document boundaries.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    docs = document_ids(position_ids)  # [T]
    T = docs.numel()

    def mask_mod(b, h, q, kv):
        return (docs[q] == docs[kv]) & (kv <= q)

    # `_compile=True` (as transformers does) builds the mask with a compiled kernel: ms instead of s at 16k.
    return create_block_mask(
        mask_mod, B=1, H=None, Q_LEN=T, KV_LEN=T, device=position_ids.device, _compile=position_ids.is_cuda
    )
