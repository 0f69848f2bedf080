"""Grammar-constrained decoding with xgrammar.

The engine's contract (``LLMEngine(grammar_factory=make_grammar_matcher)``): for a request with
``structured_outputs`` it builds one matcher per sequence and, before each sampled token, asks for
``fill_bitmask()`` (an int32 array of ``ceil(vocab_size / 32)`` words; bit ``i % 32`` of word
``i // 32`` set = token ``i`` allowed), then ``accept(token)``; it ends the request once
``is_terminated()``.

Compiling a grammar is the slow part, so compiled grammars are cached: one ``GrammarCompiler`` per
(tokenizer, vocab size), each with xgrammar's own cache keyed by the grammar's text. The HTTP server
calls :func:`compile_structured_output` on a grammar lane of its own (server/serving_common.py), with
a deadline, before it hands a request to the engine, so the engine thread only hits the cache; the
same call turns bad schemas into a 400 early. xgrammar releases the GIL while it compiles, so a slow
compile costs CPU, not the engine's or the tokenizer's turn.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np

from tpuserve.server.sampling_params import StructuredOutputParams

_compilers: dict[tuple[int, int], Any] = {}
_compilers_lock = threading.Lock()


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def _compiler(tokenizer, vocab_size: int):
    """The (cached) xgrammar GrammarCompiler for this tokenizer and model vocabulary size."""
    import xgrammar as xgr

    key = (id(tokenizer), int(vocab_size))
    with _compilers_lock:
        entry = _compilers.get(key)
        if entry is None or entry[0] is not tokenizer:
            # The model's vocab_size may exceed the tokenizer's (padded embeddings): xgrammar masks
            # the ids past the tokenizer's end.
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=int(vocab_size))
            entry = (tokenizer, xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True))
            _compilers[key] = entry
        return entry[1]


# xgrammar's compile time grows steeply with a JSON schema's nesting: 64 nested objects compile in
# ~0.06 s, 900 nested arrays in ~35 s of two busy cores. Real schemas nest a few dozen levels.
MAX_SCHEMA_DEPTH = 128


def _nesting_depth(value) -> int:
    """Depth of nested objects / arrays in a JSON value (iterative: no recursion limit to hit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        children: Iterable[Any]
        if isinstance(v, dict):
            children = v.values()
        elif isinstance(v, list):
            children = v
        else:
            continue
        deepest = max(deepest, d)
        stack.extend((c, d + 1) for c in children)
    return deepest


def _schema_text(schema: dict | str, what: str = "json schema") -> str:
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"{what}: not valid JSON ({e})") from e
    else:
        parsed = schema
    depth = _nesting_depth(parsed)
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(
            f"{what}: nested {depth} levels deep, over this server's limit of "
            f"{MAX_SCHEMA_DEPTH} (its grammar would take too long to compile)"
        )
    return schema if isinstance(schema, str) else json.dumps(schema)


def compile_structured_output(params: StructuredOutputParams, tokenizer, vocab_size: int):
    """Compile (or fetch from the cache) the grammar for ``params``. Raises ValueError naming the
    bad field when the schema, regex or grammar does not compile."""
    params.validate()
    # Checked before the compiler exists (building it for a new tokenizer takes seconds).
    schema_text = _schema_text(params.json) if params.json is not None else None
    compiler = _compiler(tokenizer, vocab_size)
    field = (
        "json"
        if params.json is not None
        else "json_object"
        if params.json_object
        else "regex"
        if params.regex is not None
        else "grammar"
    )
    try:
        if params.json is not None:
            # Compact JSON (no free whitespace between tokens): small models otherwise tend to loop
            # on whitespace until max_tokens, leaving unparseable output.
            compiled = compiler.compile_json_schema(schema_text, any_whitespace=False)
        elif params.json_object:
            compiled = compiler.compile_builtin_json_grammar()
        elif params.regex is not None:
            compiled = compiler.compile_regex(params.regex)
        else:
            compiled = compiler.compile_grammar(params.grammar)
    except ValueError:
        raise
    except Exception as e:  # xgrammar reports parse errors as RuntimeError with a C++ prefix
        raise ValueError(f"structured_outputs.{field}: does not compile: {_short_error(e)}") from e
    if not _admits_a_first_token(compiled, vocab_size):
        # e.g. the regex [^\s\S], a schema that is only a $ref to itself: decoding would sample
        # from an empty mask, so refuse before any token is generated.
        raise ValueError(f"structured_outputs.{field}: matches no text (the grammar admits no first token)")
    return compiled


def _admits_a_first_token(compiled, vocab_size: int) -> bool:
    """Whether a fresh matcher of ``compiled`` allows any token (end of text included)."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    mask = np.full((1, bitmask_words(vocab_size)), -1, dtype=np.int32)
    matcher.fill_next_token_bitmask(mask, 0)
    return bool(mask.any()) or bool(matcher.is_terminated())


def _short_error(e: Exception) -> str:
    text = str(e).strip()
    # "[23:09:37] /project/cpp/regex_converter.cc:83: Regex parsing error ..." -> the message part
    if text.startswith("[") and ": " in text:
        parts = text.split(": ", 1)
        if ".cc:" in parts[0] or ".h:" in parts[0]:
            text = parts[1]
    return text.splitlines()[0] if text else type(e).__name__


class GrammarMatcher:
    """One sequence's grammar state (the engine's matcher contract)."""

    def __init__(self, compiled, vocab_size: int):
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = np.empty((1, bitmask_words(vocab_size)), dtype=np.int32)

    def fill_bitmask(self) -> np.ndarray:
        self._bitmask.fill(-1)
        self._matcher.fill_next_token_bitmask(self._bitmask, 0)
        return self._bitmask[0].copy()

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(int(token_id)))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepts (speculation: the masks of draft positions)."""
        self._matcher.rollback(int(num_tokens))

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


def make_grammar_matcher(params: StructuredOutputParams, tokenizer, vocab_size: int) -> GrammarMatcher:
    return GrammarMatcher(compile_structured_output(params, tokenizer, vocab_size), vocab_size)


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of ``choices`` (vLLM's ``structured_outputs.choice``)."""
    import re

    if not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("structured_outputs.choice: must be a non-empty list of strings")
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def tool_call_grammar(tools: list[dict]) -> str:
    """EBNF text for one or more Hermes-style tool calls
    ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` restricted to ``tools``
    (each ``{"name", "parameters"}``); used for ``tool_choice`` "required" or a named function."""
    import xgrammar as xgr

    if not tools:
        raise ValueError("tools: tool_choice needs at least one tool")
    variants = []
    for t in tools:
        params = t.get("parameters") or {"type": "object"}
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": t["name"]}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    text = _schema_text(schema, what="tools: the functions' parameters schema")
    try:
        body = xgr.Grammar.from_json_schema(text, any_whitespace=False)
    except Exception as e:
        raise ValueError(f"tools: a function's parameters schema does not compile: {_short_error(e)}") from e
    call = xgr.Grammar.concat(
        xgr.Grammar.from_ebnf('root ::= "<tool_call>\\n"'),
        body,
        xgr.Grammar.from_ebnf('root ::= "\\n</tool_call>"'),
    )
    return str(call)
