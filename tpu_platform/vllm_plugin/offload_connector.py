"""``TpuserveHostOffloadConnector``: vLLM's KV connector interface over our host tier.

vLLM's own CPU offloading (``OffloadingConnector``) copies torch device tensors with CUDA streams
and refuses other platforms. On ours, ``--kv-offloading-size GiB`` selects this connector instead
(``platform.py``); it keeps full KV blocks in host memory, keyed by vLLM's prefix-cache block
hashes (``Request.block_hashes``), and brings them back when vLLM's device prefix cache no longer
has them.

Who decides what: the **scheduler side** owns the bookkeeping (``HostSlotIndex``: block hash ->
host slot, an LRU, pins) and writes every transfer into the step's metadata as *slot numbers*;
the **worker side** owns the bytes (``HostPagePool``) and does exactly what the metadata says.
The two views cannot drift, whether they share a process (vLLM's ``uni`` executor, which our
platform uses) or not: the worker never chooses a slot, and it runs each step's transfers in the
order the scheduler planned them.

One step, in order:

* scheduler: ``get_num_new_matched_tokens`` counts the leading blocks past vLLM's device hit that
  the host holds (whole blocks; never the block holding the prompt's last token, so at least one
  token is computed). ``update_state_after_alloc`` records ``(slot, block id)`` loads into the
  blocks vLLM just allocated and pins those slots. ``build_connector_meta`` emits the loads, then
  the stores: every full block of a scheduled request, up to what the step computes, whose hash
  the host lacks (write-through; a slot is taken from the LRU if none is free), then unpins.
* worker: ``start_load_kv`` (before the forward): one donated scatter of all loads; the forward;
  ``wait_for_save`` (after the step is dispatched): one gather of all stores into host memory.

Why saves need no completion handshake: the gather is dispatched before any later step, and JAX
runs one device's work in dispatch order, so a block vLLM frees and reuses later is overwritten
only after it was copied. Loads are synchronous (the scatter precedes the forward that reads it).
A load of a slot whose copy is still landing waits for that copy first (``HostPagePool.load``).

Nothing here imports JAX at module level: vLLM imports this module in its API server process too
(to look up the stats and metrics classes).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tpuserve.kv_cache.host_tier import HostPagePool, HostSlotIndex, page_bytes, slots_for_bytes

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from tpuserve.tpu_platform.model_runner import ModelRunner

log = logging.getLogger("vllm.tpuserve.offload")

CONNECTOR_NAME = "TpuserveHostOffloadConnector"
CONNECTOR_MODULE = "tpuserve.tpu_platform.vllm_plugin.offload_connector"
BUDGET_KEY = "cpu_bytes_to_use"  # the key vLLM's --kv-offloading-size fills, kept as is
MAX_INFLIGHT_KEY = "max_inflight_saves"  # optional: store batches in flight before the oldest is waited for
DEFAULT_MAX_INFLIGHT = 4


@dataclass
class HostTierMetadata(KVConnectorMetadata):
    """One step's transfers. Loads run before the forward, stores after it; both by host slot."""

    load_slots: list[int] = field(default_factory=list)
    load_blocks: list[int] = field(default_factory=list)  # vLLM block id = our device page id
    store_slots: list[int] = field(default_factory=list)
    store_blocks: list[int] = field(default_factory=list)


def host_tier_geometry(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> tuple[int, int]:
    """(host slots, bytes per block across layers): both sides compute it the same way.

    The bytes per block come from vLLM's KV cache spec, which our worker fills with the padded page
    size where the attention backend pads heads, so it is what one of our pages really takes.
    """
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    budget = extra.get(BUDGET_KEY)
    if not isinstance(budget, (int, float)) or isinstance(budget, bool) or budget <= 0:
        raise ValueError(
            f"kv_connector_extra_config[{BUDGET_KEY!r}]={budget!r}: give the host tier's "
            f"size in bytes (--kv-offloading-size GiB sets it)"
        )
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"the host tier expects one KV cache group, vLLM built {len(groups)}")
    block_bytes = int(groups[0].kv_cache_spec.page_size_bytes) * len(groups[0].layer_names)
    return slots_for_bytes(int(budget), block_bytes), block_bytes


# ---- stats and metrics ----

STAT_KEYS = ("loaded_blocks", "stored_blocks", "load_bytes", "store_bytes", "evicted_blocks")
_METRIC_DOCS = {
    "loaded_blocks": "KV blocks scattered back from the tpuserve host tier into device memory",
    "stored_blocks": "KV blocks copied from device memory into the tpuserve host tier",
    "load_bytes": "Bytes moved host -> device by the tpuserve host tier",
    "store_bytes": "Bytes moved device -> host by the tpuserve host tier",
    "evicted_blocks": "Host-tier blocks evicted (LRU) to make room for newer ones",
}


@dataclass
class HostTierConnectorStats(KVConnectorStats):
    """Counters since the last report; ``data`` maps each of ``STAT_KEYS`` to an int."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {k: 0 for k in STAT_KEYS}

    def add(self, **counts: int) -> None:
        for k, v in counts.items():
            self.data[k] = self.data.get(k, 0) + int(v)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + int(v)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: int(self.data.get(k, 0)) for k in STAT_KEYS}

    def is_empty(self) -> bool:
        return not any(self.data.get(k, 0) for k in STAT_KEYS)


class HostTierPromMetrics(KVConnectorPromMetrics):
    """``vllm:tpuserve_host_tier_<key>`` counters (Prometheus adds ``_total``), one per stat key."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for key in STAT_KEYS:
            counter = self._counter_cls(
                name=f"vllm:tpuserve_host_tier_{key}", documentation=_METRIC_DOCS[key], labelnames=labelnames
            )
            self._counters[key] = {
                idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for key, by_engine in self._counters.items():
            n = transfer_stats_data.get(key, 0)
            if n:
                by_engine[engine_idx].inc(n)


# ---- the scheduler side ----


class _SchedulerSide:
    """Which block hash sits in which host slot, and this step's planned transfers."""

    def __init__(self, block_size: int, num_slots: int):
        self.block_size = block_size
        self.index = HostSlotIndex(num_slots)
        self.requests: dict[str, Request] = {}
        self.stored_upto: dict[str, int] = {}  # blocks [0, n) of a request are known to be on host
        self.local_hit: dict[str, int] = {}  # vLLM's block-aligned device hit at the last lookup
        self.meta = HostTierMetadata()
        self.pinned: list[bytes] = []
        self.stats = HostTierConnectorStats()

    def num_matched(self, request: Request, num_computed_tokens: int) -> int:
        bs = self.block_size
        hashes = request.block_hashes
        first = num_computed_tokens // bs
        # Blocks that may come from host end before the prompt's last token: it is always computed.
        limit = min(len(hashes), (request.num_tokens - 1) // bs)
        self.local_hit[request.request_id] = num_computed_tokens
        if first >= limit:
            return 0
        n = 0
        for h in hashes[first:limit]:  # leading hits only; no LRU touch (may be called repeatedly)
            if h not in self.index:
                break
            n += 1
        return n * bs

    def plan_load(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        rid = request.request_id
        self.requests[rid] = request
        if num_external_tokens <= 0:
            return
        bs = self.block_size
        if num_external_tokens % bs:
            raise RuntimeError(
                f"request {rid}: {num_external_tokens} external tokens is not a "
                f"whole number of {bs}-token blocks"
            )
        first = self.local_hit.pop(rid) // bs
        block_ids = blocks.get_block_ids()[0]
        hashes = request.block_hashes[first : first + num_external_tokens // bs]
        for j, h in enumerate(hashes, start=first):
            self.meta.load_slots.append(self.index.slot(h))
            self.meta.load_blocks.append(int(block_ids[j]))
        # Pinned until the step's metadata is built: the stores planned there must not evict them.
        self.index.pin(hashes)
        self.index.touch(hashes)
        self.pinned.extend(hashes)

    def build(self, so: SchedulerOutput) -> HostTierMetadata:
        computed: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            computed[new.req_id] = int(new.num_computed_tokens)
            self.stored_upto[new.req_id] = 0  # fresh blocks (or a preempted request sent anew)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            computed[rid] = int(cached.num_computed_tokens[i])
            if rid in cached.resumed_req_ids:
                self.stored_upto[rid] = 0  # back from preemption with new blocks
        state = getattr(so, "kv_connector_block_state", None)
        for rid, n in so.num_scheduled_tokens.items():
            request = self.requests.get(rid)
            if request is None or rid not in computed:
                continue
            full = min((computed[rid] + n) // self.block_size, len(request.block_hashes))
            start = self.stored_upto.get(rid, 0)
            if full <= start:
                continue
            block_ids = state.get_block_ids(rid) if state is not None else None
            if block_ids is None:
                raise RuntimeError(f"request {rid}: vLLM passed no block ids to the KV connector")
            block_ids = block_ids[0]
            for j in range(start, full):
                self._plan_store(request.block_hashes[j], int(block_ids[j]))
            self.stored_upto[rid] = full
        meta, self.meta = self.meta, HostTierMetadata()
        self.index.unpin(self.pinned)
        self.pinned = []
        return meta

    def _plan_store(self, h: bytes, block_id: int) -> None:
        if h in self.index:
            self.index.touch((h,))
            return
        if block_id == 0:  # vLLM's null block holds nothing
            return
        got = self.index.insert(h)
        if got is None:
            return  # every slot is pinned by this step's loads: a cache may skip a save
        slot, evicted = got
        if evicted is not None:
            self.stats.add(evicted_blocks=1)
        if slot in self.meta.store_slots:  # more new blocks than slots this step: the later one wins
            k = self.meta.store_slots.index(slot)
            del self.meta.store_slots[k], self.meta.store_blocks[k]
        self.meta.store_slots.append(slot)
        self.meta.store_blocks.append(block_id)

    def finished(self, rid: str) -> None:
        self.requests.pop(rid, None)
        self.stored_upto.pop(rid, None)
        self.local_hit.pop(rid, None)

    def take_stats(self) -> HostTierConnectorStats | None:
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, HostTierConnectorStats()
        return out


# ---- the worker side ----


class _WorkerSide:
    """The host page slots and the device transfers, driven by the scheduler's metadata."""

    def __init__(self, num_slots: int, block_bytes: int, max_inflight_saves: int):
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        self.max_inflight_saves = max_inflight_saves
        self.runner: ModelRunner | None = None
        self.pool: HostPagePool | None = None
        self.stats = HostTierConnectorStats()

    def register_runner(self, runner: ModelRunner) -> None:
        kv = runner.kv_cache
        ours = page_bytes(kv.shape, kv.dtype)
        if ours != self.block_bytes:
            raise ValueError(
                f"host tier: vLLM's KV spec says {self.block_bytes} bytes per block, the "
                f"runner's cache {tuple(kv.shape)} {kv.dtype} has {ours}"
            )
        l, _, ps, c, d = kv.shape
        self.pool = HostPagePool(
            self.num_slots, (l, ps, c, d), kv.dtype, max_inflight_saves=self.max_inflight_saves
        )
        self.runner = runner
        log.info(
            "tpuserve host tier: %d blocks of %.2f MiB (%.2f GiB) in host memory",
            self.num_slots,
            self.block_bytes / 2**20,
            self.num_slots * self.block_bytes / 2**30,
        )

    def _need_runner(self) -> tuple[ModelRunner, HostPagePool]:
        """The runner and the host pool register_runner set up (both, or neither)."""
        if self.runner is None or self.pool is None:
            raise RuntimeError("the host-tier connector has no model runner (register_runner was not called)")
        return self.runner, self.pool

    def load(self, meta: HostTierMetadata) -> None:
        if not meta.load_slots:
            return
        runner, pool = self._need_runner()
        runner.kv_cache = pool.load(runner.kv_cache, meta.load_slots, meta.load_blocks)
        n = len(meta.load_slots)
        self.stats.add(loaded_blocks=n, load_bytes=n * self.block_bytes)

    def save(self, meta: HostTierMetadata) -> None:
        if not meta.store_slots:
            return
        runner, pool = self._need_runner()
        pool.save(runner.kv_cache, meta.store_slots, meta.store_blocks)
        n = len(meta.store_slots)
        self.stats.add(stored_blocks=n, store_bytes=n * self.block_bytes)

    def warmup(self, max_blocks: int) -> int:
        """Compile the transfer programs for every index bucket up to ``max_blocks``; returns the count."""
        runner, pool = self._need_runner()
        before = pool.compile_count
        runner.kv_cache = pool.warmup(runner.kv_cache, max_blocks)
        return pool.compile_count - before

    def take_stats(self) -> HostTierConnectorStats | None:
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, HostTierConnectorStats()
        return out

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.wait()
        self.pool = None
        self.runner = None


# ---- the connector vLLM loads ----


class TpuserveHostOffloadConnector(KVConnectorBase_V1):
    """Host-memory tier for vLLM's prefix cache on the tpuserve platform (see the module docstring)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        num_slots, block_bytes = host_tier_geometry(vllm_config, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        inflight = extra.get(MAX_INFLIGHT_KEY, DEFAULT_MAX_INFLIGHT)
        if not isinstance(inflight, int) or isinstance(inflight, bool) or inflight < 1:
            raise ValueError(
                f"kv_connector_extra_config[{MAX_INFLIGHT_KEY!r}]={inflight!r}: must be an integer >= 1"
            )
        block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.scheduler_side = (
            _SchedulerSide(block_size, num_slots) if role == KVConnectorRole.SCHEDULER else None
        )
        self.worker_side = (
            _WorkerSide(num_slots, block_bytes, inflight) if role == KVConnectorRole.WORKER else None
        )

    # Each role's connector has one side; the other is None. A call that belongs to the other
    # role is a wiring error, reported by name rather than as an AttributeError on None.

    def _worker(self) -> _WorkerSide:
        if self.worker_side is None:
            raise RuntimeError(f"{CONNECTOR_NAME}: a worker-side call on the scheduler's connector")
        return self.worker_side

    def _scheduler(self) -> _SchedulerSide:
        if self.scheduler_side is None:
            raise RuntimeError(f"{CONNECTOR_NAME}: a scheduler-side call on the worker's connector")
        return self.scheduler_side

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that never happens is a later miss, not lost data

    # -- worker side --

    def register_runner(self, runner: ModelRunner) -> None:
        """Our worker hands over its ModelRunner (the cache is ``runner.kv_cache``, replaced on load)."""
        self._worker().register_runner(runner)

    def register_kv_caches(self, kv_caches: dict) -> None:
        return None  # our cache is one JAX array owned by the runner: see register_runner

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker().load(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads finish (are dispatched) before the forward: nothing per layer

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # the whole step's blocks are saved at once in wait_for_save

    def wait_for_save(self) -> None:
        """Dispatch this step's stores (after its forward); device order makes waiting unnecessary."""
        if self.has_connector_metadata():
            self._worker().save(self._get_connector_metadata())

    def warmup(self, max_blocks: int) -> int:
        return self._worker().warmup(max_blocks)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.worker_side is not None:
            return self.worker_side.take_stats()
        return self._scheduler().take_stats()

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()

    # -- scheduler side --

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return self._scheduler().num_matched(request, num_computed_tokens), False  # loads are synchronous

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler().plan_load(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().build(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        # Its stores were dispatched in the steps that computed them, ahead of any reuse of its
        # blocks on the device: the blocks can be freed now.
        self._scheduler().finished(request.request_id)
        return False, None

    def reset_cache(self) -> bool:
        side = self.scheduler_side
        if side is not None:
            side.index = HostSlotIndex(side.index.num_slots)  # worker slots are simply reused
            side.stored_upto.clear()
        return True

    # -- classmethods vLLM calls in its front end --

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return HostTierConnectorStats(data=dict(data)) if data is not None else HostTierConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> HostTierPromMetrics:
        return HostTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
