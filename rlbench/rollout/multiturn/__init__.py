"""Multi-turn, tool-calling rollouts: `rollout.custom_generate_function_path="rlbench.rollout.multiturn:generate"`.

    from rlbench.rollout.multiturn import register_tool

    @register_tool
    def lookup(key: str) -> str:
        "Look a key up in the table."
        return TABLE[key]

`loop.generate` runs the turns on engine sessions, `syntax` parses Qwen/Hermes `<tool_call>` blocks and renders
`<tool_response>` observations, `tools` holds the registry and runs calls with a timeout. docs/multiturn.md.
"""

from rlbench.rollout.multiturn.loop import generate, to_sample
from rlbench.rollout.multiturn.syntax import (
    CALL_END,
    CALL_START,
    MalformedToolCall,
    ToolCall,
    format_call,
    observation_text,
    parse_tool_call,
)
from rlbench.rollout.multiturn.tools import (
    TOOLS,
    Tool,
    ToolResult,
    calculator,
    call_tools,
    register_tool,
    resolve_tools,
)

__all__ = [
    "CALL_END", "CALL_START", "MalformedToolCall", "TOOLS", "Tool", "ToolCall", "ToolResult", "calculator",
    "call_tools", "format_call", "generate", "observation_text", "parse_tool_call", "register_tool", "resolve_tools",
    "to_sample",
]
