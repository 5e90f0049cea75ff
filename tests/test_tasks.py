"""rlbench.data.tasks: arithmetic and Countdown generators, verifiers, jsonl writer."""

from __future__ import annotations

import json

import pytest

from rlbench.data.tasks import (
    ARITHMETIC_LEVELS,
    ArithmeticConfig,
    CountdownConfig,
    last_boxed,
    make_arithmetic,
    make_countdown,
    make_task,
    verify_arithmetic,
    verify_countdown,
    write_jsonl,
)
from rlbench.data.tokenizer import build_tokenizer


@pytest.mark.parametrize("level", sorted(ARITHMETIC_LEVELS))
def test_arithmetic_labels_are_exact_and_solutions_verify(level):
    cfg = ARITHMETIC_LEVELS[level]
    rows = make_arithmetic(500, cfg, seed=level)
    for row in rows:
        a, op, b = _split(row["prompt"].removesuffix("=?"), cfg.operators)
        assert int(row["label"]) == {"+": a + b, "-": a - b, "*": a * b}[op]  # python int reference
        assert 0 <= a < 10**cfg.digits and 0 <= b < 10**cfg.digits and op in cfg.operators
        assert verify_arithmetic(row["metadata"]["solution"], row["label"])
        assert row["metadata"]["rm_type"] == "math"
    assert {_split(r["prompt"][:-2], cfg.operators)[1] for r in rows} == set(cfg.operators)


def _split(expr: str, ops: str) -> tuple[int, str, int]:
    i = next(i for i in range(1, len(expr)) if expr[i] in ops)  # skip a leading digit
    return int(expr[:i]), expr[i], int(expr[i + 1 :])


def test_arithmetic_is_seeded():
    assert make_arithmetic(50, seed=3) == make_arithmetic(50, seed=3) != make_arithmetic(50, seed=4)


def test_verify_arithmetic_cases():
    assert verify_arithmetic("\\boxed{-25}", "-25")
    assert verify_arithmetic("so \\boxed{1} then \\boxed{46}", "46")  # the last box counts
    assert verify_arithmetic("46", "46")  # no box: the whole answer
    assert not verify_arithmetic("\\boxed{45}", "46")
    assert not verify_arithmetic("\\boxed{46", "46")  # unclosed box
    assert not verify_arithmetic("", "46") and not verify_arithmetic("\\boxed{4 6}", "46")


def test_countdown_solutions_verify_and_targets_in_range():
    cfg = CountdownConfig(num_numbers=4, max_number=9, max_target=50)
    rows = make_countdown(500, cfg, seed=1)
    for row in rows:
        label = row["label"]
        assert 1 <= label["target"] <= 50 and len(label["numbers"]) == 4
        assert row["prompt"] == f"Use {' '.join(map(str, label['numbers']))} to make {label['target']}."
        assert verify_countdown(row["metadata"]["solution"], label)
        assert verify_countdown(row["metadata"]["solution"], json.dumps(label))  # label as JSON text


def test_verify_countdown_rules():
    label = {"target": 24, "numbers": [4, 6, 1]}
    assert verify_countdown("\\boxed{4*6}", label)  # a subset is allowed
    assert verify_countdown("\\boxed{(4+6-1)*1+15}", {"target": 24, "numbers": [4, 6, 1, 1, 15]})
    assert verify_countdown("\\boxed{6/(1/4)}", label)  # exact rational arithmetic
    assert not verify_countdown("\\boxed{4*6*1*1}", label)  # 1 used twice
    assert not verify_countdown("\\boxed{4*6+0}", label)  # 0 not given
    assert not verify_countdown("\\boxed{24}", label)
    assert not verify_countdown("\\boxed{4*6/0}", label)  # division by zero is wrong, not an error
    assert not verify_countdown("\\boxed{-4*-6}", label)  # unary minus is not an allowed operation
    assert not verify_countdown("\\boxed{__import__('os')}", label)
    assert not verify_countdown("\\boxed{4**6}", label) and not verify_countdown("4*6", label)
    assert not verify_countdown("\\boxed{(4*6}", label)


def test_last_boxed_balances_braces():
    assert last_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("a \\boxed{1} b \\boxed{2}") == "2"
    assert last_boxed("\\boxed{1") is None and last_boxed("no box") is None


def test_responses_are_short_in_tokens():
    tok = build_tokenizer()
    rows = make_arithmetic(200, ARITHMETIC_LEVELS[4]) + make_countdown(200)
    lengths = [len(tok(r["metadata"]["solution"])["input_ids"]) + 1 for r in rows]  # + <|im_end|>
    assert 8 <= min(lengths) and max(lengths) <= 24


def test_10k_items_are_distinct_and_self_consistent():
    rows = make_arithmetic(10_000, ArithmeticConfig(digits=3, operators="+-*"))
    assert len(rows) == 10_000 and len({r["prompt"] for r in rows}) > 9_000
    assert all(verify_arithmetic(r["metadata"]["solution"], r["label"]) for r in rows)
    rows = make_countdown(10_000)
    assert len(rows) == 10_000
    assert all(verify_countdown(r["metadata"]["solution"], r["label"]) for r in rows)


def test_make_task_and_writer_round_trip(tmp_path):
    rows = make_task("arithmetic", 20, seed=2, level=3)
    assert rows == make_arithmetic(20, ARITHMETIC_LEVELS[3], seed=2)
    write_jsonl(rows, tmp_path / "sub" / "a.jsonl")
    assert [json.loads(line) for line in open(tmp_path / "sub" / "a.jsonl")] == rows
    with pytest.raises(ValueError, match="unknown task 'sudoku'"):
        make_task("sudoku", 1)
    with pytest.raises(ValueError, match="unknown arithmetic level 9"):
        make_task("arithmetic", 1, level=9)


def test_config_validation():
    with pytest.raises(ValueError, match="operators='\\+/'"):
        ArithmeticConfig(operators="+/")
    with pytest.raises(ValueError, match="digits=0"):
        ArithmeticConfig(digits=0)
    with pytest.raises(ValueError, match="num_numbers=1"):
        CountdownConfig(num_numbers=1)
