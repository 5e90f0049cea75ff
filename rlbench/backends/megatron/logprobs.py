"""Log-probs and entropy of vocab-parallel logits (each TP rank holds `[T, V/tp]`) at the sampling temperature.

The full-vocabulary softmax is never formed: per chunk of rows, each rank reduces its slice (max, sum of exp, the
target's logit where it owns it, Σ p·z) and three all-reduces over the TP group finish the statistics, as
megatron's `vocab_parallel_cross_entropy` does. Backward is local: every rank gets the gradient of its own
vocabulary slice, and the output layer's backward sums the input gradients over the TP ranks. At TP 1 the
backend uses `rlbench.algorithms.logprobs.token_logprobs`, FSDP's own kernel.

With z = logits / temperature, p = softmax(z): d logp[target]/dz = onehot − p, dH/dz = −p (log p + H).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlbench.algorithms.logprobs import DEFAULT_CHUNK_SIZE


def _stats(z, targets, start: int, group, with_entropy: bool):
    """(lse [C], logp [C], entropy [C] | None) of one chunk of tempered vocab-slice logits `z` [C, V/tp]."""
    vmax = z.max(-1).values
    dist.all_reduce(vmax, op=dist.ReduceOp.MAX, group=group)
    sumexp = (z - vmax[:, None]).exp().sum(-1)
    local = targets - start
    owned = (local >= 0) & (local < z.shape[1])
    picked = z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None]).squeeze(1) * owned
    dist.all_reduce(sumexp, group=group)
    dist.all_reduce(picked, group=group)
    lse = vmax + sumexp.log()
    if not with_entropy:
        return lse, picked - lse, None
    pz = ((z - lse[:, None]).exp() * z).sum(-1)
    dist.all_reduce(pz, group=group)
    return lse, picked - lse, lse - pz


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, inv_temp: float, chunk: int, with_entropy: bool, start: int, group):
        T = logits.shape[0]
        lse, logp = (torch.empty(T, dtype=torch.float32, device=logits.device) for _ in range(2))
        ent = torch.empty(T, dtype=torch.float32, device=logits.device) if with_entropy else None
        for s in range(0, T, chunk):
            e = min(s + chunk, T)
            out = _stats(logits[s:e].float() * inv_temp, targets[s:e], start, group, with_entropy)
            lse[s:e], logp[s:e] = out[0], out[1]
            if ent is not None:
                ent[s:e] = out[2]
        ctx.args = (inv_temp, chunk, start)
        ctx.save_for_backward(logits, targets, lse, ent if ent is not None else lse)
        ctx.with_entropy = with_entropy
        return (logp, ent) if with_entropy else (logp, None)

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, targets, lse, ent = ctx.saved_tensors
        inv_temp, chunk, start = ctx.args
        grad = torch.empty_like(logits)
        V = logits.shape[1]
        for s in range(0, logits.shape[0], chunk):
            e = min(s + chunk, logits.shape[0])
            z = logits[s:e].float() * inv_temp
            logp_all = z - lse[s:e, None]
            p = logp_all.exp()
            coef = torch.zeros_like(lse[s:e, None]) if g_logp is None else g_logp[s:e, None].float()
            if ctx.with_entropy and g_ent is not None:
                coef = coef + g_ent[s:e, None].float() * (logp_all + ent[s:e, None])
            g = -p * coef
            if g_logp is not None:
                local = targets[s:e] - start
                owned = (local >= 0) & (local < V)
                rows = torch.nonzero(owned).squeeze(1)
                g[rows, local[rows]] += g_logp[s:e][rows].float()
            grad[s:e] = (g * inv_temp).to(grad.dtype)
        return grad, None, None, None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float, *, group,
                            chunk_size: int = DEFAULT_CHUNK_SIZE, with_entropy: bool = False):
    """`(logp [T], entropy [T] | None)` fp32 of the full-vocabulary `softmax(logits / temperature)`.

    Args:
        logits: `[T, V/tp]`, this rank's vocabulary slice (rank r holds ids `[r·V/tp, (r+1)·V/tp)`).
        targets: `[T]` long, full-vocabulary ids.
        group: the tensor-parallel process group.
    """
    start = dist.get_rank(group) * logits.shape[1]
    logp, ent = _VocabParallelLogProbs.apply(logits, targets, 1.0 / temperature, chunk_size, with_entropy, start,
                                            group)
    return logp, ent
