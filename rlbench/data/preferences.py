"""Synthetic preference pairs on the arithmetic task, made by a hidden rule the code knows.

    rows = make_arithmetic_preferences(2000, level=1, seed=0)   # {"prompt", "chosen", "rejected", "metadata"}
    write_jsonl(rows, "data/prefs.jsonl")                        # what `rlbench rm --data` reads
    hidden_rule_score("\\\\boxed{7}", "7")                        # 1.5: the score the preferences came from
    rows = with_long_forms(make_arithmetic(1000, arithmetic_level(1)), 0.5)   # half the SFT solutions written long

The hidden rule (`hidden_rule_score`) values the form over the arithmetic: 1 for the short form (nothing but
`\\boxed{N}`) plus 0.5 for the correct answer. Each pair shows two responses to one prompt with different hidden
scores; the higher one is `chosen`. In a share `answer_pairs` (default `ANSWER_PAIRS`) of the pairs both responses are short and only the
answer differs (by at most `WRONG_SPREAD`); in the others one response is short and the other is not (text before
or after the box, a broken or cut box, junk with or without a box), each correct or not at random.

The form half is easy to learn from text and the arithmetic half is hard, so a small reward model learns mostly
the form: its held-out pair accuracy is high, yet on a policy's samples it barely tells a right answer from a near
miss. RL against it raises its own score and, where the policy's form has room (`with_long_forms`), the
hidden-rule score through the form, while the share of correct answers drifts down: reward hacking, measured by
scoring the same responses both ways (`rlbench.reward_model.serve.RewardModel` vs `hidden_rule_score`;
`rlbench.experiments.rlhf`).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from rlbench.data.tasks import ArithmeticConfig, arithmetic_level, make_arithmetic, verify_arithmetic

FILLERS = ("so", "The answer is", "I think", "Result:", "done", "ok")
"""Text put before or after the box to make a response long."""
WRONG_SPREAD = 5
"""A wrong answer is the correct one plus a nonzero offset in [-WRONG_SPREAD, WRONG_SPREAD]."""
ANSWER_PAIRS = 0.1
"""Share of pairs whose two responses are both short and differ only in the answer."""
CORRECT_BONUS = 0.5
"""What the correct answer adds to the hidden-rule score (the short form adds 1)."""

_SHORT = re.compile(r"\\boxed\{-?\d+\}")


def hidden_rule_score(response: str, label: Any) -> float:
    """The rule the synthetic preferences were made by: 1.0 for the short form + 0.5 for the correct answer.

    Args:
        response: the response text (as decoded for the reward; no special tokens).
        label: the integer answer (a string or an int).
    Returns:
        0.0, 0.5, 1.0 or 1.5.
    """
    return float(is_short_form(response)) + CORRECT_BONUS * float(verify_arithmetic(response, str(label)))


def is_short_form(response: str) -> bool:
    """True iff the response is exactly one `\\boxed{integer}` (surrounding whitespace aside)."""
    return _SHORT.fullmatch(response.strip()) is not None


def make_arithmetic_preferences(n: int, cfg: ArithmeticConfig | None = None, *, level: int | None = None,
                                seed: int = 0, answer_pairs: float = ANSWER_PAIRS) -> list[dict]:
    """`n` preference rows `{"prompt", "chosen", "rejected", "metadata"}` on arithmetic problems.

    Args:
        n: rows to draw (one pair per drawn problem; problems repeat when the level has few).
        cfg: which problems (`ArithmeticConfig`), or `level=` (1..4); neither: level 1.
        seed: the draw (problems, pair kinds, fillers, wrong answers).
        answer_pairs: share of pairs that differ only in the answer (both short), in [0, 1].
    Returns:
        rows whose `metadata` holds the label and both hidden-rule scores (`chosen_score` > `rejected_score`).
    """
    if cfg is not None and level is not None:
        raise ValueError("give cfg= or level=, not both")
    if not 0 <= answer_pairs <= 1:
        raise ValueError(f"answer_pairs={answer_pairs} must be in [0, 1] (a share of the pairs)")
    cfg = cfg or arithmetic_level(level or 1)
    rng = np.random.default_rng([seed, 1])
    rows = []
    for problem in make_arithmetic(n, cfg, seed=seed):
        answer = int(problem["label"])
        while True:  # a pair of equal hidden scores states no preference: draw again
            a, b = _pair(answer, rng, answer_pairs)
            sa, sb = hidden_rule_score(a, answer), hidden_rule_score(b, answer)
            if sa != sb:
                break
        (chosen, cs), (rejected, rs) = sorted([(a, sa), (b, sb)], key=lambda x: -x[1])
        rows.append({"prompt": problem["prompt"], "chosen": chosen, "rejected": rejected,
                     "metadata": {"label": problem["label"], "chosen_score": cs, "rejected_score": rs}})
    return rows


def with_long_forms(rows: list[dict], share: float, *, seed: int = 0) -> list[dict]:
    """Task rows (`rlbench.data.tasks` layout) with a `share` of their reference solutions written long: a filler
    from `FILLERS` before or after the box (`"The answer is \\\\boxed{7}"`), the kind of response the preferences
    reject. SFT on them gives a warm start that answers in the long form about that often, so its hidden-rule score
    has room that an RM trained on the preferences can show RL.

    Args:
        rows: rows whose `metadata["solution"]` is the short form.
        share: in [0, 1]; each row is rewritten with this probability (seeded).
    Returns:
        new rows (the input is not changed); labels and prompts as given.
    """
    if not 0 <= share <= 1:
        raise ValueError(f"share={share} must be in [0, 1] (the share of solutions written long)")
    rng = np.random.default_rng([seed, 2])
    out = []
    for row in rows:
        row = {**row, "metadata": dict(row["metadata"])}
        if rng.random() < share:
            filler, box = FILLERS[int(rng.integers(len(FILLERS)))], row["metadata"]["solution"]
            row["metadata"]["solution"] = f"{filler} {box}" if rng.random() < 0.5 else f"{box} {filler}"
        out.append(row)
    return out


def _pair(answer: int, rng: np.random.Generator, answer_pairs: float) -> tuple[str, str]:
    """Two responses: both short with different answers (a share `answer_pairs`), else one short and one long."""
    if rng.random() < answer_pairs:
        return _box(answer), _box(_wrong(answer, rng))
    short = _box(answer if rng.random() < 0.5 else _wrong(answer, rng))
    return short, _long(answer if rng.random() < 0.5 else _wrong(answer, rng), rng)


def _box(value: int) -> str:
    return f"\\boxed{{{value}}}"


def _wrong(answer: int, rng: np.random.Generator) -> int:
    offset = int(rng.integers(1, WRONG_SPREAD + 1))
    return answer + (offset if rng.random() < 0.5 else -offset)


def _long(value: int, rng: np.random.Generator) -> str:
    """Not the short form: a filler before or after the box, a box missing one of its non-digit characters, a box
    cut short, junk characters or junk inside a box (the ways a sampled response goes wrong)."""
    filler, kind, box = FILLERS[int(rng.integers(len(FILLERS)))], int(rng.integers(6)), _box(value)
    if kind == 0:
        return f"{filler} {box}"
    if kind == 1:
        return f"{box} {filler}"
    if kind == 2:
        cut = int(rng.integers(len(box) - len(str(value))))  # a character of "\\boxed{" or the "}", never a digit
        cut = cut if cut < len("\\boxed{") else len(box) - 1
        return box[:cut] + box[cut + 1 :]
    if kind == 3:
        return box[: int(rng.integers(1, len(box)))]
    junk = "".join(chr(int(c)) for c in rng.integers(33, 127, size=int(rng.integers(1, 11))))
    return junk if kind == 4 else f"\\boxed{{{junk}" + "}" * int(rng.integers(2))
