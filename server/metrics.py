"""Prometheus metrics, named as vLLM names them where the meaning matches.

Each app gets its own ``CollectorRegistry`` (never the process-global one), so several servers or
test apps in one process do not clash. Gauges and token counters are read from the engine snapshot
the engine thread publishes after every step; latency histograms are fed by the engine thread as
tokens come out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tpuserve.server.async_engine import EngineSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class _EngineCollector(Collector):
    """Reads the engine snapshot at scrape time."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str):
        self._snapshot = snapshot
        self._labels = {"model_name": model_name}

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(self._labels))
        g.add_metric(list(self._labels.values()), value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=list(self._labels))
        c.add_metric(list(self._labels.values()), value)
        return c

    def collect(self) -> Iterable:
        s = self._snapshot()
        yield self._gauge("vllm:num_requests_running", "Requests in model execution batches.", s.num_running)
        yield self._gauge("vllm:num_requests_waiting", "Requests waiting to be processed.", s.num_waiting)
        yield self._gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage
        )
        yield self._gauge("tpuserve:kv_cache_free_blocks", "Free KV-cache pages.", s.free_blocks)
        yield self._gauge("tpuserve:kv_cache_total_blocks", "Usable KV-cache pages.", s.total_blocks)
        yield self._gauge(
            "tpuserve:compiled_programs",
            "XLA programs compiled so far (should stay flat after warm-up).",
            s.compiled_programs,
        )
        yield self._gauge(
            "tpuserve:warmup_remaining",
            "Compile tasks of the background warm-up still to finish (0: every shape bucket is compiled).",
            s.warmup_remaining,
        )
        yield self._counter(
            "vllm:prefix_cache_queries", "Prefix-cache queries, in tokens.", s.prefix_cache_queries
        )
        yield self._counter("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.", s.prefix_cache_hits)
        # The host tier is our "external" cache, as vLLM names a KV connector's prefix hits.
        yield self._counter(
            "vllm:external_prefix_cache_queries",
            "Host-tier prefix-cache queries, in tokens.",
            s.host_cache_queries,
        )
        yield self._counter(
            "vllm:external_prefix_cache_hits", "Host-tier prefix-cache hits, in tokens.", s.host_cache_hits
        )
        yield self._counter(
            "tpuserve:host_cache_bytes_loaded",
            "KV bytes copied from the host tier to the device.",
            s.host_bytes_loaded,
        )
        yield self._counter(
            "tpuserve:host_cache_bytes_saved",
            "KV bytes copied from the device to the host tier.",
            s.host_bytes_saved,
        )
        if s.spec_accepted_per_pos:  # speculative decoding is on
            yield self._counter(
                "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", s.spec_num_drafts
            )
            yield self._counter(
                "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", s.spec_num_draft_tokens
            )
            yield self._counter(
                "vllm:spec_decode_num_accepted_tokens",
                "Number of accepted tokens.",
                s.spec_num_accepted_tokens,
            )
            per_pos = CounterMetricFamily(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                labels=[*self._labels, "position"],
            )
            for j, n in enumerate(s.spec_accepted_per_pos):
                per_pos.add_metric([*self._labels.values(), str(j)], n)
            yield per_pos
        if s.routed_per_replica:  # data parallel
            routed = CounterMetricFamily(
                "tpuserve:data_parallel_requests_routed",
                "Requests the prefix-cache-aware router sent to each data-parallel replica.",
                labels=[*self._labels, "replica"],
            )
            for i, n in enumerate(s.routed_per_replica):
                routed.add_metric([*self._labels.values(), str(i)], n)
            yield routed
        yield self._counter("vllm:prompt_tokens", "Prefill tokens processed.", s.prompt_tokens)
        yield self._counter("vllm:generation_tokens", "Generation tokens processed.", s.generation_tokens)


class ServerMetrics:
    def __init__(self, model_name: str, snapshot: Callable[[], EngineSnapshot]):
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
        self.registry.register(_EngineCollector(snapshot, model_name))
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token in seconds.",
            labels,
            registry=self.registry,
            buckets=_TTFT_BUCKETS,
        ).labels(model_name)
        self._itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Inter-token latency in seconds.",
            labels,
            registry=self.registry,
            buckets=_ITL_BUCKETS,
        ).labels(model_name)
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency in seconds.",
            labels,
            registry=self.registry,
            buckets=_E2E_BUCKETS,
        ).labels(model_name)
        self._success = Counter(
            "vllm:request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )

    # Called from the engine thread (prometheus_client metrics are thread-safe).
    def observe_first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_inter_token(self, seconds: float, count: int = 1) -> None:
        for _ in range(count):
            self._itl.observe(seconds)

    def observe_finished(self, e2e_seconds: float, finish_reason: str | None) -> None:
        self._e2e.observe(e2e_seconds)
        self._success.labels(self.model_name, finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
