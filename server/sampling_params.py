"""Per-request sampling parameters, named and defaulted as vLLM's ``SamplingParams``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Bounds on stop strings (vLLM sets none): a request's stop strings cost the engine time and memory
# in proportion to their total length, so one request must not bring megabytes of them.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 4096
MAX_STOP_TOTAL_CHARS = 16384


@dataclass
class StructuredOutputParams:
    """Constrain output to a grammar: exactly one of json (schema dict or str), json_object, regex, grammar."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None

    def validate(self) -> None:
        chosen = [self.json is not None, self.json_object, self.regex is not None, self.grammar is not None]
        if sum(chosen) != 1:
            raise ValueError("structured_outputs: give exactly one of json, json_object, regex, grammar")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputParams | None = None
    extra_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self, max_logprobs: int | None = None) -> None:
        """Raise ValueError naming the first bad parameter."""

        def need(cond: bool, name: str, msg: str):
            if not cond:
                raise ValueError(f"{name} {msg}, got {getattr(self, name)!r}")

        need(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1")
        need(self.temperature >= 0.0, "temperature", "must be >= 0")
        need(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        need(
            isinstance(self.top_k, int) and self.top_k >= 0,
            "top_k",
            "must be -1, 0 (off) or a positive integer",
        )
        need(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        need(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens",
            "must be an integer >= 1",
        )
        need(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "must be >= 0")
        need(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            "must be <= max_tokens",
        )
        need(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        need(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        need(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "must be in (0, 2]")
        need(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer")
        # __post_init__ made both lists (the fields also take a str or None at construction).
        stop, stop_ids = self.stop, self.stop_token_ids
        assert isinstance(stop, list) and isinstance(stop_ids, list)
        # Checked before anything echoes the value: an error message must not carry megabytes.
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        if not all(isinstance(s, str) for s in stop):
            raise ValueError("stop: must be non-empty strings")
        longest = max((len(s) for s in stop), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise ValueError(
                f"stop: each stop string may have at most {MAX_STOP_STRING_CHARS} "
                f"characters, got one of {longest}"
            )
        total = sum(len(s) for s in stop)
        if total > MAX_STOP_TOTAL_CHARS:
            raise ValueError(
                f"stop: the stop strings may have at most {MAX_STOP_TOTAL_CHARS} "
                f"characters in all, got {total}"
            )
        need(all(stop), "stop", "must be non-empty strings")
        need(
            all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_ids),
            "stop_token_ids",
            "must be non-negative integers",
        )
        limit = 1024 if max_logprobs is None else max_logprobs
        need(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= limit),
            "logprobs",
            f"must be in [0, {limit}]",
        )
        need(
            self.prompt_logprobs is None
            or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= limit),
            "prompt_logprobs",
            f"must be in [0, {limit}]",
        )
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
