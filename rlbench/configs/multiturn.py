"""Multi-turn, tool-calling rollouts (`MultiTurnConfig`, `rollout.multiturn`): which tools, how many turns, budgets.

Read by the multi-turn generate function (`rlbench.rollout.multiturn:generate`, picked with
`rollout.custom_generate_function_path`); the default single-turn generation ignores it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from rlbench.configs.checks import did_you_mean, is_import_path

BUILTIN_TOOLS = ("calculator",)
"""The tools `rlbench.rollout.multiturn.tools.TOOLS` starts with, so that a config checks names without importing it
(tests/test_registries.py ties the two)."""


def check_tool_name(name) -> None:
    """Check a tool name without importing anything: a registered name (the registry's once it is loaded, so tools
    registered at run time count) or `"module.path:function"`."""
    tools = sys.modules.get("rlbench.rollout.multiturn.tools")
    names = list(tools.TOOLS) if tools is not None else list(BUILTIN_TOOLS)
    if isinstance(name, str) and (name in names or is_import_path(name)):
        return
    raise ValueError(f"unknown tool {name!r} (multiturn.tools){did_you_mean(str(name), names)}; choose from "
                     f"{sorted(names)}, register one (rlbench.rollout.multiturn.register_tool) or pass "
                     "'module.path:function'")


@dataclass
class MultiTurnConfig:
    """Tool calling: the model writes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the tool's output
    comes back as a `<tool_response>` observation (loss mask 0), and the model goes on, up to `max_turns` turns.
    The whole response (every turn and observation) is budgeted by `rollout.max_response_len`."""

    tools: tuple[str, ...] = ("calculator",)
    """Tools the model may call: names registered in `rlbench.rollout.multiturn.TOOLS` or "module.path:function"
    (the function's name is the tool's name). Empty: every call is answered with an unknown-tool error."""
    max_turns: int = 4
    """Generation turns per sample (the first included); a sample still calling a tool after the last turn is
    truncated (`metadata["truncated"] == "max_turns"`)."""
    max_turn_tokens: int | None = None
    """Tokens one turn may sample (None: `max_response_len`); a turn that hits it ends the sample, truncated."""
    tool_timeout: float = 5.0
    """Seconds a tool call may run (in a worker thread) before its observation is a timeout error."""
    max_observation_chars: int = 2000
    """A tool output longer than this is cut (and says so) before it is tokenized."""

    def __post_init__(self) -> None:
        if isinstance(self.tools, str):
            raise ValueError(f"multiturn.tools={self.tools!r} must be a list of tool names, e.g. [{self.tools!r}]")
        self.tools = tuple(self.tools)
        for name in self.tools:
            check_tool_name(name)
        if len(set(self.tools)) != len(self.tools):
            raise ValueError(f"multiturn.tools={list(self.tools)} names a tool twice; list each once")
        if self.max_turns < 1:
            raise ValueError(f"multiturn.max_turns={self.max_turns} must be >= 1 (1: no tool call is answered)")
        if self.max_turn_tokens is not None and self.max_turn_tokens < 1:
            raise ValueError(f"multiturn.max_turn_tokens={self.max_turn_tokens} must be >= 1 (None: max_response_len)")
        if not self.tool_timeout > 0:
            raise ValueError(f"multiturn.tool_timeout={self.tool_timeout} must be > 0 seconds")
        if self.max_observation_chars < 1:
            raise ValueError(f"multiturn.max_observation_chars={self.max_observation_chars} must be >= 1")
