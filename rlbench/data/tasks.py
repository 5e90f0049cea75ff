"""Synthetic verifiable tasks with short answers: multi-digit arithmetic and Countdown.

Both are sized for the char-level CPU models: a prompt is ~15-30 characters and the reference
response (`\\boxed{...}` + `<|im_end|>`) ~8-20 tokens. Each task gives `(prompt, label, metadata)`
rows in slime's jsonl layout; `metadata["solution"]` is the reference response used by SFT and
`metadata["rm_type"]` names the reward in `rlbench.rewards` that verifies it.

    rows = make_arithmetic(1000, ArithmeticConfig(digits=2, operators="+-"), seed=0)
    write_jsonl(rows, "data/arith.jsonl")
"""

from __future__ import annotations

import ast
import json
import os
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

_OPS = "+-*"


@dataclass
class ArithmeticConfig:
    """Which arithmetic problems to generate."""

    digits: int = 2
    """Maximum number of digits of each operand (operands are drawn uniformly from [0, 10**digits))."""
    operators: str = "+-"
    """Operators to draw from, a subset of "+-*" (one binary operation per problem)."""

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 9:
            raise ValueError(f"digits={self.digits} must be in [1, 9]")
        if not self.operators or set(self.operators) - set(_OPS):
            raise ValueError(f"operators={self.operators!r} must be a non-empty subset of {_OPS!r}")


# Difficulty levels: 1 is learnable by the `tiny` preset in seconds, 4 is hard for `small`.
ARITHMETIC_LEVELS: dict[int, ArithmeticConfig] = {
    1: ArithmeticConfig(digits=1, operators="+"),
    2: ArithmeticConfig(digits=1, operators="+-*"),
    3: ArithmeticConfig(digits=2, operators="+-"),
    4: ArithmeticConfig(digits=3, operators="+-*"),
}


def arithmetic_level(level: int) -> ArithmeticConfig:
    """The `ArithmeticConfig` of a difficulty level (1..4)."""
    if level not in ARITHMETIC_LEVELS:
        raise ValueError(f"unknown arithmetic level {level}; choose one of {sorted(ARITHMETIC_LEVELS)}")
    return ARITHMETIC_LEVELS[level]


def make_arithmetic(n: int, cfg: ArithmeticConfig | None = None, *, seed: int = 0) -> list[dict]:
    """`n` arithmetic rows `{"prompt": "12+34=?", "label": "46", "metadata": {...}}` (vectorised draw)."""
    cfg = cfg or ArithmeticConfig()
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 10**cfg.digits, size=n)  # [n]
    b = rng.integers(0, 10**cfg.digits, size=n)  # [n]
    op_idx = rng.integers(0, len(cfg.operators), size=n)  # [n]
    results = {"+": a + b, "-": a - b, "*": a * b}
    ops = np.array(list(cfg.operators))[op_idx]
    ans = np.select([ops == o for o in cfg.operators], [results[o] for o in cfg.operators])
    meta_base = {"task": "arithmetic", "rm_type": "math", "digits": cfg.digits}
    return [
        {
            "prompt": f"{x}{o}{y}=?",
            "label": str(r),
            "metadata": meta_base | {"solution": f"\\boxed{{{r}}}"},
        }
        for x, o, y, r in zip(a.tolist(), ops.tolist(), b.tolist(), ans.tolist())
    ]


def verify_arithmetic(response: str, label: str) -> bool:
    """True iff the last `\\boxed{...}` (or, without one, the whole stripped response) equals the integer label."""
    answer = last_boxed(response)
    text = (answer if answer is not None else response).strip()
    return is_int(text) and int(text) == int(label)


@dataclass
class CountdownConfig:
    """Which Countdown problems to generate: reach `target` with the given numbers, each at most once."""

    num_numbers: int = 3
    """How many numbers the prompt gives."""
    max_number: int = 9
    """Numbers are drawn from [1, max_number]."""
    max_target: int = 99
    """Targets are positive integers <= max_target (reference solutions use every number)."""

    def __post_init__(self) -> None:
        if not 2 <= self.num_numbers <= 6:
            raise ValueError(f"num_numbers={self.num_numbers} must be in [2, 6]")
        if self.max_number < 1 or self.max_target < 1:
            raise ValueError(f"max_number={self.max_number} and max_target={self.max_target} must be >= 1")


def make_countdown(n: int, cfg: CountdownConfig | None = None, *, seed: int = 0) -> list[dict]:
    """`n` Countdown rows; the label is `{"target": t, "numbers": [...]}` and the solution an expression."""
    cfg = cfg or CountdownConfig()
    rng = np.random.default_rng(seed)
    rows: list[dict] = []
    while len(rows) < n:
        m = 2 * (n - len(rows)) + 16  # oversample: some draws fall outside [1, max_target]
        nums = rng.integers(1, cfg.max_number + 1, size=(m, cfg.num_numbers))  # [m, k]
        order = rng.permuted(nums, axis=1)  # [m, k]: operand order of the expression
        ops, value = _random_ops(order, rng)  # [m, k-1], [m]
        keep = np.flatnonzero((value >= 1) & (value <= cfg.max_target))[: n - len(rows)]
        rows += [_countdown_row(nums[i].tolist(), order[i].tolist(), ops[i].tolist(), int(value[i])) for i in keep]
    return rows


def _random_ops(order: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Random left-to-right operators over `order` [m, k] ("/" only where exact) and the values [m]."""
    m, k = order.shape
    value = order[:, 0].copy()
    ops = np.empty((m, k - 1), dtype="<U1")
    for j in range(1, k):
        x = order[:, j]
        divisible = value % x == 0
        choice = rng.integers(0, 4, size=m)
        choice = np.where((choice == 3) & ~divisible, rng.integers(0, 3, size=m), choice)
        ops[:, j - 1] = np.array(list("+-*/"))[choice]
        value = np.select(
            [choice == 0, choice == 1, choice == 2], [value + x, value - x, value * x], value // np.maximum(x, 1)
        )
    return ops, value


def _countdown_row(nums: list[int], order: list[int], ops: list[str], target: int) -> dict:
    """One Countdown row; parentheses make the left-to-right evaluation explicit where needed."""
    expr = str(order[0])
    for op, x in zip(ops, order[1:]):
        if op in "*/" and ("+" in expr or "-" in expr):
            expr = f"({expr})"
        expr += f"{op}{x}"
    return {
        "prompt": f"Use {' '.join(map(str, nums))} to make {target}.",
        "label": {"target": target, "numbers": nums},
        "metadata": {"task": "countdown", "rm_type": "countdown", "solution": f"\\boxed{{{expr}}}"},
    }


def verify_countdown(response: str, label: dict | str) -> bool:
    """True iff the last `\\boxed{expr}` uses only the given numbers (each at most once) and equals the target."""
    label = json.loads(label) if isinstance(label, str) else label
    expr = last_boxed(response)
    if expr is None:
        return False
    value, used = _safe_eval(expr)
    if value is None:
        return False
    allowed = Counter(int(x) for x in label["numbers"])
    return not (Counter(used) - allowed) and value == Fraction(int(label["target"]))


def _safe_eval(expr: str) -> tuple[Fraction | None, list[int]]:
    """Exact value of an expression of integer literals, + - * / and parentheses; (None, []) if invalid."""
    if len(expr) > 200 or set(expr) - set("0123456789+-*/() "):
        return None, []
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        return None, []
    used: list[int] = []
    try:
        return _eval_node(tree.body, used), used
    except (ValueError, ZeroDivisionError):
        return None, []


def _eval_node(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_eval_node(node.left, used), _eval_node(node.right, used))
    raise ValueError(f"unsupported expression node {type(node).__name__}")  # unary minus, calls, ...


_BINOPS = {
    ast.Add: lambda x, y: x + y,
    ast.Sub: lambda x, y: x - y,
    ast.Mult: lambda x, y: x * y,
    ast.Div: lambda x, y: x / y,
}


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` with balanced braces, or None when there is none (or it is unclosed)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def is_int(text: str) -> bool:
    """True iff `text` is an optionally negative run of ASCII digits."""
    body = text[1:] if text[:1] == "-" else text
    return body.isascii() and body.isdigit()


TASKS = {"arithmetic": make_arithmetic, "countdown": make_countdown}
VERIFIERS = {"arithmetic": verify_arithmetic, "countdown": verify_countdown}


def make_task(name: str, n: int, *, seed: int = 0, **cfg: Any) -> list[dict]:
    """Rows of a task by name ("arithmetic" accepts `level=` or ArithmeticConfig fields)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    if name == "arithmetic":
        level = cfg.pop("level", None)
        conf = arithmetic_level(level) if level is not None else ArithmeticConfig(**cfg)
        return make_arithmetic(n, conf, seed=seed)
    return make_countdown(n, CountdownConfig(**cfg), seed=seed)


def write_jsonl(rows: list[dict], path: str | os.PathLike) -> None:
    """Write rows as slime-layout jsonl (`prompt`, `label`, `metadata` per line).

    Atomic: the rows go to `path.tmp`, which replaces `path` only once complete, so a full disk or a kill
    never leaves a truncated file that a later run would read. An OSError (e.g. ENOSPC) names the path.
    """
    path = os.fspath(path)
    tmp = path + ".tmp"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise OSError(
            exc.errno, f"cannot write {len(rows)} rows to {path!r}: {exc.strerror or exc}; free disk space or "
            "write elsewhere (e.g. TaskConfig.out_dir)"
        ) from exc
