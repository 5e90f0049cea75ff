"""Batch-invariant numerics: the ops the true on-policy mode runs in both the engine and the trainer.

    from rlbench.numerics import make_batch_invariant, self_test
    make_batch_invariant(model)      # every Linear, RMSNorm, SiLU and the attention, in place
    self_test(device, dtype)         # raises, naming the op, if bitwise invariance fails on this machine
    torch.compile(layer, options=compile_options())   # compiled elementwise code with eager's rounding

`ops` holds the ops (Triton on CUDA, `torch_ops` on the CPU), `layout` the query/key tiling they share.
docs/true_on_policy.md describes the mode and what it costs.
"""

from rlbench.numerics.check import columns_invariant, compile_options, self_test
from rlbench.numerics.model import ATTN_NAME, extend_tiles, forward_tiles, kv_attention, make_batch_invariant
from rlbench.numerics.ops import logsumexp_rows

__all__ = ["ATTN_NAME", "columns_invariant", "compile_options", "extend_tiles", "forward_tiles", "kv_attention",
           "logsumexp_rows", "make_batch_invariant", "self_test"]
