"""Tools a model may call: plain Python functions registered by name, run with a time limit.

    @register_tool
    def lookup(key: str) -> str:
        return TABLE[key]

A tool is called with the call's JSON `arguments` as keyword arguments; what it returns becomes the observation
(`str()` of it, JSON for dicts and lists). Whatever goes wrong (an unknown tool, arguments that do not fit its
signature, an exception, no answer within the timeout) becomes an observation saying so, for the model to read;
nothing here raises into the rollout. Every call of a turn runs at once, each in its own daemon thread; a call that
does not answer in time is abandoned (its thread keeps running, detached).
"""

from __future__ import annotations

import ast
import inspect
import json
import operator
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rlbench.configs.checks import did_you_mean, import_callable
from rlbench.configs.multiturn import check_tool_name


@dataclass(frozen=True)
class Tool:
    """A callable the model can call by `name`."""

    name: str
    fn: Callable[..., Any]
    description: str = ""
    """What the tool does (its docstring's first line by default): for prompts that list the tools."""


@dataclass
class ToolResult:
    """One call's outcome: `output` is the observation's content; `error` names the failure kind, or None."""

    output: str
    error: str | None = None
    """None, "unknown_tool", "bad_arguments", "raised" or "timeout" (the parser adds "malformed")."""
    seconds: float = 0.0


TOOLS: dict[str, Tool] = {}


def register_tool(fn: Callable | None = None, *, name: str | None = None, description: str | None = None):
    """Register `fn` as a tool (decorator, with or without arguments); its name defaults to `fn.__name__`."""
    def add(f: Callable) -> Callable:
        key = name or f.__name__
        doc = description if description is not None else (inspect.getdoc(f) or "").split("\n")[0]
        TOOLS[key] = Tool(key, f, doc)
        return f
    return add(fn) if fn is not None else add


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_POWER = 64
"""The largest exponent `calculator` evaluates (a bigger one is an error, not a hang)."""


@register_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses."""
    def ev(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_POWER:
                raise ValueError(f"exponent {right} is larger than {MAX_POWER}")
            return _BINARY[type(node.op)](left, right)
        raise ValueError(f"unsupported syntax {ast.unparse(node)!r}: use numbers, + - * / // % ** and parentheses")

    if not isinstance(expression, str):
        raise TypeError(f"expression must be a string, got {type(expression).__name__}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"cannot parse {expression!r}: {exc.msg}") from None
    value = ev(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def resolve_tools(names: Sequence[str]) -> dict[str, Tool]:
    """The tools of `multiturn.tools` by name: registered names, or `"module.path:function"` imports (named after the
    function). Raises ValueError naming the problem and the fix."""
    out: dict[str, Tool] = {}
    for name in names:
        check_tool_name(name)
        if name in TOOLS:
            tool = TOOLS[name]
        else:
            fn = import_callable(name, f"tool {name!r}")
            tool = Tool(name.partition(":")[2], fn, (inspect.getdoc(fn) or "").split("\n")[0])
        if tool.name in out:
            raise ValueError(f"two tools of multiturn.tools are named {tool.name!r}; a call picks a tool by name")
        out[tool.name] = tool
    return out


def as_text(value: Any) -> str:
    """A tool's return value as observation text: strings as they are, dicts/lists as JSON, the rest `str()`."""
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


class _Call:
    """One tool call running in its own daemon thread."""

    def __init__(self, fn: Callable, arguments: dict) -> None:
        self.done = threading.Event()
        self.outcome: tuple[bool, Any] | None = None
        self.start = time.perf_counter()
        threading.Thread(target=self._run, args=(fn, arguments), daemon=True, name="rlbench-tool").start()

    def _run(self, fn: Callable, arguments: dict) -> None:
        try:
            self.outcome = True, fn(**arguments)
        except BaseException as exc:  # reported to the model as an observation
            self.outcome = False, exc
        self.done.set()


def call_tools(tools: dict[str, Tool], calls: Sequence[tuple[str, dict]], timeout: float) -> list[ToolResult]:
    """Run `(name, arguments)` calls at once, each with `timeout` seconds; one `ToolResult` per call, in order."""
    results: list[ToolResult | None] = [None] * len(calls)
    running: dict[int, _Call] = {}
    for i, (name, arguments) in enumerate(calls):
        tool = tools.get(name)
        if tool is None:
            available = ", ".join(sorted(tools)) or "none"
            results[i] = ToolResult(f"error: unknown tool {name!r}{did_you_mean(name, list(tools))}; available "
                                    f"tools: {available}", "unknown_tool")
            continue
        try:
            inspect.signature(tool.fn).bind(**arguments)
        except TypeError as exc:
            results[i] = ToolResult(f"error: bad arguments for {name}: {exc}", "bad_arguments")
            continue
        running[i] = _Call(tool.fn, arguments)
    deadline = time.perf_counter() + timeout
    for i, call in running.items():
        name = calls[i][0]
        if not call.done.wait(max(0.0, deadline - time.perf_counter())):
            results[i] = ToolResult(f"error: {name} timed out after {timeout:g} s", "timeout", timeout)
            continue
        ok, value = call.outcome
        seconds = time.perf_counter() - call.start
        results[i] = (ToolResult(as_text(value), None, seconds) if ok else
                      ToolResult(f"error: {name} raised {type(value).__name__}: {value}", "raised", seconds))
    return results
