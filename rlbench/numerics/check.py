"""The start-up self-test of the batch-invariant ops: a few rows through each op in differently shaped calls,
compared bit for bit. Exactness rests on the BLAS/Triton kernels giving one result per call shape, which
nothing guarantees on every machine and torch version; this says so at start-up, naming the op."""

from __future__ import annotations

import torch

from rlbench.numerics import ops
from rlbench.numerics.layout import decode_tiles, document_tiles

_passed: set[tuple[str, torch.dtype, bool]] = set()

EAGER_ROUNDING = {
    "emulate_precision_casts": True,  # round every intermediate to its eager dtype (bf16 x bf16 -> bf16, ...)
    "eager_numerics.division_rounding": True,  # x / y correctly rounded (Triton's `/` is approximate)
    "eager_numerics.disable_ftz": True,  # subnormals kept, as eager CUDA kernels keep them
    "eager_numerics.use_pytorch_libdevice": True,  # the toolkit's transcendental functions, as eager's
}
"""Inductor settings under which compiled elementwise code gives eager's bits (those of this torch version)."""


def compile_options() -> dict:
    """`torch.compile(options=...)` for layers in the batch-invariant mode: `EAGER_ROUNDING`, the settings this
    torch version has. The batch-invariant ops themselves are custom ops, opaque to inductor (`ops`)."""
    from torch._inductor import config

    known = config.get_config_copy()
    return {k: v for k, v in EAGER_ROUNDING.items() if k in known}


def _fail(op: str, device: torch.device, dtype: torch.dtype, what: str) -> None:
    raise RuntimeError(
        f"batch-invariant {op} is not bitwise invariant on this machine ({device}, {dtype}, torch "
        f"{torch.__version__}): {what}. True on-policy mode cannot hold here; report it with this message, "
        "or run without true_on_policy_mode (TIS/MIS correct the mismatch instead)"
    )


def self_test(device: torch.device | str, dtype: torch.dtype, head_dim: int = 64, group: int = 2,
              compiled: bool = False) -> None:
    """Raise `RuntimeError` naming the first op whose rows change with the batch; once per (device, dtype).
    `compiled`: also that inductor, with `compile_options`, gives the elementwise code of a decoder layer (RoPE,
    residual adds, the gate x up product around the opaque ops) eager's bits."""
    device = torch.device(device)
    if (device.type, dtype, compiled) in _passed:
        return
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    x, w, bias = rand(37, 96), rand(80, 96), rand(80)
    full = ops.linear(x, w, bias)
    for rows in ([0], [3, 4], list(range(5, 22))):
        if not torch.equal(ops.linear(x[rows], w, bias), full[rows]):
            _fail("linear", device, dtype, f"rows {rows[:3]}... differ between a {len(rows)}-row and a 37-row call")
    norm_w = rand(96)
    normed = ops.rms_norm(x, norm_w, 1e-6)
    if not torch.equal(ops.rms_norm(x[:1], norm_w, 1e-6), normed[:1]):
        _fail("rms_norm", device, dtype, "row 0 differs between a 1-row and a 37-row call")
    z = torch.randn(9, 3000, generator=gen).to(device) * 4
    if not torch.equal(ops.logsumexp_rows(z[2:3]), ops.logsumexp_rows(z)[2:3]):
        _fail("logsumexp_rows", device, dtype, "row 2 differs between a 1-row and a 9-row call")
    _check_attention(device, dtype, head_dim, group, rand)
    if compiled:
        _check_compiled(device, dtype, rand)
    _passed.add((device.type, dtype, compiled))


_columns: dict[tuple[str, torch.dtype], bool] = {}


def columns_invariant(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether `ops.linear` over stacked weights gives each block of columns the bits of that block's own GEMM on
    this machine (then the engine may fuse QKV and gate/up in the mode: the Triton GEMM's tiles reduce every
    column alike; BLAS promises nothing). Checked once per (device, dtype)."""
    device = torch.device(device)
    key = (device.type, dtype)
    if key not in _columns:
        gen = torch.Generator(device="cpu").manual_seed(1)
        ws = [torch.randn(n, 96, generator=gen).to(device, dtype) for n in (80, 48, 48)]
        ok = True
        for m in (1, 37, 64):
            x = torch.randn(m, 96, generator=gen).to(device, dtype)
            ok &= torch.equal(ops.linear(x, torch.cat(ws)), torch.cat([ops.linear(x, w) for w in ws], dim=-1))
        _columns[key] = bool(ok)
    return _columns[key]


def _layer_elementwise(x, w, cos, sin, up):
    """A decoder layer's elementwise code between the batch-invariant ops, in HF's order."""
    h = ops.linear(x, w)
    half = h.shape[-1] // 2
    rotated = torch.cat((-h[..., half:], h[..., :half]), dim=-1)
    h = (h * cos) + (rotated * sin)  # RoPE
    h = x + ops.rms_norm(h, up, 1e-6)  # residual
    return ops.silu(h) * (h * up) / 3  # gate x up, and a division


def _head_log_probs(logits, temperature, tokens):
    """The engine head's log-probs: logits over a per-row temperature, the sampled token's entry minus the
    batch-invariant logsumexp (the trainer computes the same with a scalar temperature, eagerly)."""
    scaled = logits.float() / temperature[:, None]
    return scaled.gather(1, tokens[:, None])[:, 0] - ops.logsumexp_rows(scaled)


def _check_compiled(device, dtype, rand) -> None:
    x, w, cos, sin, up = rand(33, 96), rand(96, 96), rand(33, 96), rand(33, 96), rand(96)
    eager = _layer_elementwise(x, w, cos, sin, up)
    fn = torch.compile(_layer_elementwise, dynamic=False, options=compile_options())
    if not torch.equal(fn(x, w, cos, sin, up), eager):
        _fail("compiled elementwise code (torch.compile)", device, dtype,
              "inductor's fused RoPE / residual / product rounds unlike eager; turn compile off (engine.compile=False, "
              "backend.fsdp.compile=False)")
    rows = 64  # enough rows that a logsumexp compiled by inductor (not the opaque op) shows in a few of them
    logits, temperature = rand(rows, 4099) * 4, torch.full((rows,), 0.7, device=device)
    tokens = torch.arange(rows, device=device) * 61
    trainer = torch.stack([_head_log_probs(logits[i:i + 1], temperature[:1], tokens[i:i + 1])[0] for i in range(rows)])
    head = torch.compile(_head_log_probs, dynamic=False, options=compile_options())
    if not torch.equal(head(logits, temperature, tokens), trainer):
        _fail("compiled sampling head (torch.compile)", device, dtype,
              "inductor's temperature division / log-prob rounds unlike eager; turn the engine's compile off "
              "(engine.compile=False)")


def _check_attention(device, dtype, head_dim: int, group: int, rand) -> None:
    """A 40-token sequence packed after a 7-token one vs the same tokens decoded one at a time from a cache."""
    n_kv, lengths = 2, (7, 40)
    t = sum(lengths)
    q, k, v = rand(1, t, n_kv * group, head_dim), rand(1, t, n_kv, head_dim), rand(1, t, n_kv, head_dim)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)[None]
    packed = ops.attention(q, k, v, document_tiles(positions, ops.tokens_per_tile(device, group)), head_dim**-0.5)  # [1, T, H, hd]
    cache_k, cache_v = k[:, lengths[0]:], v[:, lengths[0]:]  # [1, 40, n_kv, hd]: slot 0 holds the second sequence
    pos = torch.tensor([0, 13, 16, 39], device=device)
    one = torch.zeros(len(pos), dtype=torch.long, device=device)
    decoded = ops.attention(q[0, lengths[0] + pos][:, None], cache_k, cache_v, decode_tiles(pos, one), head_dim**-0.5)
    if not torch.equal(decoded[:, 0], packed[0, lengths[0] + pos]):
        _fail("attention", device, dtype, "decode rows against a cache differ from the same rows of a packed call")
