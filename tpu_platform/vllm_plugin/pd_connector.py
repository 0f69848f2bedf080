"""``TpuservePDConnector``: disaggregated prefill/decode between two ``vllm serve --device tpu``.

    vllm serve M --device tpu --kv-transfer-config '{"kv_connector": "TpuservePDConnector",
        "kv_connector_module_path": "tpuserve.tpu_platform.vllm_plugin.pd_connector",
        "kv_role": "kv_producer", "kv_port": 14579}'                        # prefill (P)
    vllm serve M --device tpu --kv-transfer-config '{..., "kv_role": "kv_consumer"}'   # decode (D)
    tpuserve router --prefill http://P --decode http://D

Transport: ``kv_cache/transfer``'s framed TCP (HMAC handshake with ``TPUSERVE_KV_SECRET`` on both
engines, a KV layout check, leases on the producer). The producer's listener binds
``kv_connector_extra_config["kv_ip"]`` (default 127.0.0.1; vLLM 0.32's config has no such field)
: ``kv_port``.

Producer: the router's prefill request carries ``kv_transfer_params={"do_remote_decode": true}``.
When it finishes, ``request_finished`` (scheduler side) picks a transfer id, keeps the request's
blocks (delay-free) and returns the params the decode request will carry (vLLM puts them in the HTTP
response). The next step's metadata lists the export; the worker gathers those pages off the device
(dispatched before any later step, so vLLM may reuse the blocks at once), offers the copy under the
chosen id and reports the request as finished sending, which frees its blocks.

Consumer: the decode request carries those params. ``get_num_new_matched_tokens`` reports the
prompt tokens the producer computed (past vLLM's own prefix-cache hit) as loaded asynchronously, so
vLLM allocates blocks and parks the request in ``WAITING_FOR_REMOTE_KVS``; the step's metadata lists
the import; the worker pulls on a thread, and once the pages are in, scatters them into the
request's blocks (after that step's forward, before any later one) and reports it finished
receiving. vLLM then recomputes only the prompt's last token and decodes. (P's HTTP answer can reach
D before P's next step has offered the pages: a pull that finds no lease yet is retried until
``pull_timeout_s``.) A failed pull is reported
in ``failed_recving``: vLLM's ``kv_load_failure_policy`` fails the request or recomputes its prompt.

How the scheduler side learns where the producer listens and its layout digest: vLLM's handshake
metadata (``get_handshake_metadata`` on the worker -> ``set_xfer_handshake_metadata``).

Nothing here imports JAX at module level (vLLM imports connector modules in its API server too).
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tpuserve.kv_cache.transfer.device_pages import DevicePageMover, HostPages
from tpuserve.kv_cache.transfer.errors import TransferNotFoundError
from tpuserve.kv_cache.transfer.layout import KVLayout
from tpuserve.kv_cache.transfer.lease import Lease
from tpuserve.kv_cache.transfer.tcp import TcpKVReceiver, TcpKVSender
from tpuserve.kv_cache.transfer.transport import PageBatch, TransferHandle

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from tpuserve.tpu_platform.model_runner import ModelRunner

log = logging.getLogger("vllm.tpuserve.pd")

CONNECTOR_NAME = "TpuservePDConnector"
CONNECTOR_MODULE = "tpuserve.tpu_platform.vllm_plugin.pd_connector"
ROLES = ("kv_producer", "kv_consumer", "kv_both")
LEASE_TTL_KEY = "lease_ttl_s"  # kv_connector_extra_config: how long P holds unpulled pages
PULL_TIMEOUT_KEY = "pull_timeout_s"  # how long D waits for one pull
BIND_KEY = "kv_ip"  # where P's listener binds (and what its params advertise)
DEFAULT_LEASE_TTL_S = 120.0
DEFAULT_PULL_TIMEOUT_S = 60.0


@dataclass
class PDHandshake(KVConnectorHandshakeMetadata):
    """What the worker tells the scheduler side: where its producer listens, its layout digest."""

    host: str | None
    port: int | None
    layout_digest: str


@dataclass
class Export:
    req_id: str
    transfer_id: str
    block_ids: list[int]  # the pages holding the prompt's KV, in order
    num_tokens: int


@dataclass
class Import:
    req_id: str
    params: dict[str, Any]  # the producer's kv_transfer_params
    block_ids: list[int]  # local blocks receiving remote pages first_page, first_page + 1, ...
    first_page: int  # pages before it are vLLM's local prefix-cache hit


@dataclass
class PDMetadata(KVConnectorMetadata):
    exports: list[Export] = field(default_factory=list)
    imports: list[Import] = field(default_factory=list)


def _extra(vllm_config: VllmConfig, key: str, default: float) -> float:
    v = (vllm_config.kv_transfer_config.kv_connector_extra_config or {}).get(key, default)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"kv_connector_extra_config[{key!r}]={v!r}: must be a positive number of seconds")
    return float(v)


# ---- the scheduler side ----


class _SchedulerSide:
    def __init__(
        self, block_size: int, produces: bool, consumes: bool, engine_id: str = "", tp_size: int = 1
    ):
        self.block_size = block_size
        # Named in every offer as vLLM's own producers name themselves (remote_engine_id, tp_size):
        # proxies written for vLLM's P/D read them.
        self.engine_id, self.tp_size = engine_id, tp_size
        self.produces, self.consumes = produces, consumes
        self.handshake: PDHandshake | None = None
        self.meta = PDMetadata()
        self.pending_loads: dict[str, int] = {}  # req id -> first page, between lookup and allocation
        self.loading: set[str] = set()  # imports handed to the worker, not yet reported back

    def remote_tokens(self, request: Request, num_computed: int) -> int:
        p = request.kv_transfer_params
        if not (self.consumes and p and p.get("do_remote_prefill")):
            return 0
        n = p.get("remote_num_tokens")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"kv_transfer_params.remote_num_tokens must be a positive int, got {n!r}")
        # P computed the prompt; the decode request must be that same prompt (the router sends it).
        n = min(n, request.num_prompt_tokens)
        if n <= num_computed:
            return 0
        self.pending_loads[request.request_id] = num_computed // self.block_size
        return n - num_computed

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        rid = request.request_id
        first = self.pending_loads.pop(rid, None)
        if first is None or num_external <= 0:
            return
        p = dict(request.kv_transfer_params)
        # Loaded once: a preempted request recomputes instead of pulling again.
        request.kv_transfer_params["do_remote_prefill"] = False
        n_pages = math.ceil(min(int(p["remote_num_tokens"]), request.num_prompt_tokens) / self.block_size)
        block_ids = [int(b) for b in blocks.get_block_ids()[0][first:n_pages]]
        self.meta.imports.append(Import(rid, p, block_ids, first))
        self.loading.add(rid)

    def finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        rid = request.request_id
        self.pending_loads.pop(rid, None)
        if rid in self.loading:
            return True, None  # a pull may still scatter into these blocks: freed on finished_recving
        p = request.kv_transfer_params
        if not (self.produces and p and p.get("do_remote_decode")):
            return False, None
        if not request.is_finished() or request.status.name == "FINISHED_ABORTED":
            return False, None
        hs = self.handshake
        if hs is None or hs.port is None:
            raise RuntimeError(
                "the tpuserve P/D connector has no producer address (the worker's "
                "handshake metadata did not arrive)"
            )
        num_tokens = min(int(request.num_computed_tokens), request.num_prompt_tokens)
        n_pages = math.ceil(num_tokens / self.block_size)
        if num_tokens < 1 or n_pages > len(block_ids):
            return False, None
        tid = uuid.uuid4().hex  # random and unguessable: the key of the producer's lease
        self.meta.exports.append(Export(rid, tid, [int(b) for b in block_ids[:n_pages]], num_tokens))
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_transfer_id": tid,
            "remote_request_id": rid,
            "remote_host": hs.host,
            "remote_port": hs.port,
            "remote_num_pages": n_pages,
            "remote_num_tokens": num_tokens,
            "layout_digest": hs.layout_digest,
            "transport": "tcp",
            "remote_engine_id": self.engine_id,
            "remote_block_ids": [int(b) for b in block_ids[:n_pages]],
            "tp_size": self.tp_size,
        }
        return True, params

    def build(self) -> PDMetadata:
        meta, self.meta = self.meta, PDMetadata()
        return meta

    def update(self, out: KVConnectorOutput) -> None:
        for rid in out.finished_recving or ():
            self.loading.discard(rid)


# ---- the worker side ----


class _WorkerSide:
    def __init__(self, vllm_config: VllmConfig, produces: bool, consumes: bool):
        ktc = vllm_config.kv_transfer_config
        self.model_id = str(vllm_config.model_config.model)
        self.host = str((ktc.kv_connector_extra_config or {}).get(BIND_KEY, "127.0.0.1"))
        self.port = int(ktc.kv_port)
        self.produces, self.consumes = produces, consumes
        self.lease_ttl_s = _extra(vllm_config, LEASE_TTL_KEY, DEFAULT_LEASE_TTL_S)
        self.pull_timeout_s = _extra(vllm_config, PULL_TIMEOUT_KEY, DEFAULT_PULL_TIMEOUT_S)
        # Set by register_runner: the runner, its cache's layout and the page mover; the listener
        # only where this engine produces, the puller and its threads only where it consumes.
        self.runner: ModelRunner | None = None
        self.layout: KVLayout | None = None
        self.mover: DevicePageMover | None = None
        self.sender: _ChosenIdSender | None = None
        self.receiver: TcpKVReceiver | None = None
        self.pool: ThreadPoolExecutor | None = None
        self.pulls: dict[str, tuple[Future[PageBatch], Import]] = {}
        self.sent: set[str] = set()

    def register_runner(self, runner: ModelRunner) -> None:
        kv = runner.kv_cache
        self.runner = runner
        self.layout = KVLayout.from_cache_shape(self.model_id, tuple(kv.shape), kv.dtype)
        self.mover = DevicePageMover()
        if self.produces:
            self.sender = _ChosenIdSender(
                self.layout, host=self.host, port=self.port, default_ttl_s=self.lease_ttl_s
            )
            log.info("tpuserve P/D: KV producer listening on %s:%d", *self.sender.address)
        if self.consumes:
            self.receiver = TcpKVReceiver(self.layout)
            self.pool = ThreadPoolExecutor(4, thread_name_prefix="tpuserve-kv-pull")

    def _registered(self) -> tuple[ModelRunner, KVLayout, DevicePageMover]:
        if self.runner is None or self.layout is None or self.mover is None:
            raise RuntimeError(
                "the tpuserve P/D connector has no model runner (register_runner was not called)"
            )
        return self.runner, self.layout, self.mover

    def _producer(self) -> _ChosenIdSender:
        if self.sender is None:
            raise RuntimeError(
                "tpuserve P/D: an export on an engine that does not produce KV (kv_role kv_consumer), "
                "or before register_runner"
            )
        return self.sender

    def _consumer(self) -> tuple[TcpKVReceiver, ThreadPoolExecutor]:
        if self.receiver is None or self.pool is None:
            raise RuntimeError(
                "tpuserve P/D: an import on an engine that does not consume KV (kv_role kv_producer), "
                "or before register_runner"
            )
        return self.receiver, self.pool

    def handshake(self) -> PDHandshake:
        addr = self.sender.address if self.sender is not None else (None, None)
        return PDHandshake(addr[0], addr[1], self._registered()[1].digest())

    def start_loads(self, meta: PDMetadata) -> None:
        for imp in meta.imports:
            handle = TransferHandle.from_kv_transfer_params(imp.params)
            self.pulls[imp.req_id] = (self._consumer()[1].submit(self._pull, handle), imp)

    def _pull(self, handle: TransferHandle) -> PageBatch:
        """Pull, waiting out the producer's offer: P answers the prefill (so the router may already
        be asking D) one engine step before it gathers and offers the pages."""
        receiver = self._consumer()[0]
        deadline = time.monotonic() + self.pull_timeout_s
        wait = 0.02
        while True:
            try:
                return receiver.pull(handle, max(deadline - time.monotonic(), 0.1))
            except TransferNotFoundError:
                if time.monotonic() + wait > deadline:
                    raise
                time.sleep(wait)
                wait = min(wait * 2, 0.5)

    def exports(self, meta: PDMetadata) -> None:
        for ex in meta.exports:
            # Dispatched now: the copy precedes, in device order, any step that reuses the blocks.
            runner, _, mover = self._registered()
            pages = mover.gather(runner.kv_cache, ex.block_ids)
            self._producer().offer_as(ex.transfer_id, ex.req_id, pages, ex.num_tokens)
            self.sent.add(ex.req_id)
        if self.sender is not None:
            self.sender.drain_finished()  # ended leases (pulled / expired): nothing else to free

    def results(self) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults(finished_sending=self.sent)
        self.sent = set()
        for rid, (fut, imp) in list(self.pulls.items()):
            if not fut.done():
                continue
            del self.pulls[rid]
            out.finished_recving.add(rid)
            try:
                batch = fut.result()
                pages = batch.pages[:, imp.first_page : imp.first_page + len(imp.block_ids)]
                if pages.shape[1] != len(imp.block_ids):
                    raise ValueError(
                        f"the producer sent {batch.pages.shape[1]} pages, "
                        f"{imp.first_page + len(imp.block_ids)} were expected"
                    )
                # After this step's forward, before any later one: the next step reads them.
                runner, _, mover = self._registered()
                runner.kv_cache = mover.scatter(runner.kv_cache, pages, imp.block_ids)
            except Exception as e:
                log.error("tpuserve P/D: pulling the KV of request %s failed: %s", rid, e)
                out.failed_recving.add(rid)
        return out

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        if self.sender is not None:
            self.sender.close()
        self.runner = None


class _ChosenIdSender(TcpKVSender):
    """A ``TcpKVSender`` whose leases take the transfer id the scheduler side already handed out."""

    def offer_as(self, transfer_id: str, request_id: str, pages: HostPages, num_tokens: int) -> None:
        n = int(pages.num_pages)
        self.leases.add(
            Lease(
                transfer_id,
                str(request_id),
                pages,
                n,
                int(num_tokens),
                {},
                self.layout.pages_nbytes(n),
                time.monotonic() + self.default_ttl_s,
            )
        )


# ---- the connector vLLM loads ----


class TpuservePDConnector(KVConnectorBase_V1):
    """Prefill/decode KV transfer on the tpuserve platform (see the module docstring)."""

    _cache_hit_source = CacheHitSource.P2P  # vLLM files loaded prompt tokens as from another instance

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        if ktc.kv_role not in ROLES:
            raise ValueError(f"kv_role={ktc.kv_role!r}: {CONNECTOR_NAME} takes one of {ROLES}")
        produces = ktc.kv_role in ("kv_producer", "kv_both")
        consumes = ktc.kv_role in ("kv_consumer", "kv_both")
        block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.scheduler_side = (
            _SchedulerSide(
                block_size,
                produces,
                consumes,
                engine_id=str(ktc.engine_id or ""),
                tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
            )
            if role == KVConnectorRole.SCHEDULER
            else None
        )
        self.worker_side = (
            _WorkerSide(vllm_config, produces, consumes) if role == KVConnectorRole.WORKER else None
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

    # -- worker side --

    def register_runner(self, runner: ModelRunner) -> None:
        self._worker().register_runner(runner)

    def register_kv_caches(self, kv_caches: dict) -> None:
        return None  # our cache is one JAX array owned by the runner: see register_runner

    def get_handshake_metadata(self) -> PDHandshake | None:
        return self.worker_side.handshake() if self.worker_side is not None else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker().start_loads(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            self._worker().exports(self._get_connector_metadata())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._worker().results()

    def warmup(self, max_blocks: int) -> int:
        return 0  # the page gather/scatter compile at first use (one program per power-of-two count)

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()

    # -- scheduler side --

    def set_xfer_handshake_metadata(self, metadata: dict) -> None:
        hs = metadata.get(0)
        if isinstance(hs, PDHandshake):
            self._scheduler().handshake = hs

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        n = self._scheduler().remote_tokens(request, num_computed_tokens)
        return n, n > 0  # loaded asynchronously: the request waits in WAITING_FOR_REMOTE_KVS

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler().after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().build()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler().update(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        return self._scheduler().finished(request, block_ids)
