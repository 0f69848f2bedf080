"""Hermes-style tool-call parsing: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Qwen2.5/Qwen3, Hermes and SmolLM2-style chat templates ask the model to answer a tool call in this
form. :func:`parse_tool_calls` splits a finished text into plain content and tool calls;
:class:`StreamingToolParser` does the same on text deltas, holding back text that might still turn
into a ``<tool_call>`` tag and emitting each call whole once its closing tag (or the end) arrives.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

START = "<tool_call>"
END = "</tool_call>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it
    id: str = ""

    def __post_init__(self):
        if not self.id:
            self.id = f"call_{uuid.uuid4().hex[:24]}"


def _parse_call(body: str) -> ToolCall | None:
    """One call's JSON body -> ToolCall, or None when it is not a well-formed call."""
    try:
        obj = json.loads(body.strip())
    except (json.JSONDecodeError, ValueError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (json.JSONDecodeError, ValueError):
            return ToolCall(obj["name"], args)
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """Split ``text`` into (content, tool calls). Without a well-formed call, everything is content."""
    if START not in text:
        return text, []
    content_parts, calls = [], []
    pos = 0
    while True:
        start = text.find(START, pos)
        if start < 0:
            content_parts.append(text[pos:])
            break
        content_parts.append(text[pos:start])
        end = text.find(END, start)
        body = text[start + len(START) : end if end >= 0 else len(text)]
        call = _parse_call(body)
        if call is None:  # malformed: keep the raw text as content
            content_parts.append(text[start : end + len(END) if end >= 0 else len(text)])
        else:
            calls.append(call)
        if end < 0:
            break
        pos = end + len(END)
    if not calls:
        return text, []
    content = "".join(content_parts).strip()
    return (content or None), calls


def _partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


@dataclass
class ToolDelta:
    """What one streamed text delta turns into: plain content and/or completed tool calls."""

    content: str = ""
    calls: list[ToolCall] | None = None


class StreamingToolParser:
    """Feed text deltas; get content deltas and whole tool calls as soon as they are complete."""

    def __init__(self) -> None:
        self._buf = ""  # text not yet emitted: a possible tag start, or a call body in progress
        self._in_call = False
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> ToolDelta:
        self._buf += delta
        out = ToolDelta()
        new_calls: list[ToolCall] = []
        while True:
            if not self._in_call:
                start = self._buf.find(START)
                if start < 0:
                    keep = _partial_tag_suffix(self._buf, START)
                    out.content += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                out.content += self._buf[:start]
                self._buf = self._buf[start + len(START) :]
                self._in_call = True
            end = self._buf.find(END)
            if end < 0:
                break
            body, self._buf = self._buf[:end], self._buf[end + len(END) :]
            self._in_call = False
            call = _parse_call(body)
            if call is None:
                out.content += START + body + END
            else:
                new_calls.append(call)
        if new_calls:
            self.calls.extend(new_calls)
            out.calls = new_calls
        return out

    def flush(self) -> ToolDelta:
        """End of output: an unclosed call still counts if its body parses; otherwise it is text."""
        out = ToolDelta()
        if self._in_call:
            call = _parse_call(self._buf)
            if call is None:
                out.content = START + self._buf
            else:
                self.calls.append(call)
                out.calls = [call]
        else:
            out.content = self._buf
        self._buf, self._in_call = "", False
        return out


def tools_system_prompt(tools: list[dict]) -> str:
    """A Hermes-style system block describing ``tools``, for chat templates that do not render
    tools themselves (so that the model still learns how to call them)."""
    lines = [
        "# Tools",
        "",
        "You may call one or more functions to assist with the user query.",
        "",
        "You are provided with function signatures within <tools></tools> XML tags:",
        "<tools>",
    ]
    lines += [json.dumps(t, ensure_ascii=False) for t in tools]
    lines += [
        "</tools>",
        "",
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:",
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>',
    ]
    return "\n".join(lines)
