"""Tool calls parsed from a policy's text, and the error turn a malformed call gets.

A call sits between ``<tool_call>`` and ``</tool_call>`` in one of two forms (whitespace anywhere is ignored,
so word-level tokenizers that decode with spaces work too):

- JSON, as Qwen2.5 / Hermes chat templates write it: ``<tool_call>{"name": "zoom", "arguments": {"quadrant":
  "top_left"}}</tool_call>``;
- a call expression: ``<tool_call>zoom(top_left)</tool_call>`` or ``zoom(quadrant=top_left)``; positional
  values fill the tool's parameters in order.

Anything else inside the tags (bad JSON, an unknown tool, a missing or unknown argument, a value outside
the allowed ones, an unclosed tag) raises :class:`ToolCallError`, whose message is written for the policy:
the environment returns it as the next turn, so the episode goes on and the error is counted.

The message never repeats the policy's text, except a tool or argument name that is a plain identifier
(``[A-Za-z_][A-Za-z0-9_]*``, at most 32 characters): the error turn is rendered and tokenized as an
environment turn, where an echoed ``{image}`` would ask for an image that is not there and an echoed
``<|im_end|>`` would be read as a special token. JSON calls are parsed with bounded nesting.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from flowrl.untrusted import loads_json

__all__ = ["ToolSpec", "ToolCall", "ToolCallError", "parse_tool_calls", "extract_answer", "extract_trace",
           "has_tool_call"]

_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)
_CALL = re.compile(r"^\s*([A-Za-z_]\w*)\s*\((.*)\)\s*$", re.S)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_THINK = re.compile(r"<think>(.*?)</think>", re.S)
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,31}")
MAX_CALL_DEPTH = 8  # {"name": ..., "arguments": {...}} is 2 deep


class ToolCallError(ValueError):
    """A malformed tool call; ``str(err)`` is the error turn shown to the policy."""


@dataclass(frozen=True)
class ToolSpec:
    """A tool's name and parameters; ``choices[p]`` lists the values parameter ``p`` accepts (None: any string)."""

    name: str
    params: tuple[str, ...]
    choices: dict[str, tuple[str, ...] | None] = field(default_factory=dict)

    def usage(self) -> str:
        args = ", ".join("|".join(self.choices[p]) if self.choices.get(p) else p for p in self.params)
        return f"{self.name} ( {args} )"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


def has_tool_call(text: str) -> bool:
    return "<tool_call>" in text


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _named(text: Any) -> str:
    """``text`` for an error turn when it is a plain identifier, else nothing (the policy's text is never echoed)."""
    text = str(text)
    return f" {text}" if _IDENTIFIER.fullmatch(text) else ""


def _json(text: str, what: str) -> Any:
    try:
        return loads_json(text, max_depth=MAX_CALL_DEPTH)
    except ValueError:  # invalid, or nested deeper than any tool call
        raise ToolCallError(f"error : {what} not valid json") from None


def _parse_one(body: str, tools: dict[str, ToolSpec]) -> ToolCall:
    body = body.strip()
    if not body:
        raise ToolCallError("error : empty tool call")
    if body.startswith("{"):
        data = _json(body, "the tool call is")
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            raise ToolCallError("error : a json tool call needs a name")
        name, arguments = data["name"], data.get("arguments", {})
        if isinstance(arguments, str):  # some templates send the arguments JSON-encoded
            arguments = _json(arguments, "the tool arguments are")
        if not isinstance(arguments, dict):
            raise ToolCallError("error : tool arguments must be a mapping")
        arguments = {str(k): v for k, v in arguments.items()}
    else:
        match = _CALL.match(body)
        if match is None:
            raise ToolCallError("error : write a tool call as name ( arguments )")
        name, raw = match.group(1), match.group(2)
        parts = [p for p in (_squash(x) for x in raw.split(",")) if p] if raw.strip() else []
        arguments, positional = {}, []
        for part in parts:
            if "=" in part:
                key, _, value = part.partition("=")
                arguments[key] = value.strip("\"'")
            else:
                positional.append(part.strip("\"'"))
        spec = tools.get(name)
        if spec is not None:
            if len(positional) > len(spec.params):
                raise ToolCallError(f"error : too many arguments ; use {spec.usage()}")
            for param, value in zip(spec.params, positional):
                arguments.setdefault(param, value)
    spec = tools.get(name)
    if spec is None:
        raise ToolCallError(f"error : unknown tool{_named(name)} ; tools : "
                            f"{' , '.join(t.usage() for t in tools.values())}")
    unknown = [k for k in arguments if k not in spec.params]
    if unknown:
        raise ToolCallError(f"error : unknown argument{_named(unknown[0])} ; use {spec.usage()}")
    missing = [p for p in spec.params if p not in arguments]
    if missing:
        raise ToolCallError(f"error : missing argument {missing[0]} ; use {spec.usage()}")
    for param, allowed in spec.choices.items():
        if allowed is not None and str(arguments[param]) not in allowed:
            raise ToolCallError(f"error : bad {param} ; use {spec.usage()}")
    return ToolCall(name, arguments)


def parse_tool_calls(text: str, tools: list[ToolSpec] | dict[str, ToolSpec]) -> list[ToolCall]:
    """Every tool call in ``text`` (empty when there is none).

    Raises:
        ToolCallError: a call is malformed (the message is the error turn for the policy).
    """
    tools = tools if isinstance(tools, dict) else {t.name: t for t in tools}
    calls = []
    for match in _BLOCK.finditer(text):
        if not match.group(2):
            raise ToolCallError("error : close the tool call with </tool_call>")
        calls.append(_parse_one(match.group(1), tools))
    return calls


def extract_answer(text: str) -> str:
    """The answer in a policy's final turn: the content of ``<answer>...</answer>`` if present, else the text
    without ``<think>...</think>`` blocks."""
    match = _ANSWER.search(text)
    if match:
        return match.group(1).strip()
    return _THINK.sub("", text).strip()


def extract_trace(text: str) -> str | None:
    """The reasoning trace in a policy's turn: the content of its first ``<think>...</think>``, or ``None``."""
    match = _THINK.search(text)
    return match.group(1).strip() if match else None
