"""The two modules megatron-core's local spec lacks for rlbench's packs: a packed (THD) core attention, an RMSNorm.

Without TransformerEngine, megatron's own `DotProductAttention` rejects packed sequences, and its torch norm
rejects sequence parallelism. `CoreAttention` takes the THD tensors megatron's SelfAttention hands over (RoPE
already applied per sequence from `cu_seqlens`) and runs one causal, same-document attention over the whole
pack: SDPA with a block-diagonal mask, or compiled flex_attention over the document BlockMask FSDP uses (CUDA).
`RMSNorm` is Hugging Face Qwen3's formula (fp32 statistics, cast, then the weight), so both backends normalise
alike; it marks its weight `sequence_parallel` under SP, which makes `finalize_model_grads` sum its gradient
over the TP ranks (each holds only its slice of the sequence).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

_FLEX = None  # compiled flex_attention, built on first use
_MASKS: dict = {}  # one entry: the current pack's mask, shared by all layers of a forward


def _document_ids(cu_seqlens: torch.Tensor, t: int) -> torch.Tensor:
    """`[t]` long: the slot (sequence or pad) each token belongs to."""
    return torch.bucketize(torch.arange(t, device=cu_seqlens.device), cu_seqlens[1:].long(), right=True)


def _mask(kind: str, cu_seqlens: torch.Tensor, t: int):
    key = (kind, t, cu_seqlens.device)
    hit = _MASKS.get("key")
    if hit is not None and hit[0] == key and torch.equal(hit[1], cu_seqlens):
        return _MASKS["mask"]
    docs = _document_ids(cu_seqlens, t)
    if kind == "sdpa":
        idx = torch.arange(t, device=docs.device)
        mask = (docs[:, None] == docs[None, :]) & (idx[None, :] <= idx[:, None])  # [t, t] query x key
    else:
        from rlbench.backends.attention import document_block_mask

        positions = torch.arange(t, device=docs.device) - cu_seqlens.long()[docs]  # restart per slot
        mask = document_block_mask(positions)
    _MASKS.update(key=(key, cu_seqlens.clone()), mask=mask)
    return mask


class CoreAttention(MegatronModule):
    """Causal attention over packed sequences (THD) or a `[s, b]` batch, GQA by repeating KV heads."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **kwargs):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("rlbench's megatron core attention has no context parallelism (megatron's needs "
                             "TransformerEngine); use the FSDP backend for CP")
        self.scale = softmax_scale if softmax_scale is not None else config.kv_channels ** -0.5
        self.kind = getattr(config, "rlbench_attention", "sdpa")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by rlbench's megatron core attention")
        if packed_seq_params is None:  # [s, b, n, d] -> [s, b, n * d]
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, n, s, d]
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
            return out.permute(2, 0, 1, 3).flatten(2)
        # THD: query [t, np, d], key / value [t, ng, d] -> [t, np, d]
        t = query.shape[0]
        cu = packed_seq_params.cu_seqlens_q_padded
        cu = packed_seq_params.cu_seqlens_q if cu is None else cu
        q, k, v = (x.transpose(0, 1)[None] for x in (query, key, value))  # [1, n, t, d]
        if self.kind == "flex":
            global _FLEX
            if _FLEX is None:
                from torch.nn.attention.flex_attention import flex_attention

                _FLEX = torch.compile(flex_attention)
            out = _FLEX(q, k, v, block_mask=_mask("flex", cu, t), scale=self.scale, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=_mask("sdpa", cu, t), scale=self.scale,
                                                 enable_gqa=True)
        return out[0].transpose(0, 1)  # [t, np, d]


class RMSNorm(torch.nn.Module):
    """Hugging Face's Qwen3 RMSNorm; the weight is marked `sequence_parallel` under SP (hidden-size norms only)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **kwargs):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # q/k norms (head_dim wide) act on each rank's own heads: their grads are summed by finalize_model_grads
        # through `config.qk_layernorm`, not through this flag
        self.weight.sequence_parallel = bool(config.sequence_parallel) and hidden_size == config.hidden_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
