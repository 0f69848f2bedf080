"""Streaming detokenization and stop-string matching for generated text.

``IncrementalDetokenizer`` turns a growing list of token ids into text deltas.
Byte-level BPE tokenizers (Qwen, Llama 3, GPT-2 style) split multi-byte UTF-8
characters over several tokens, and decoding a partial character yields U+FFFD.
The detokenizer therefore holds back a trailing run of U+FFFD until the bytes
complete (or until ``flush()`` at the end of generation).

It uses the prefix/read offset technique: every step decodes only a short
window ``ids[prefix_offset:]`` and compares it with the already-emitted part
``ids[prefix_offset:read_offset]``. Decoding a few tokens of context before the
new ones keeps decoder quirks that depend on position (a sentencepiece decoder
strips the leading space of the first token it sees) out of the deltas, and
keeps the per-step cost proportional to the window, not to the output length.

``StopStringMatcher`` runs on the text deltas and cuts the output at the first
completed stop string, holding back text that might still become one.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded as context before the first generated token. Enough
# for the leading-space rules of sentencepiece/BPE decoders; small, so the
# first step stays cheap.
PROMPT_CONTEXT_TOKENS = 5

# Window length (context + new tokens) at which it is cut back to its last
# PROMPT_CONTEXT_TOKENS tokens. Longer windows mean fewer cut-back decodes but
# longer per-step decodes; a decode of ~16 tokens costs about as much as one
# of 2, since the fixed per-call overhead dominates.
WINDOW_TOKENS = 16


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer that this module uses."""

    def decode(self, token_ids: Sequence[int], **kwargs) -> str: ...


def _trailing_replacement_count(text: str) -> int:
    """Number of U+FFFD characters at the very end of ``text``."""
    return len(text) - len(text.rstrip(REPLACEMENT_CHAR))


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, one call per decode step.

    The concatenation of all deltas (``add_tokens`` results and ``flush()``)
    equals ``tokenizer.decode(generated_ids, skip_special_tokens=...)`` for
    byte-level and other prefix-stable decoders whenever the output ends on a
    complete character. Two documented differences from a standalone decode:

    * Sentencepiece (Metaspace) tokenizers: the first delta keeps the space
      of the first generated token, since it is decoded after prompt context;
      a standalone decode of the generated ids would strip it.
    * Decoders that rewrite earlier text (``clean_up_tokenization_spaces``)
      cannot be streamed exactly; text already emitted is never taken back.

    ``skip_special_tokens`` and ``spaces_between_special_tokens`` are passed
    to ``tokenizer.decode`` unchanged (fast tokenizers ignore the latter).

    Cost: each step decodes the window once. A step that ends on a complete
    character makes the whole window the context of the next one (its text is
    the window text just decoded, so that costs no decode); only once the
    window reaches ``WINDOW_TOKENS`` is it cut back to its last
    ``PROMPT_CONTEXT_TOKENS`` tokens, at the price of one more decode. So a
    step costs about 1 + 1/(WINDOW_TOKENS - PROMPT_CONTEXT_TOKENS) decodes of
    at most WINDOW_TOKENS tokens (more only while no step ends on a complete
    character, which valid text does within a few tokens).

    Decoding calls the Rust ``tokenizers`` backend directly when the
    transformers wrapper would add nothing to it (see ``_backend_decode``):
    the wrapper's argument conversion costs more than the decode itself.

    Byte-level decoders (GPT-2, Llama 3, Qwen, SmolLM2) need no context at
    all (``_piece_table``): their window is empty whenever the text so far ends
    on a complete character, and a token whose own text is complete costs one
    lookup in a table shared by the tokenizer's detokenizers, not a decode.

    State: ``_ids`` is the decode window. Tokens before the window were
    dropped, so the classic prefix offset is always 0 here.

    * ``_read_offset``: ``_ids[:read_offset]`` are context tokens whose text
      is fully emitted; that text is ``_prefix_len`` characters long.
    * ``_emitted_past_read``: characters of the window text beyond
      ``_prefix_len`` already emitted. Non-zero only while the window ends in
      an incomplete character: complete characters before it are emitted
      right away, even though their token boundary is not yet clean.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._decode_kwargs = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
        }
        self._backend = _backend_decode(tokenizer)
        # A byte-level decoder's text needs no context (see _piece_table): the
        # window is then empty whenever it ends on a complete character, and
        # a token whose own text is complete is one dictionary lookup.
        self._table = _piece_table(self._backend, skip_special_tokens)
        # The context may start inside a character; that is harmless, as the
        # context decode and every window decode start with the same bytes.
        # int(): the Rust backend takes Python ints only (prompts may be numpy).
        context = [int(t) for t in prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]]
        if self._table is not None:
            context = []
        context_text = self._decode(context) if context else ""
        if context_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character (or on U+FFFD): its bytes
            # would merge with the first generated bytes and break the
            # prefix comparison, so decode the output without context.
            context, context_text = [], ""
        self._ids: list[int] = context
        self._read_offset = len(context)
        self._prefix_len = len(context_text)
        self._emitted_past_read = 0
        self._pieces: list[str] = []
        self._flushed = False

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)
        return self._tokenizer.decode(list(ids), **self._decode_kwargs)

    @property
    def text(self) -> str:
        """All text emitted so far (every delta, concatenated)."""
        return "".join(self._pieces)

    def add_tokens(self, new_ids: Sequence[int]) -> str:
        """Append newly generated token ids; return the newly stable text."""
        if self._flushed:
            # flush() may have emitted a partial character as U+FFFD; bytes
            # completing it now could no longer be rendered consistently.
            raise RuntimeError("add_tokens() after flush()")
        if not new_ids:
            return ""
        table = self._table
        if table is not None and not self._ids and len(new_ids) == 1:
            # Everything so far is emitted and the token's text is complete:
            # it is the delta (the decoder's text of a window is the texts of
            # its tokens run together; see _piece_table).
            piece = table.get(new_ids[0])
            if piece is None:
                piece = self._learn(int(new_ids[0]))
            if piece is not None:
                if piece:
                    self._pieces.append(piece)
                return piece
        self._ids.extend(map(int, new_ids))
        window_text = self._decode(self._ids)
        stable_end = len(window_text) - _trailing_replacement_count(window_text)
        delta = self._take(window_text, stable_end)
        if stable_end == len(window_text):
            # The window ends on a complete character: every token up to
            # here is emitted and becomes context, whose text is window_text.
            if table is not None:
                # No context needed: start the next window empty.
                self._ids, self._read_offset, self._prefix_len = [], 0, 0
            else:
                self._read_offset = len(self._ids)
                self._prefix_len = len(window_text)
            self._emitted_past_read = 0
            if len(self._ids) >= WINDOW_TOKENS:
                self._cut_back()
        return delta

    def _learn(self, token: int) -> str | None:
        """The token's own text, recorded in the shared table; None when it ends inside a
        character (such a token goes through the window, and is decoded again each time)."""
        assert self._table is not None
        piece = self._decode([token])
        if piece.endswith(REPLACEMENT_CHAR):
            return None
        self._table[token] = piece
        return piece

    def flush(self) -> str:
        """End of generation: return everything still held, even incomplete
        characters (shown as U+FFFD). No tokens may be added after it."""
        self._flushed = True
        if self._read_offset == len(self._ids):
            return ""
        window_text = self._decode(self._ids)
        return self._take(window_text, len(window_text))

    def _take(self, window_text: str, end: int) -> str:
        """Emit ``window_text`` from the last emitted position up to ``end``."""
        start = self._prefix_len + self._emitted_past_read
        if end <= start:
            return ""
        delta = window_text[start:end]
        self._emitted_past_read = end - self._prefix_len
        self._pieces.append(delta)
        return delta

    def _cut_back(self) -> None:
        """Keep only the last PROMPT_CONTEXT_TOKENS tokens of a fully read
        window as context, so decodes stay short."""
        context = self._ids[-PROMPT_CONTEXT_TOKENS:]
        context_text = self._decode(context)
        if context_text.endswith(REPLACEMENT_CHAR):
            # Cannot happen for decoders whose text ends depend only on the
            # last tokens' bytes; for any other keep the (correct) long window.
            return
        self._ids = context
        self._read_offset = len(context)
        self._prefix_len = len(context_text)


# (backend, skip_special_tokens) -> _piece_table's dict; keyed by id, the backend held with it so the
# id stays its own.
_TABLES: dict[tuple[int, bool], tuple[object, dict[int, str]]] = {}


def _piece_table(backend, skip_special_tokens: bool) -> dict[int, str] | None:
    """Token id -> its text, shared by every detokenizer of ``backend`` (filled as tokens come),
    when the backend's decoder is byte-level (GPT-2, Llama 3, Qwen, SmolLM2); else None.

    A byte-level decoder maps each token to bytes on its own (a special token skipped: none), joins
    them and decodes the bytes as UTF-8, a malformed part as U+FFFD. So once the text decoded so far
    ends on a complete character, the next bytes decode on their own: the text of ``ids + [t]`` is
    the text of ``ids`` followed by the text of ``[t]``. The detokenizer then needs no context, and
    a token whose text does not end in U+FFFD is its own delta. (Other decoders, such as
    sentencepiece's Metaspace, change a token's text by its position: they keep the window.)"""
    if backend is None or type(getattr(backend, "decoder", None)).__name__ != "ByteLevel":
        return None
    key = (id(backend), bool(skip_special_tokens))
    entry = _TABLES.get(key)
    if entry is None:
        entry = _TABLES[key] = (backend, {})
    return entry[1]


def _backend_decode(tokenizer: Tokenizer):
    """The Rust ``tokenizers.Tokenizer`` behind a transformers fast tokenizer,
    when calling its ``decode`` directly gives exactly ``tokenizer.decode``;
    else None.

    transformers (5.x ``TokenizersBackend._decode``) passes the ids and
    ``skip_special_tokens`` to the backend, ignores
    ``spaces_between_special_tokens``, and then applies
    ``clean_up_tokenization`` only when ``clean_up_tokenization_spaces`` is set
    and the model is not BPE (unless a force flag is set). Anything that could
    take the cleanup path, or is not such a tokenizer, uses the wrapper.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not callable(getattr(backend, "decode", None)):
        return None
    # A subclass that overrides either method may decode differently.
    cls = type(tokenizer)
    if (
        getattr(getattr(cls, "decode", None), "__qualname__", "") != "PreTrainedTokenizerBase.decode"
        or getattr(getattr(cls, "_decode", None), "__qualname__", "") != "TokenizersBackend._decode"
    ):
        return None
    cleanup = getattr(tokenizer, "clean_up_tokenization_spaces", True)
    if cleanup is False:
        return backend
    forced = getattr(
        tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", True
    )
    if type(backend.model).__name__ == "BPE" and forced is False:
        return backend
    return None


def decode_token(tokenizer: Tokenizer, token_id: int) -> str:
    """Display text of one token, for logprobs.

    This is ``tokenizer.decode([token_id])`` with special tokens kept (so
    ``<|im_end|>`` shows as itself), as vLLM reports logprob tokens. A
    byte-level token that holds only part of a UTF-8 character decodes to
    U+FFFD in place of the partial bytes; the exact bytes are not recoverable
    from the string. Unknown ids give "".
    """
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    return text if text is not None else ""


@functools.lru_cache(maxsize=1024)
def _failure_table(pattern: str) -> tuple[int, ...]:
    """KMP failure function: [i] = length of the longest proper prefix of pattern[:i+1] that is
    also its suffix. Shared by every sequence that stops on ``pattern``."""
    fail = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    return tuple(fail)


class StopStringMatcher:
    """Cuts streamed text at the first stop string to complete.

    "First" means the earliest end position in the text; among stop strings
    ending at the same position the one starting earliest (the longest) wins.
    This makes the result independent of how the text is split into deltas.

    Text that could be the start of a stop string is held back until the
    following text rules the stop string in or out. With no stop strings the
    matcher passes every delta through unchanged.

    Each stop string runs as a KMP automaton over the text, one step per new
    character: time and memory are linear in the stop strings' total length and
    the text's, whatever their content (a held-back tail is exactly the longest
    automaton state, the longest suffix of the text that begins a stop string).
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stops: list[str] = list(dict.fromkeys(stop))  # dedupe, keep order
        self._fails = [_failure_table(s) for s in self._stops]
        self._states = [0] * len(self._stops)  # matched prefix length of each stop string
        self._include = include_stop_str_in_output
        self._held = ""
        self.matched: str | None = None  # the stop string that ended the output

    @property
    def finished(self) -> bool:
        """True once a stop string matched; later feeds return nothing."""
        return self.matched is not None

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Add text; return (text safe to emit now, matched stop string or None)."""
        if self.finished:
            return "", None
        if not self._stops:
            return delta, None
        buf = self._held + delta
        states = self._states
        for i, ch in enumerate(delta):
            done = None
            for j, stop in enumerate(self._stops):
                k, fail = states[j], self._fails[j]
                while k and stop[k] != ch:
                    k = fail[k - 1]
                if stop[k] == ch:
                    k += 1
                if k == len(stop):  # ends here; of those ending here the longest starts first
                    if done is None or len(stop) > len(done):
                        done = stop
                    k = fail[k - 1]
                states[j] = k
            if done is not None:
                self.matched = done
                self._held = ""
                end = len(buf) - len(delta) + i + 1  # just past this character
                start = end - len(done)
                return buf[: end if self._include else start], done
        hold = max(states)
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], None

    def flush(self) -> str:
        """Release held text when generation ends without a stop string."""
        held, self._held = self._held, ""
        return held
