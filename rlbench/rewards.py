"""Reward functions: a registry of `(response: str, label) -> float`, a custom import path and a batch API.

    fn = get_reward_fn("math")              # or "exact", "countdown", or "my_pkg.rewards:score"
    rewards = score_batch(samples, rm_type="math")          # Samples carry .response and .label
    rewards = score_batch(["\\\\boxed{3}"], labels=["3"], rm_type="math")

A reward function that raises, returns a non-number (None, str, ...) or a non-finite number (NaN, Inf),
or runs past `timeout` seconds raises `RewardError` naming the function and the sample (index, prompt
and response excerpts, label, the value and its type); errors are never swallowed into a zero reward. Per-sample `metadata["rm_type"]` overrides `rm_type`,
as in slime.

Cost (2-core CPU, measured): `math` is ~1-5 ms per call through math_verify after warm-up (the first
call pays ~1 s of sympy set-up); a boxed integer against an integer label takes a fast path (~5 us)
with the same verdict, so scoring the ~64 responses of an arithmetic RL step costs < 1 ms.
"""

from __future__ import annotations

import math
import numbers
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from rlbench.configs.checks import import_callable
from rlbench.configs.rollout import check_rm_type
from rlbench.data.tasks import is_int, last_boxed, verify_countdown

RewardFn = Callable[[str, Any], float]


class RewardError(RuntimeError):
    """A reward function raised on one sample; the message names the sample, `__cause__` is the original."""


def math_reward(response: str, label: Any) -> float:
    """1.0 iff math_verify finds the response's answer (last `\\boxed{}`, else the final expression) equal to the label.

    The label may itself be boxed or LaTeX (`\\frac{1}{2}`), or a plain number/string.
    """
    boxed = last_boxed(response)
    if boxed is not None and is_int(boxed.strip()) and is_int(str(label).strip()):
        return float(int(boxed) == int(label))  # fast path, same verdict as math_verify for integers
    try:
        from math_verify import parse, verify  # lazy: sympy import costs ~1 s
    except ImportError as err:
        raise ImportError(f"the 'math' reward needs math-verify ({err}): pip install 'math-verify>=0.7', or set "
                          "rm_type='exact' for answers that are plain strings") from err

    # math_verify's timeouts use SIGALRM, which only the main thread may install.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    label_text = str(label)
    gold = parse(label_text if "\\boxed" in label_text else f"${label_text}$", parsing_timeout=timeout)
    answer = parse(f"\\boxed{{{boxed}}}" if boxed is not None else response, parsing_timeout=timeout)
    if not gold or not answer:
        return 0.0
    return float(verify(gold, answer, timeout_seconds=timeout))


def exact_reward(response: str, label: Any) -> float:
    """1.0 iff the last `\\boxed{}` content (or, without one, the whole response) equals `str(label)` after strip."""
    boxed, gold = last_boxed(response), last_boxed(str(label))
    answer = boxed if boxed is not None else response
    return float(answer.strip() == (gold if gold is not None else str(label)).strip())


def countdown_reward(response: str, label: Any) -> float:
    """1.0 iff the last `\\boxed{expr}` uses only the label's numbers (each at most once) and hits its target."""
    return float(verify_countdown(response, label))


REWARDS: dict[str, RewardFn] = {"math": math_reward, "exact": exact_reward, "countdown": countdown_reward}
BUILTIN_REWARDS = tuple(REWARDS)
"""The names REWARDS starts with (others may be registered at run time): `rlbench.configs.rollout.REWARD_NAMES`."""


def get_reward_fn(rm_type: str | RewardFn) -> RewardFn:
    """A registered reward by name, a `"module.path:function"` import, or a callable passed through.

    Raises ValueError naming the problem: an unknown registry name (with "did you mean"), a module that
    does not import, or a module without that callable (with "did you mean" from the module's names).
    """
    if callable(rm_type):
        return rm_type
    check_rm_type(rm_type)
    if rm_type in REWARDS:
        return REWARDS[rm_type]
    return import_callable(rm_type, f"rm_type={rm_type!r}")


def score_batch(
    samples_or_texts: Sequence[Any],
    labels: Sequence[Any] | None = None,
    rm_type: str | RewardFn = "math",
    *,
    timeout: float | None = None,
    indices: Sequence[int] | None = None,
) -> list[float]:
    """Rewards for a batch of responses.

    Args:
        samples_or_texts: `rlbench.types.Sample`s (their `.response`, `.label`, `.metadata`) or response strings.
        labels: one label per item; required for strings, overrides `Sample.label` when given.
        rm_type: reward name, `"module:function"` or a callable; `metadata["rm_type"]` of a Sample wins.
        timeout: seconds one reward call may take (`RolloutConfig.reward_timeout`); None or 0: no limit,
            the call runs in this thread. With a limit a user reward runs in a daemon worker thread; a call
            past the limit raises `RewardError` (the stuck thread is abandoned, it cannot be killed). The
            built-in rewards (`REWARDS`) always run inline: `math` keeps math_verify's own 5 s timeouts.
        indices: the items' indices in the caller's batch, used in error messages (default 0..n-1).

    Returns:
        one finite float per item, in order.

    Raises:
        RewardError: a reward function raised, timed out, or returned a non-number or a non-finite value;
            the message names the function and the sample (index, prompt/response excerpts, label, value).
    """
    if labels is not None and len(labels) != len(samples_or_texts):
        raise ValueError(f"got {len(samples_or_texts)} responses but {len(labels)} labels; pass one label each")
    default_fn = get_reward_fn(rm_type)
    rewards = []
    default_spec = rm_type if isinstance(rm_type, str) else None
    for i, item in enumerate(samples_or_texts):
        idx = indices[i] if indices is not None else i
        response, label, fn, spec = _unpack(item, i, labels, default_fn)
        spec = spec or default_spec
        name = spec if isinstance(spec, str) else _name(fn)
        try:
            value = _call(fn, response, label, timeout)
        except _Timeout:
            raise RewardError(
                f"reward {name!r} timed out after {timeout:g}s on {describe_sample(item, idx, response, label)}; "
                "make the reward faster or raise rollout.reward_timeout (--reward-timeout)"
            ) from None
        except Exception as exc:  # re-raised with context, never swallowed
            raise RewardError(
                f"reward {name!r} raised on {describe_sample(item, idx, response, label)}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        rewards.append(check_reward(value, f"reward {name!r} on {describe_sample(item, idx, response, label)}"))
    return rewards


def combine_rewards(weights: dict[str, float], terms: dict[str, Sequence[float]]) -> list[float]:
    """The weighted sum per sample: `sum(weights[name] * terms[name][i])`, added in the order of `weights`.

    Args:
        weights: name -> weight (`RolloutConfig.reward_mix`).
        terms: name -> one value per sample, for every name in `weights` (all the same length).
    Returns:
        one float per sample.
    """
    missing = [name for name in weights if name not in terms]
    if missing:
        raise ValueError(f"no values for reward term(s) {missing}; got {sorted(terms)}")
    lengths = {len(terms[name]) for name in weights}
    if len(lengths) > 1:
        raise ValueError(f"reward terms of different lengths: { {name: len(terms[name]) for name in weights} }")
    n = lengths.pop() if lengths else 0
    out = []
    for i in range(n):
        total = 0.0
        for name, weight in weights.items():
            total += weight * float(terms[name][i])
        out.append(total)
    return out


def check_reward(value: Any, where: str) -> float:
    """`value` as a finite float, or `RewardError` (`where` names the function and sample)."""
    if not isinstance(value, numbers.Real) and hasattr(value, "item"):
        try:
            value = value.item()  # numpy / torch one-element values
        except (ValueError, RuntimeError):
            pass
    if not isinstance(value, numbers.Real):
        raise RewardError(
            f"{where} returned {_excerpt(value)} of type {type(value).__name__}; a reward must return a finite "
            "float (e.g. 0.0 / 1.0)"
        )
    value = float(value)
    if not math.isfinite(value):
        raise RewardError(
            f"{where} returned {value!r} (not finite); NaN/Inf rewards would make the group's advantages NaN "
            "and skip every optimizer step holding them; return a finite float (e.g. 0.0 for a failed parse)"
        )
    return value


def describe_sample(item: Any, idx: int, response: str | None = None, label: Any = None) -> str:
    """`sample 3 (prompt='1+2=?', response='\\boxed{3}', label='3')`, excerpts cut to 80 characters."""
    prompt = None if isinstance(item, str) else getattr(item, "prompt", None)
    parts = ([f"prompt={_excerpt(prompt)}"] if prompt is not None else []) + [
        f"response={_excerpt(response)}", f"label={_excerpt(label)}"]
    return f"sample {idx} ({', '.join(parts)})"


def _excerpt(value: Any, n: int = 80) -> str:
    text = value if isinstance(value, str) else repr(value)
    return repr(text if len(text) <= n else text[: n // 2] + " ... " + text[-n // 2 :])


def _name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or repr(fn)


class _Timeout(Exception):
    pass


class _Worker:
    """A daemon thread running one reward call at a time; abandoned (never joined) when a call hangs."""

    def __init__(self) -> None:
        self.jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._loop, daemon=True, name="rlbench-reward").start()

    def _loop(self) -> None:
        while True:
            fn, args, out, done = self.jobs.get()
            try:
                out.append((True, fn(*args)))
            except BaseException as exc:  # handed back to the caller
                out.append((False, exc))
            done.set()


_BUILTIN = frozenset(REWARDS.values())
_worker: _Worker | None = None
_worker_lock = threading.Lock()


def _call(fn: RewardFn, response: str, label: Any, timeout: float | None) -> Any:
    """`fn(response, label)`, in a worker thread with a time limit when `timeout` is set."""
    global _worker
    if not timeout or fn in _BUILTIN:  # the built-in rewards are bounded (math_verify has its own timeouts)
        return fn(response, label)
    with _worker_lock:
        worker = _worker = _worker or _Worker()
    out: list = []
    done = threading.Event()
    worker.jobs.put((fn, (response, label), out, done))
    try:
        finished = done.wait(timeout)
    finally:
        if not done.is_set():  # timed out, or Ctrl-C while waiting: the thread may be stuck in the reward
            with _worker_lock:
                if _worker is worker:
                    _worker = None  # the stuck thread keeps its job; the next call gets a fresh worker at once
    if not finished:
        raise _Timeout
    ok, value = out[0]
    if not ok:
        raise value
    return value


def _unpack(item: Any, i: int, labels: Sequence[Any] | None, default_fn: RewardFn) -> tuple[str, Any, RewardFn, Any]:
    """(response, label, reward fn, its rm_type) of one batch item."""
    if isinstance(item, str):
        if labels is None:
            raise ValueError("score_batch got response strings without labels; pass labels=[...]")
        return item, labels[i], default_fn, None
    label = labels[i] if labels is not None else item.label
    rm = (item.metadata or {}).get("rm_type")
    if not rm:
        return item.response, label, default_fn, None
    try:
        return item.response, label, get_reward_fn(rm), rm
    except ValueError as exc:
        raise RewardError(f"sample {i}: metadata rm_type: {exc}") from exc
