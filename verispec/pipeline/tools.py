"""Tool calls in a chat model's own format: the tools rendered by its chat template, the calls it writes parsed back,
and the grammar that makes it call (verispec.core.grammar) where a caller requires a call.

One format is read: the Hermes format of Qwen2.5, Qwen3 and Hermes models, each call a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>` lines, several calls one after another. A
chat template is taken to write it when it mentions `<tool_call>` and renders `tools`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from verispec.core.grammar import JSON_OPTIONS, Constraint

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call: its id (made here, as OpenAI's `call_...`), the function's name and its arguments as JSON text."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolFormat:
    """The Hermes tool-call format of a tokenizer's chat template; `markers_are_tokens`: `<tool_call>` and
    `</tool_call>` are single tokens of its vocabulary (a grammar then names them as tokens, as the model writes
    them)."""

    markers_are_tokens: bool

    @staticmethod
    def of(tokenizer) -> ToolFormat | None:
        """The template's format, or None where it renders no tools or writes calls some other way."""
        template = getattr(tokenizer, "chat_template", None)
        if not isinstance(template, str) or OPEN not in template or "tools" not in template:
            return None
        vocab = tokenizer.get_vocab()
        return ToolFormat(OPEN in vocab and CLOSE in vocab)

    def constraint(self, tools: Sequence[Mapping[str, Any]], parallel: bool) -> Constraint:
        """A grammar that admits calls only: one (or, `parallel`, one or more) of these functions (OpenAI's
        {"type": "function", "function": {"name", "parameters"}}), each call's arguments valid under the function's
        parameters schema."""
        bodies = []
        for tool in tools:
            function = tool["function"]
            parameters = function.get("parameters") or {"type": "object", "properties": {}}
            call = {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
                    "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": JSON_OPTIONS}
            bodies.append(f"%json {json.dumps(call)}")
        open_, close = (OPEN, CLOSE) if self.markers_are_tokens else (json.dumps(OPEN), json.dumps(CLOSE))
        more = ' ("\\n" call)*' if parallel else ""
        rules = [f"start: call{more}",
                 f'call: {open_} "\\n" body "\\n" {close}',
                 "body: " + " | ".join(f"f{i}" for i in range(len(bodies)))]
        rules += [f"f{i}: {body}" for i, body in enumerate(bodies)]
        return Constraint("grammar", "\n".join(rules) + "\n")


def parse_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """The text's content (what is not a call, stripped; None when nothing) and its calls, in order. Text whose
    calls do not all parse (a JSON object with a string `name` and object `arguments`) is content, with no calls."""
    calls = []
    for match in _CALL.finditer(text):
        try:
            body = json.loads(match.group(1))
        except ValueError:
            return text, []
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            return text, []
        arguments = body.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return text, []
        if not isinstance(arguments, dict):
            return text, []
        calls.append(ToolCall("call_" + uuid.uuid4().hex[:24], body["name"], json.dumps(arguments)))
    if not calls:
        return text, []
    content = _CALL.sub("", text).strip()
    return content or None, calls


def may_start_call(text: str) -> int:
    """Where a call may begin in streamed `text` (its index), or -1: the text from there is held back until it is
    known whether it is a call; a tail that is a proper prefix of `<tool_call>` may still become one."""
    at = text.find(OPEN)
    if at >= 0:
        return at
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return len(text) - n
    return -1


def history_message(message: Mapping[str, Any]) -> dict:
    """An OpenAI chat message as chat templates read it: an assistant's tool calls with their arguments as objects
    (OpenAI sends them as JSON text), a tool's answer with its call's id."""
    out = {"role": message["role"], "content": message.get("content")}
    if message.get("tool_calls"):
        out["tool_calls"] = [{"id": call.get("id"), "type": "function",
                              "function": {"name": call["function"]["name"],
                                           "arguments": _arguments(call["function"].get("arguments"))}}
                             for call in message["tool_calls"]]
    if message.get("tool_call_id") is not None:
        out["tool_call_id"] = message["tool_call_id"]
    return out


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments if arguments is not None else {}
