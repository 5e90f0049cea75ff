"""The tool-call syntax of Qwen / Hermes chat templates: calls the model writes, observations the template renders.

A call (what Qwen2.5 / Qwen3 templates render for an assistant message with `tool_calls`, and what the models write):

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*34"}}
    </tool_call>

The turn stops at `</tool_call>` (a stop string). The template would then close the assistant message and render the
tool's message as a user turn; the observation appended to the sample is exactly that text:

    <|im_end|>\\n<|im_start|>user\\n<tool_response>\\n{output}\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n

so the next turn starts where the template's generation prompt would.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
"""The stop string that ends a turn with a tool call."""
RESPONSE_PREFIX = "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
RESPONSE_SUFFIX = "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


@dataclass
class ToolCall:
    """A parsed call: the tool's `name` and its keyword `arguments`."""

    name: str
    arguments: dict


class MalformedToolCall(ValueError):
    """The turn ended with `</tool_call>` but what precedes it is not a valid call; the message says why."""


def parse_tool_call(text: str) -> ToolCall | None:
    """The last tool call of a turn's text, or None when the text has no `</tool_call>` (a final answer).

    Raises MalformedToolCall (a ValueError) when there is a `</tool_call>` but no `<tool_call>` before it, the body
    is not JSON, not an object, has no string "name", or "arguments" is not an object (a JSON string holding one is
    accepted, as some models write it)."""
    end = text.rfind(CALL_END)
    if end < 0:
        return None
    start = text.rfind(CALL_START, 0, end)
    if start < 0:
        raise MalformedToolCall(f"{CALL_END} without an opening {CALL_START}")
    body = text[start + len(CALL_START) : end].strip()
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        raise MalformedToolCall(f"the call is not JSON ({exc.msg} at character {exc.pos})") from None
    if not isinstance(obj, dict):
        raise MalformedToolCall(f"the call is a JSON {type(obj).__name__}, not an object with \"name\" and "
                                "\"arguments\"")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise MalformedToolCall("the call has no \"name\" string")
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise MalformedToolCall("\"arguments\" is a string that is not a JSON object") from None
    if not isinstance(arguments, dict):
        raise MalformedToolCall(f"\"arguments\" is a JSON {type(arguments).__name__}, not an object")
    return ToolCall(name, arguments)


def format_call(name: str, arguments: dict) -> str:
    """The text of a call as the model writes it (warm-start data, tests), up to and including `</tool_call>`."""
    return f"{CALL_START}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CALL_END}"


def observation_text(output: str, max_chars: int | None = None) -> str:
    """The text appended after a call: the tool's `output` (cut to `max_chars`, saying how much was cut) in the
    template's tool-response turn, ending with the next assistant turn's header."""
    if max_chars is not None and len(output) > max_chars:
        output = f"{output[:max_chars]}... [cut: {len(output) - max_chars} more characters]"
    return RESPONSE_PREFIX + output + RESPONSE_SUFFIX
