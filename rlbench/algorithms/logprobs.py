"""Per-token log-probs and entropy from logits, chunked so no full `[T, V]` fp32 tensor ever exists.

A 16k-token pack with a 152k vocabulary has 2.4 G logits: 5 GB in bf16, 10 GB per fp32 copy, and a naive
`log_softmax(logits.float() / T)` plus its backward holds several fp32 copies at once (slime issue #1951:
a 58 GiB allocation). Here a custom autograd Function saves only the input logits (in their own dtype) and
one fp32 log-sum-exp per row; forward and backward each walk the rows in chunks of `chunk_size`, so the
largest temporary is `[chunk_size, V]` fp32. The gradient is written straight into a tensor of the logits'
dtype.

Math, with z = logits / temperature, p = softmax(z), lse = logsumexp(z), H = -Σ p log p = lse - Σ p z:
    d logp[target] / dz_j = 1[j = target] - p_j
    d H / dz_j           = -p_j (log p_j + H)
and d/dlogits = (1 / temperature) d/dz.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK_SIZE = 256
"""Rows per chunk: 256 x 152k fp32 = 156 MB per temporary. On a 2-core CPU the 1024 x 152k forward + backward took
2.6 s in chunks of 512 rows and 0.96 s in chunks of 256 or 128 (temporaries that fit the memory the process keeps
hot); a GPU is saturated by either."""


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # bf16/fp16 logits are upcast per chunk; fp64 stays fp64 (tests, gradcheck).
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_forward(z, targets, with_entropy: bool, lse_fn=None):
    """Rows of tempered logits z `[C, V]` (modified in place) -> (lse [C], logp [C], entropy [C] | None)."""
    lse = torch.logsumexp(z, dim=-1) if lse_fn is None else lse_fn(z)  # [C]
    logp = z.gather(1, targets[:, None]).squeeze(1) - lse
    if not with_entropy:
        return lse, logp, None
    z.sub_(lse[:, None])  # z now holds log p
    return lse, logp, -(z.exp() * z).sum(-1)


def _chunk_grad(z, targets, lse, ent, g_logp, g_ent, inv_temp: float) -> torch.Tensor:
    """d(Σ g_logp·logp + g_ent·H)/d logits for one chunk, `[C, V]` in z's dtype; z is consumed.

    d(g_logp logp)/dz = g_logp (onehot − p);  d(g_ent H)/dz = −g_ent p (log p + H).
    """
    logp_all = z.sub_(lse[:, None])  # [C, V] log p
    p = logp_all.exp()  # [C, V]
    gl = g_logp[:, None].to(z.dtype) if g_logp is not None else None  # [C, 1]
    if g_ent is not None:
        coef = logp_all.add_(ent[:, None]).mul_(g_ent[:, None].to(z.dtype))  # [C, V]
        if gl is not None:
            coef.add_(gl)
    else:
        coef = gl if gl is not None else torch.zeros_like(lse[:, None])
    g = p.mul_(coef).neg_()  # [C, V]
    if gl is not None:
        g.scatter_add_(1, targets[:, None], gl)
    return g.mul_(inv_temp)


def _empty_outputs(T, cdt, device, with_entropy):
    logp = torch.empty(T, dtype=cdt, device=device)  # [T]
    lse = torch.empty(T, dtype=cdt, device=device)  # [T]
    ent = torch.empty(T, dtype=cdt, device=device) if with_entropy else None  # [T]
    return logp, lse, ent


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, inv_temp: float, chunk_size: int, with_entropy: bool, lse_fn=None,
                temperature: float = 1.0):
        T, cdt = logits.shape[0], _compute_dtype(logits.dtype)
        logp, lse, ent = _empty_outputs(T, cdt, logits.device, with_entropy)
        # With `lse_fn` (batch-invariant numerics): z = logits / T by a device tensor, as the engine's sampler.
        # Filled on the device: `torch.tensor(T, device=...)` copies from the host and waits for the stream.
        temp = torch.full((), temperature, dtype=cdt, device=logits.device) if lse_fn is not None else None
        for s in range(0, T, chunk_size):
            e = min(s + chunk_size, T)
            z = logits[s:e].to(cdt) * inv_temp if temp is None else logits[s:e].to(cdt) / temp  # [C, V]
            lse[s:e], logp[s:e], ent_c = _chunk_forward(z, targets[s:e], with_entropy, lse_fn)
            if ent is not None:
                ent[s:e] = ent_c
        ctx.inv_temp, ctx.chunk_size, ctx.with_entropy = inv_temp, chunk_size, with_entropy
        ctx.save_for_backward(logits, targets, lse, ent if ent is not None else lse)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, targets, lse, ent = ctx.saved_tensors
        g_ent = g_ent if ctx.with_entropy else None
        grad = torch.empty_like(logits)  # [T, V] in the logits' dtype
        for s in range(0, logits.shape[0], ctx.chunk_size):
            e = min(s + ctx.chunk_size, logits.shape[0])
            z = logits[s:e].to(lse.dtype) * ctx.inv_temp  # [C, V]
            g = _chunk_grad(z, targets[s:e], lse[s:e], ent[s:e], _rows(g_logp, s, e), _rows(g_ent, s, e), ctx.inv_temp)
            grad[s:e] = g.to(logits.dtype)
        return grad, None, None, None, None, None, None


def _rows(t, s, e):
    return None if t is None else t[s:e]


class _ChunkedLinearLogProbs(torch.autograd.Function):
    """Fused lm-head: logits = hidden @ weight.T are built one chunk at a time and never stored."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temp: float, chunk_size: int, with_entropy: bool):
        T, cdt = hidden.shape[0], _compute_dtype(hidden.dtype)
        logp, lse, ent = _empty_outputs(T, cdt, hidden.device, with_entropy)
        for s in range(0, T, chunk_size):
            e = min(s + chunk_size, T)
            z = (hidden[s:e] @ weight.T).to(cdt) * inv_temp  # [C, V]
            lse[s:e], logp[s:e], ent_c = _chunk_forward(z, targets[s:e], with_entropy)
            if ent is not None:
                ent[s:e] = ent_c
        ctx.inv_temp, ctx.chunk_size, ctx.with_entropy = inv_temp, chunk_size, with_entropy
        ctx.save_for_backward(hidden, weight, targets, lse, ent if ent is not None else lse)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        g_ent = g_ent if ctx.with_entropy else None
        g_hidden = torch.empty_like(hidden)  # [T, H]
        g_weight = torch.zeros_like(weight, dtype=lse.dtype)  # [V, H] accumulated in fp32
        for s in range(0, hidden.shape[0], ctx.chunk_size):
            e = min(s + ctx.chunk_size, hidden.shape[0])
            z = (hidden[s:e] @ weight.T).to(lse.dtype) * ctx.inv_temp  # [C, V]
            g = _chunk_grad(z, targets[s:e], lse[s:e], ent[s:e], _rows(g_logp, s, e), _rows(g_ent, s, e), ctx.inv_temp)
            g_hidden[s:e] = g.to(hidden.dtype) @ weight  # [C, H]
            g_weight.addmm_(g.T, hidden[s:e].to(lse.dtype))  # [V, H] += [V, C] @ [C, H]
        return g_hidden, g_weight.to(weight.dtype), None, None, None, None


def _check_options(temperature: float, chunk_size: int) -> None:
    """The options both entry points share: a positive temperature and a positive chunk size."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = True,
    lse_fn=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each target token and the entropy of the tempered distribution, row by row.

    Args:
        logits: `[T, V]` (bf16, fp16, fp32 or fp64); gradients flow back into it.
        targets: `[T]` long, the token whose log-prob row `t` gives (in position space: `tokens[t+1]`).
        temperature: the sampling temperature; both outputs use `softmax(logits / temperature)`.
        chunk_size: rows processed at once; peak extra memory is a few `[chunk_size, V]` fp32 tensors.
        with_entropy: also return the per-row entropy (differentiable).
        lse_fn: the per-row logsumexp `[C, V] -> [C]` (None: `torch.logsumexp`); given, the tempered logits are
            `logits / temperature` (the engine's order) instead of `logits * (1 / temperature)`. The true
            on-policy mode passes `rlbench.numerics.logsumexp_rows`, the engine sampler's own.
    Returns:
        `(logp [T], entropy [T] | None)` in fp32 (fp64 for fp64 logits).
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"expected logits [T, V] and targets [T], got {tuple(logits.shape)} and {tuple(targets.shape)}")
    _check_options(temperature, chunk_size)
    return _ChunkedLogProbs.apply(logits, targets.long(), 1.0 / temperature, int(chunk_size), bool(with_entropy),
                                  lse_fn, float(temperature))


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs(hidden @ weight.T, ...)` without ever storing the `[T, V]` logits (fused lm-head).

    Args:
        hidden: `[T, H]` final hidden states (after the last norm); weight: `[V, H]` lm-head weight.
        targets, temperature, chunk_size, with_entropy: as in `token_logprobs`.
    Returns:
        `(logp [T], entropy [T] | None)`; gradients flow into `hidden` and `weight`.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"expected hidden [T, H] and weight [V, H], got {tuple(hidden.shape)}, {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets {tuple(targets.shape)} must be [T={hidden.shape[0]}]")
    _check_options(temperature, chunk_size)
    return _ChunkedLinearLogProbs.apply(
        hidden, weight, targets.long(), 1.0 / temperature, int(chunk_size), bool(with_entropy)
    )
