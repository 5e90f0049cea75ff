"""The decode step's state update as one Triton kernel on CUDA (tokens, log-probs, positions, steps).

Why: in torch it is five kernels (three copies, two in-place adds), each ~1 us plus a launch gap inside the
step's CUDA graph, which at batch 1 is a visible share of a ~0.6 ms step.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_step(i, m, t, lp, out_tokens, out_log_probs, tokens, positions, steps, max_pos):
    """Slots `i` (where `m`): out_tokens = tokens = t, out_log_probs = lp, positions += 1 (clamped to max_pos),
    steps += 1. Also the end of `head._head_finish`."""
    tl.store(out_tokens + i, t, mask=m)
    tl.store(tokens + i, t, mask=m)
    tl.store(out_log_probs + i, lp, mask=m)
    tl.store(positions + i, tl.minimum(tl.load(positions + i, mask=m) + 1, max_pos), mask=m)
    tl.store(steps + i, tl.load(steps + i, mask=m) + 1, mask=m)


@triton.jit
def _finish_step(tok, lp, out_tokens, out_log_probs, tokens, positions, steps, b, max_pos, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    m = i < b
    store_step(i, m, tl.load(tok + i, mask=m), tl.load(lp + i, mask=m), out_tokens, out_log_probs, tokens,
               positions, steps, max_pos)


def finish_step(state, b: int, tok, lp, max_pos: int) -> None:
    """`SlotState` rows `[0, b)`: out_tokens = tokens = tok, out_log_probs = lp, positions += 1 (clamped to
    max_pos), steps += 1 -- what `ModelRunner._decode_eager` does with torch ops, in one launch."""
    _finish_step[(1,)](tok, lp.float(), state.out_tokens, state.out_log_probs, state.tokens, state.positions,
                       state.steps, b, max_pos, BLOCK=triton.next_power_of_2(b))
