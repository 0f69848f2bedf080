"""gpt-oss's harmony output: generated token ids -> reasoning, content and tool calls.

gpt-oss answers in messages (the chat template's prompt ends with ``<|start|>assistant``)::

    <|channel|>analysis<|message|>...reasoning...<|end|>
    <|start|>assistant<|channel|>final<|message|>...answer...<|return|>
    <|start|>assistant to=functions.NAME<|channel|>commentary <|constrain|>json<|message|>{...}<|call|>

A message's header runs from ``<|start|>`` (or the start of the output) to ``<|message|>``: the
role, the ``<|channel|>`` name, an optional recipient ``to=...`` (before or after the channel) and
an optional content type. Its body runs to ``<|end|>``, ``<|return|>`` or ``<|call|>``. The
special tokens are not text, so this reads token ids, not detokenized text; bodies are decoded
with the engine's incremental detokenizer, so a stream splits no character.

Mapped to the chat API as vLLM and SGLang do: the ``analysis`` channel is the reasoning, a
message to ``functions.NAME`` is a tool call whose body is its arguments, anything else
(``final``, a ``commentary`` preamble) is content. Output that is not harmony at all (no header
marker before the end) is returned as content, so no text is lost.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from tpuserve.server.detokenizer import IncrementalDetokenizer
from tpuserve.server.tool_parser import ToolCall

# The harmony special tokens this parser reads, by their text in the tokenizer's vocabulary.
_SPECIALS = {
    "start": "<|start|>",
    "end": "<|end|>",
    "message": "<|message|>",
    "channel": "<|channel|>",
    "constrain": "<|constrain|>",
    "return_": "<|return|>",
    "call": "<|call|>",
}
FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"to=([^\s<]+)")  # up to a space or the next marker


@dataclass(frozen=True)
class HarmonyTokens:
    """The ids of the harmony special tokens in one tokenizer."""

    start: int
    end: int
    message: int
    channel: int
    constrain: int
    return_: int
    call: int

    @classmethod
    def of(cls, tokenizer) -> HarmonyTokens | None:
        """The tokenizer's harmony ids, or None when it lacks any of them (not a gpt-oss one)."""
        vocab = tokenizer.get_vocab()
        ids = {name: vocab.get(text) for name, text in _SPECIALS.items()}
        if any(i is None for i in ids.values()):
            return None
        return cls(**ids)  # type: ignore[arg-type]

    @property
    def terminators(self) -> frozenset[int]:
        return frozenset((self.end, self.return_, self.call))


@dataclass
class HarmonyDelta:
    """What newly generated tokens add: reasoning text, content text, whole tool calls."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def extend(self, other: HarmonyDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls


@dataclass
class _Header:
    channel: str | None
    recipient: str | None

    @property
    def function(self) -> str | None:
        r = self.recipient
        return r[len(FUNCTIONS) :] if r and r.startswith(FUNCTIONS) else None


class HarmonyParser:
    """Feed generated token ids (any number at a time); get what they add as a HarmonyDelta."""

    def __init__(self, tokenizer, tokens: HarmonyTokens) -> None:
        self._tok = tokenizer
        self._t = tokens
        self._in_body = False
        self._header: list[int] = []  # ids since the last <|start|> (or the output's start)
        self._saw_marker = False  # a <|channel|> / <|constrain|> / <|start|> in this header
        self._current: _Header | None = None
        self._body: list[int] = []  # a tool call's argument ids
        self._detok: IncrementalDetokenizer | None = None
        self.calls: list[ToolCall] = []

    def feed(self, token_ids: Sequence[int]) -> HarmonyDelta:
        out = HarmonyDelta()
        for tid in token_ids:
            tid = int(tid)
            if self._in_body:
                if tid in self._t.terminators or tid == self._t.start:
                    out.extend(self._end_message())
                    self._saw_marker = tid == self._t.start
                else:
                    if self._current is not None and self._current.function is None:
                        self._emit(out, self._body_detok().add_tokens([tid]))
                    else:
                        self._body.append(tid)  # a call's arguments: decoded whole at its end
            elif tid == self._t.message:
                self._current = self._parse_header()
                self._header, self._in_body, self._body = [], True, []
                self._detok = None
            elif tid == self._t.start:
                self._header, self._saw_marker = [], True  # a new message; drop a half header
            else:
                if tid in (self._t.channel, self._t.constrain):
                    self._saw_marker = True
                self._header.append(tid)
        return out

    def flush(self) -> HarmonyDelta:
        """The output ended: finish a message cut short; a header never closed is dropped, unless
        the output held no harmony marker at all (then its text is content)."""
        out = HarmonyDelta()
        if self._in_body:
            out.extend(self._end_message(cut=True))
        elif self._header and not self._saw_marker:
            out.content += self._decode(self._header)
        self._header = []
        return out

    # ---- internals ----

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def _body_detok(self) -> IncrementalDetokenizer:
        if self._detok is None:
            self._detok = IncrementalDetokenizer(self._tok, [], skip_special_tokens=True)
        return self._detok

    def _parse_header(self) -> _Header:
        """Header ids -> channel and recipient. The header's text with the markers kept in it
        reads e.g. ``assistant to=functions.f<|channel|>commentary <|constrain|>json``."""
        text = self._tok.decode(self._header, skip_special_tokens=False)
        recipient = _RECIPIENT.search(text)
        channel = None
        if "<|channel|>" in text:
            after = text.split("<|channel|>", 1)[1].split("<|constrain|>", 1)[0]
            words = after.split()
            channel = words[0] if words else None
        return _Header(channel=channel, recipient=recipient.group(1) if recipient else None)

    def _emit(self, out: HarmonyDelta, text: str) -> None:
        """A body's text so far: reasoning on the analysis channel, else content."""
        h = self._current
        if not text or h is None:
            return
        if h.channel == "analysis":
            out.reasoning += text
        else:
            out.content += text

    def _end_message(self, cut: bool = False) -> HarmonyDelta:
        out = HarmonyDelta()
        h, detok = self._current, self._detok
        tail = detok.flush() if detok is not None else ""
        if h is not None and h.function is not None:
            args = self._decode(self._body)
            if cut and not _is_json(args):
                out.content += args  # a call cut off mid-arguments: keep its text, make no call
            else:
                call = ToolCall(h.function, args.strip())
                self.calls.append(call)
                out.calls.append(call)
        else:
            self._emit(out, tail)
        self._in_body, self._current, self._body, self._detok = False, None, [], None
        self._header = []
        return out


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def parse_harmony(tokenizer, tokens: HarmonyTokens, token_ids: Sequence[int]) -> HarmonyDelta:
    """A whole output at once (the non-streaming response)."""
    parser = HarmonyParser(tokenizer, tokens)
    out = parser.feed(token_ids)
    out.extend(parser.flush())
    return out
