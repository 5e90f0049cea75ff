"""Attention backends and masks for packed micro-batches.

sdpa / eager: transformers builds a per-document causal mask from `position_ids` when no attention mask
and no KV cache are given (`use_cache=False`); nothing to do here. flash_attention_2/3: transformers sees
restarting position ids in a `[1, T]` batch and calls the varlen kernel with `cu_seqlens` taken from them
(tests/test_packing_attention.py checks isolation for every backend). flex_attention: we build the
document-causal `BlockMask` ourselves from the pack's position ids and pass it as `attention_mask`
(transformers forwards a ready 4-D BlockMask untouched, in every 5.x version we support). Fully masked
128x128 blocks (other documents) are skipped by the kernel, so attention costs O(Σ len_i²), not O(T²).

The block structure is computed directly from per-block document ranges (O((T/128)²) small tensor ops,
no `torch.compile`): `create_block_mask(_compile=True)` compiled a mask kernel on every new `T`, and its
cold compile can take minutes at some lengths (pytorch/pytorch#182060).
"""

from __future__ import annotations

import torch

BLOCK = 128  # flex_attention's default (and only tuned) block size
TYPE_MASK_ATTENTIONS = ("sdpa", "eager", "flex_attention")
"""Attention implementations `layer_type_masks` builds masks for (flash attention reads the position ids)."""


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """`[T]` long: index of the sequence each token belongs to (a new one wherever positions do not step by 1)."""
    step = torch.diff(position_ids, prepend=position_ids[:1] - 1)  # [T]
    return (step != 1).cumsum(0)


def document_block_tables(docs: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """`(partial [nb, nb], full [nb, nb])` bool block tables of the document-causal mask, nb = ceil(T / block).

    A block (q-block i, kv-block j) is *full* when every query may see every key (j < i, one document, a
    complete q block) and *partial* when some but not all pairs are allowed (evaluated by `mask_mod`).
    `docs` is non-decreasing, so block i spans documents [docs[i*block], docs[last of block i]].
    """
    T = docs.numel()
    starts = torch.arange(0, T, block, device=docs.device)  # [nb]
    first = docs[starts]  # [nb] document of each block's first token
    last = docs[torch.clamp(starts + block - 1, max=T - 1)]  # [nb] ... and of its last token
    i, j = first[:, None], last[None, :]  # q-block first doc [nb, 1], kv-block last doc [1, nb]
    below = torch.ones(len(starts), len(starts), dtype=torch.bool, device=docs.device).tril()  # j <= i
    any_allowed = below & (j >= i)  # kv block reaches the q block's first document
    complete = (starts + block <= T)[:, None]  # [nb, 1]
    one_doc = (first == last)[:, None] & (first == last)[None, :] & (first[:, None] == first[None, :])
    full = below.tril(-1) & one_doc & complete
    return any_allowed & ~full, full


def _ordered(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(num [1, 1, nb] int32, indices [1, 1, nb, nb] int32)`: per row, the True columns first, ascending."""
    num = table.sum(-1, dtype=torch.int32)
    idx = torch.argsort(table.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num[None, None], idx[None, None]


def document_block_mask(position_ids: torch.Tensor, window: int | None = None):
    """Causal, same-document `BlockMask` of shape `[1, 1, T, T]` for one packed micro-batch.

    Args:
        position_ids: `[T]` on the compute device; positions restart (or jump) at document boundaries.
        window: a sliding window (keys `(q - window, q]`); its blocks are all evaluated by `mask_mod` (none is
            taken as full), the blocks it cuts away are still visited.
    """
    from torch.nn.attention.flex_attention import BlockMask

    docs = document_ids(position_ids)  # [T]
    T = docs.numel()

    def mask_mod(b, h, q, kv):
        return (docs[q] == docs[kv]) & (kv <= q)

    def window_mod(b, h, q, kv):
        return (docs[q] == docs[kv]) & (kv <= q) & (kv > q - window)

    partial, full = document_block_tables(docs)
    if window is not None:
        partial, full, mask_mod = partial | full, torch.zeros_like(full), window_mod
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(T, T)
    )


def layer_type_masks(position_ids: torch.Tensor, windows: dict[str, int | None], attention: str,
                     dtype: torch.dtype) -> dict:
    """The packed micro-batch's document-causal mask per layer type (`config.layer_types` value -> its sliding
    window or None), passed as the forward's `attention_mask` dict. Models with per-layer-type masks take it as it
    is: some (gpt-oss) build their own masks without the position ids, which lets packed samples see each other.

    Masks are `[1, 1, T, T]`: bool for sdpa, additive (0 / dtype's min) for eager, a `BlockMask` for
    flex_attention. `position_ids`: `[T]` on the compute device.
    """
    if attention == "flex_attention":
        return {kind: document_block_mask(position_ids, w) for kind, w in windows.items()}
    if attention not in TYPE_MASK_ATTENTIONS:
        raise ValueError(f"per-layer-type packed masks for attn_implementation={attention!r}: only sdpa, eager and "
                         "flex_attention are supported; use one of them")
    docs = document_ids(position_ids)
    idx = torch.arange(docs.numel(), device=docs.device)
    same = (docs[:, None] == docs[None, :]) & (idx[None, :] <= idx[:, None])  # [T, T] query x key
    out = {}
    for kind, w in windows.items():
        visible = same if w is None else same & (idx[None, :] > idx[:, None] - w)
        if attention == "eager":
            visible = torch.zeros(visible.shape, dtype=dtype, device=docs.device).masked_fill(
                ~visible, torch.finfo(dtype).min)
        out[kind] = visible[None, None]
    return out


def packed_attention_mask(position_ids: torch.Tensor, attention: str, feats, dtype: torch.dtype):
    """The `attention_mask` of a packed training forward (`[1, T]` tokens, `position_ids` `[T]` on the device) of a
    model with `feats` (`models.capabilities.Features`), or None where transformers builds the right one from the
    position ids.

    - per-layer-type sliding windows (Gemma2/3, gpt-oss): `layer_type_masks` (gpt-oss builds its own masks
      without the position ids, so packed samples would see each other);
    - flex_attention on CUDA: our document `BlockMask`, unless the model slides (ours has no window; transformers
      builds the windowed ones). On CPU (inductor's CPU flex template fails to compile a captured-tensor
      mask_mod) transformers builds the BlockMask from the position ids itself.
    """
    if feats is not None and feats.type_windows and attention in TYPE_MASK_ATTENTIONS:
        return layer_type_masks(position_ids, feats.type_windows, attention, dtype)
    sliding = feats is not None and any(feats.windows)
    if attention == "flex_attention" and position_ids.is_cuda and not sliding:
        return document_block_mask(position_ids)
    return None
