"""Data parallelism: M engine replicas on disjoint device subsets behind one server.

``--data-parallel-size M`` builds M ``LLMEngine``s (replica i runs on row i of the device grid,
``tpu_platform/mesh.py``; each may itself be tensor parallel), each in its own ``AsyncEngine``
thread. ``DataParallelEngine`` stands where the API layer expects one ``AsyncEngine``.

Routing is prefix-cache aware: a request goes to the replica whose device cache already holds the
longest prefix of its prompt (the same page hashes the scheduler looks up, salt included), so a
multi-turn conversation or a shared system prompt keeps hitting one replica's cache. Load still
wins over a cache hit when the cached replica is far busier than the least loaded one (more than
``balance_slack`` requests ahead): a hit saves a prefill, a queue costs every request in it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from tpuserve.kv_cache.prefix_hash import page_hashes
from tpuserve.server.async_engine import AsyncEngine, EngineSnapshot, RequestStream, generate_through

log = logging.getLogger(__name__)


def merge_snapshots(snaps: list[EngineSnapshot]) -> EngineSnapshot:
    """One snapshot for the server's metrics: counters and gauges summed over replicas, the KV
    usage as the fraction of all replicas' pages in use."""
    total = sum(s.total_blocks for s in snaps)
    out: dict[str, Any] = {}  # field name -> merged value, of the field's type
    for f in dataclasses.fields(EngineSnapshot):
        values = [getattr(s, f.name) for s in snaps]
        if f.name == "kv_cache_usage":
            out[f.name] = (sum(s.kv_cache_usage * s.total_blocks for s in snaps) / total) if total else 0.0
        elif f.name == "routed_per_replica":
            out[f.name] = ()  # the router's, not a replica's (DataParallelEngine.snapshot)
        elif f.name == "spec_accepted_per_pos":
            width = max((len(v) for v in values), default=0)
            out[f.name] = tuple(sum(v[i] for v in values if i < len(v)) for i in range(width))
        else:
            out[f.name] = sum(values)
    return EngineSnapshot(**out)


class DataParallelEngine:
    """The ``AsyncEngine`` interface over several replicas (see the module docstring)."""

    def __init__(self, replicas: list[AsyncEngine], balance_slack: int | None = None):
        if not replicas:
            raise ValueError("data parallel needs at least one replica")
        self.replicas = replicas
        first = replicas[0]
        self.engine = first.engine  # config, tokenizer, limits: the same on every replica
        self.tokenizer = first.tokenizer
        self.max_model_len = first.max_model_len
        self.vocab_size = first.vocab_size
        self.page_size = self.engine.config.cache.block_size
        self.caching = self.engine.config.cache.enable_prefix_caching
        self.balance_slack = (
            balance_slack if balance_slack is not None else self.engine.config.scheduler.max_num_seqs
        )
        self.routed = [0] * len(replicas)  # requests sent to each replica (tests, logs)
        self._inflight = [0] * len(replicas)  # adds not yet reflected in a replica's snapshot
        self._metrics = None

    # ---- what the API layer reads ----

    @property
    def metrics(self):
        return self._metrics

    @metrics.setter
    def metrics(self, value) -> None:
        self._metrics = value
        for r in self.replicas:
            r.metrics = value

    @property
    def snapshot(self) -> EngineSnapshot:
        merged = merge_snapshots([r.snapshot for r in self.replicas])
        return dataclasses.replace(merged, routed_per_replica=tuple(self.routed))

    @property
    def is_healthy(self) -> bool:
        return all(r.is_healthy for r in self.replicas)

    @property
    def num_active(self) -> int:
        return sum(r.num_active for r in self.replicas)

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        for r in self.replicas:
            r.start(loop)

    async def shutdown(self, grace_s: float = 0.0) -> None:
        await asyncio.gather(*(r.shutdown(grace_s) for r in self.replicas))

    # ---- routing ----

    def _load(self, i: int) -> int:
        s = self.replicas[i].snapshot
        return s.num_unfinished_requests + self._inflight[i]

    def route(self, prompt_token_ids: list[int], cache_salt: str | None = None) -> int:
        """The replica for a prompt: the longest cached prefix among replicas within
        ``balance_slack`` requests of the least loaded; ties go to the less loaded, then to the one
        sent fewer requests so far (round robin when nothing is cached)."""
        loads = [self._load(i) for i in range(len(self.replicas))]
        floor = min(loads)
        hits = [0] * len(self.replicas)
        if self.caching:
            hashes = page_hashes(prompt_token_ids, self.page_size, cache_salt)
            # A read of the pool's hash table from this thread: advisory only (the replica's own
            # scheduler decides what really hits), so no lock with its engine thread.
            hits = [len(r.engine.pool.match(hashes)) for r in self.replicas]
        candidates = [i for i, load in enumerate(loads) if load <= floor + self.balance_slack]
        return max(candidates, key=lambda i: (hits[i], -loads[i], -self.routed[i], -i))

    # ---- requests ----

    async def add_request(
        self,
        request_id: str,
        prompt: str | None,
        params,
        prompt_token_ids=None,
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
        remote_kv=None,
    ) -> RequestStream:
        if any(request_id in r._streams for r in self.replicas):
            raise ValueError(f"request_id {request_id!r} is already in use")
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise ValueError("prompt: give a string or a list of token ids")
            prompt_token_ids = self.engine.tokenize(prompt)
        i = self.route(list(prompt_token_ids), cache_salt)
        self.routed[i] += 1
        self._inflight[i] += 1
        try:
            return await self.replicas[i].add_request(
                request_id,
                prompt,
                params,
                prompt_token_ids,
                cache_salt=cache_salt,
                kv_transfer_params=kv_transfer_params,
                remote_kv=remote_kv,
            )
        finally:
            self._inflight[i] -= 1

    def generate(self, request_id: str, prompt, params, prompt_token_ids=None):
        return generate_through(self, request_id, prompt, params, prompt_token_ids)

    def abort(self, request_id: str) -> None:
        for r in self.replicas:  # a no-op on the replicas that do not hold it
            r.abort(request_id)
