"""The batch-1 head (final RMSNorm, lm_head, sampling, state update) in two Triton kernels, after the megakernel.

Why: as compiled torch the head is ~7 kernels (norm, lm_head + noise, three vocab reductions, the state update)
with a launch gap before each inside the step's CUDA graph. Here every program is one warp, so that no reduction
needs a CTA barrier, and the partials kernel is launched with PDL after the megakernel's last stage on sm_90+.

`_head_partials`: one-warp program p streams its share of the lm_head rows (blocks of BLOCK_ROWS rows, the next
block's loads in flight while one is reduced), computes the logits as HF does (fp32 sums rounded to bf16, over the
bf16 RMSNorm of the hidden state), and keeps per-program partials of everything `sampling.sample_tokens` /
`greedy_tokens` reduce over the vocabulary: the first argmax of the tempered logits plus Gumbel noise (the same
counter-based noise, `sampling.uniform_noise`), the first argmax of the tempered logits, and their online
logsumexp, per row slot, reduced once at its end. `_head_finish` (one program) combines the partials (ties to the
lowest token id, as `argmax_rows`), forms the log-prob `scaled[token] - logsumexp`, and writes the slot state as
`step.finish_step`. Top-k/top-p ("truncate") keeps the compiled head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from rlbench.engine.megakernel.step import store_step
from rlbench.engine.megakernel.triton_stages import round_bf16

BLOCK_ROWS = 4
"""lm_head rows per loaded block of a one-warp program (4 x 1,024 bf16 = 8 KB on the 0.6B shape)."""
PROGRAMS_PER_SM = 8
"""One-warp programs per SM: every reduction stays inside a warp (shuffles, no CTA barrier), and 8 x 2 blocks
in flight per SM keep ~128 KB of the lm_head streaming."""


@triton.jit
def _mix32(x):
    """`sampling.mix32` on uint32 (multiplications wrap mod 2**32, as the int64 version's masks)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x5BD1E995
    return x ^ (x >> 16)


@triton.jit
def _first_max(v, idx):
    """(max of `v`, the lowest `idx` holding it): argmax with ties to the lowest token id, as `argmax_rows`.
    A NaN counts as a maximum (torch's argmax picks NaNs too), so that NaN logits (a diverged model, or a stalled
    megakernel before `check` reports it) still give a token id in range, not the 2**30 filler."""
    m = tl.max(v, axis=0)
    return m, tl.min(tl.where((v == m) | (v != v), idx, 2**30), axis=0)


@triton.jit
def _sum_at(run_max, run_sum, m):
    """Online-softmax sums `run_sum` (each relative to its `run_max`) brought to the common max `m` and added."""
    return tl.sum(tl.where(run_max > float("-inf"), run_sum * tl.exp(run_max - m), 0.0), axis=0)


@triton.jit
def _head_partials(hidden, norm_w, lm_w, temperature, seeds, steps, part_f, part_i, eps, V,
                   K: tl.constexpr, KP: tl.constexpr, BR: tl.constexpr, NOISE: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    k = tl.arange(0, KP)
    km = k < K
    if PDL:  # launched while the megakernel's last stage runs: its hidden state is complete after this
        gdc_wait()
    # the final RMSNorm as HF: fp32, rounded to bf16, times the bf16 weight, rounded again
    h = tl.load(hidden + k, mask=km, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / K + eps)
    x = round_bf16(tl.load(norm_w + k, mask=km, other=0.0).to(tl.float32) * round_bf16(h * rstd))
    temp = tl.load(temperature)
    temp = tl.where(temp <= 0, 1.0, temp)  # greedy rows of "sample" report T = 1
    if not NOISE:  # "greedy": every row, whatever its temperature
        temp = 1.0
    seed = tl.load(seeds).to(tl.uint32)
    step = (tl.load(steps) & 0xFFFFFF).to(tl.uint32)
    row_hash = _mix32(_mix32(seed) + step * 0x9E3779B9)
    n_blocks = tl.cdiv(V, BR)
    first, last = pid * n_blocks // nprog, (pid + 1) * n_blocks // nprog
    r = tl.arange(0, BR)
    # running statistics per row slot (no reduction across the block inside the loop), reduced once at the end
    key_max = tl.full([BR], float("-inf"), tl.float32)
    key_idx = tl.zeros([BR], tl.int32)
    key_scaled = tl.zeros([BR], tl.float32)
    s_max = tl.full([BR], float("-inf"), tl.float32)
    s_idx = tl.zeros([BR], tl.int32)
    s_sum = tl.zeros([BR], tl.float32)
    w_next = tl.load(lm_w + (first * BR + r)[:, None].to(tl.int64) * K + k[None, :],
                     mask=((first * BR + r) < V)[:, None] & km[None, :], other=0.0)
    for blk in range(first, last):
        rows = blk * BR + r
        rm = rows < V
        w = w_next  # the next block is in flight while this one is reduced (registers: a one-warp program has room)
        nxt = rows + BR
        w_next = tl.load(lm_w + nxt[:, None].to(tl.int64) * K + k[None, :],
                         mask=((nxt < V) & (blk + 1 < last))[:, None] & km[None, :], other=0.0)
        logits = round_bf16(tl.sum(w.to(tl.float32) * x[None, :], axis=1))
        scaled = logits / temp
        # online logsumexp and first argmax of the tempered logits (a slot sees its rows in ascending order)
        m_new = tl.where(rm, tl.maximum(s_max, scaled), s_max)
        s_sum = tl.where(rm, s_sum * tl.exp(s_max - m_new) + tl.exp(scaled - m_new), s_sum)
        s_idx = tl.where(rm & (scaled > s_max), rows, s_idx)
        s_max = m_new
        if NOISE:  # first argmax of scaled + Gumbel(u), u from the (seed, step, token) hash
            hsh = _mix32(row_hash ^ _mix32((rows * 2 + 1).to(tl.uint32)))
            u = ((hsh >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
            key = scaled - tl.log(-tl.log(u))
            better = rm & (key > key_max)
            key_idx = tl.where(better, rows, key_idx)
            key_scaled = tl.where(better, scaled, key_scaled)
            key_max = tl.where(better, key, key_max)
    m, p_idx = _first_max(s_max, s_idx)
    p_sum = _sum_at(s_max, s_sum, m)
    k_max, k_idx = _first_max(key_max, key_idx)
    k_scaled = tl.sum(tl.where((key_max == k_max) & (key_idx == k_idx), key_scaled, 0.0), axis=0)
    s_max, s_sum, s_idx, key_max, key_idx, key_scaled = m, p_sum, p_idx, k_max, k_idx, k_scaled
    i = tl.arange(0, 4)
    tl.store(part_f + pid * 4 + i, tl.where(i == 0, s_max, tl.where(i == 1, s_sum, tl.where(i == 2, key_max,
                                                                                              key_scaled))))
    tl.store(part_i + pid * 2 + tl.arange(0, 2), tl.where(tl.arange(0, 2) == 0, s_idx, key_idx))


@triton.jit
def _head_finish(part_f, part_i, temperature, out_tokens, out_log_probs, tokens, positions, steps, nprog, max_pos,
                 NOISE: tl.constexpr, PP: tl.constexpr):
    p = tl.arange(0, PP)
    pm = p < nprog
    s_max = tl.load(part_f + p * 4, mask=pm, other=float("-inf"))
    s_sum = tl.load(part_f + p * 4 + 1, mask=pm, other=0.0)
    s_idx = tl.load(part_i + p * 2, mask=pm, other=2**30)
    m, tok = _first_max(s_max, s_idx)  # programs hold ascending token ranges
    lse = m + tl.log(_sum_at(s_max, s_sum, m))
    scaled_tok = m
    if NOISE:
        key_max = tl.load(part_f + p * 4 + 2, mask=pm, other=float("-inf"))
        key_scaled = tl.load(part_f + p * 4 + 3, mask=pm, other=0.0)
        key_idx = tl.load(part_i + p * 2 + 1, mask=pm, other=2**30)
        km, k_tok = _first_max(key_max, key_idx)
        k_scaled = tl.sum(tl.where((key_max == km) & (key_idx == k_tok), key_scaled, 0.0), axis=0)
        sampled = tl.load(temperature) > 0
        tok = tl.where(sampled, k_tok, tok)
        scaled_tok = tl.where(sampled, k_scaled, scaled_tok)
    i = tl.arange(0, 1)
    store_step(i, i < 1, tl.zeros([1], tl.int64) + tok, tl.zeros([1], tl.float32) + (scaled_tok - lse), out_tokens,
               out_log_probs, tokens, positions, steps, max_pos)


class SampleHead:
    """The two kernels' launch for one model: `(hidden [1, 1, D], state, mode)` -> slot 0's token, log-prob and
    state update, as the compiled head + `finish_step` would leave them (greedy and sample modes)."""

    def __init__(self, model: torch.nn.Module, base: torch.nn.Module, device: torch.device,
                 programs: int | None = None):
        if programs is None:
            programs = (PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else 4)
        self.model, self.base, self.programs = model, base, programs
        self.pdl = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
        """Launch the partials kernel with programmatic dependent launch (sm_90+): it starts while the
        megakernel's last stage runs and waits for it in-kernel."""
        self.part_f = torch.zeros(programs * 4, dtype=torch.float32, device=device)
        self.part_i = torch.zeros(programs * 2, dtype=torch.int32, device=device)

    def __call__(self, hidden: torch.Tensor, state, mode: str, max_pos: int) -> None:
        w = self.model.lm_head.weight
        v, k = w.shape
        noise = mode == "sample"
        _head_partials[(self.programs,)](hidden, self.base.norm.weight, w, state.temperature, state.seeds,
                                         state.steps, self.part_f, self.part_i, self.base.norm.variance_epsilon, v,
                                         K=k, KP=triton.next_power_of_2(k), BR=BLOCK_ROWS, NOISE=noise,
                                         PDL=self.pdl, launch_pdl=self.pdl, num_warps=1)
        _head_finish[(1,)](self.part_f, self.part_i, state.temperature, state.out_tokens, state.out_log_probs,
                           state.tokens, state.positions, state.steps, self.programs, max_pos, NOISE=noise,
                           PP=triton.next_power_of_2(self.programs), num_warps=4)
