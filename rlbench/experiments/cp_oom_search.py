"""The cp-oom experiment's records and its length search: the longest length that trains, found in few trials.

Pure (no torch): a probe callable runs a trial, so the search is tested with planted limits
(tests/test_cp_emulation.py) and drives real GPU trials in `rlbench.experiments.cp_oom`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

TIME_SAFETY = 1.5  # a trial is started only if 1.5 x its predicted seconds fit before the deadline
MAX_JUMP = 4  # a memory-fit guess goes at most 4x past the longest trained length (the time fit stays near its data)


@dataclass
class Trial:
    """One training step at one response length."""

    cp: int
    ac: bool
    response_len: int
    pack_tokens: int  # tokens of the (CP-padded) sequence
    rank_tokens: int  # tokens this process held (pack_tokens / cp)
    works: bool
    peak_gib: float | None = None  # max allocated during the trial (also for an OOM: the peak before it); None on CPU
    step_s: float | None = None  # the last step's seconds (works only)
    loss: float | None = None
    grad_norm: float | None = None
    world: int = 1  # GPUs (processes) of the run: 1 with cp > 1 is the one-rank emulation

    @property
    def emulated(self) -> bool:
        return self.cp > 1 and self.world == 1

    @property
    def tokens_per_s_per_gpu(self) -> float | None:
        return self.rank_tokens / self.step_s if self.step_s else None


@dataclass
class Cell:
    """The search's result for one (cp, AC) setting."""

    cp: int
    ac: bool
    longest: int  # longest response length that trained (0: none did)
    shortest_oom: int | None  # shortest that ran out of memory (None: none up to max_len)
    complete: bool  # bracketed to the resolution (or max_len trained) within the time budget
    extrapolated: int | None  # where the linear fit of peak memory reaches the capacity
    state_gib: float | None  # allocated after the build: fp32 params + Adam states (grads come on top in a step)
    seconds: float
    trials: list[Trial] = field(default_factory=list)
    world: int = 1  # GPUs (processes) of the run: dp = world / cp; 1 with cp > 1 is the one-rank emulation

    @property
    def emulated(self) -> bool:
        return self.cp > 1 and self.world == 1

    @property
    def label(self) -> str:
        return f"FSDP cp{self.cp}" + (" (emulated)" if self.emulated else "")

    def at(self, length: int) -> Trial | None:
        return next((t for t in self.trials if t.response_len == length), None)


def _floor(x: float, res: int) -> int:
    return int(x // res) * res


def fit_limit(trials: list[Trial], capacity_gib: float | None, res: int) -> int | None:
    """The last multiple of `res` below the length where the line through the two longest working trials' peaks
    reaches `capacity_gib`; None without a capacity, two such trials, or a rising line."""
    pts = sorted((t.response_len, t.peak_gib) for t in trials if t.works and t.peak_gib is not None)
    if capacity_gib is None or len(pts) < 2:
        return None
    (l1, p1), (l2, p2) = pts[-2], pts[-1]
    if p2 <= p1:
        return None
    at_capacity = l2 + (capacity_gib - p2) * (l2 - l1) / (p2 - p1)
    return max(0, math.ceil(at_capacity / res) * res - res)  # the last multiple of res below it


def predict_seconds(trials: list[Trial], length: int) -> float:
    """Seconds of a step at `length` from `a L + b L^2` through the two longest timed trials (a, b >= 0);
    one trial: quadratic scaling; none: 0."""
    pts = sorted((t.response_len, t.step_s) for t in trials if t.works and t.step_s)
    if not pts:
        return 0.0
    if len(pts) == 1:
        return pts[0][1] * (length / pts[0][0]) ** 2
    (l1, t1), (l2, t2) = pts[-2], pts[-1]
    b = (t2 / l2 - t1 / l1) / (l2 - l1)
    a = t2 / l2 - b * l2
    if b < 0:
        a, b = t2 / l2, 0.0
    elif a < 0:
        a, b = 0.0, t2 / l2**2
    return a * length + b * length**2


def search_longest(
    probe: Callable[[int], Trial], *, start: int, max_len: int, resolution: int, capacity_gib: float | None = None,
    deadline: float = math.inf, clock: Callable[[], float] = time.monotonic,
) -> tuple[int, int | None, bool, list[Trial]]:
    """The longest length in `resolution` steps that `probe` trains, assuming memory grows with length.

    Doubling from `start` (capped at `max_len`) until the first failure; a fit of peak memory (`fit_limit`),
    once there is one, replaces a doubling step (going at most `MAX_JUMP` x past the longest trained length),
    and after a fit guess that trained the probe climbs in doubling steps of `resolution` from it; with a failure known, guesses and midpoints take turns until the gap is
    `resolution`. Stops early when the next trial would not end before `deadline` (`predict_seconds`).

    Returns:
        (longest that trained or 0, shortest that failed or None, complete, the trials in order).
    """
    trials: list[Trial] = []
    lo, hi = 0, None
    climbing, climb, guessed_last = False, resolution, False
    while not (hi is None and lo >= max_len) and not (hi is not None and hi - lo <= resolution):
        guess = fit_limit(trials, capacity_gib, resolution)
        if hi is None:
            if climbing:
                nxt = lo + climb
                climb *= 2
            elif guess is not None and guess > lo:
                nxt = min(guess, MAX_JUMP * lo)
            else:
                nxt = start if lo == 0 else 2 * lo
            nxt = min(nxt, max_len)
        else:
            mid = lo + max(resolution, _floor((hi - lo) / 2, resolution))
            use_guess = guess is not None and lo < guess < hi and not guessed_last
            nxt = guess if use_guess else mid
        if clock() + TIME_SAFETY * predict_seconds(trials, nxt) > deadline:
            return lo, hi, False, trials
        trial = probe(nxt)
        trials.append(trial)
        was_guess = nxt == guess
        if trial.works:
            lo = nxt
            climbing = hi is None and (climbing or was_guess)
        else:
            hi = nxt
        guessed_last = was_guess and hi is not None
    return lo, hi, True, trials
