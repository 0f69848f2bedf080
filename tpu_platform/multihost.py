"""One engine over several processes ("hosts") with JAX's multi-controller runtime.

Every host runs the same step programs on its own devices of one global mesh (``jax.distributed``
joins them; tensor parallelism spans all of their devices). Host 0 (the leader) runs the
scheduler and the front end; every other host (a follower) runs ``run_follower``: it loads the
same weights, then replays the leader's device work, one ``Message`` per Worker / ModelRunner
call, in the order the leader made them. Programs with collectives (the sharded forward) must
start in the same order on every host or they deadlock, so the protocol is per call, not per
array:

    PlanMemory()               Worker.num_pages       (on an accelerator the memory plan builds
                                                      the runner: weights placed, an FP8 cache's
                                                      calibration forward run; the leader's count
                                                      is the one used)
    InitKVCache(num_pages)     Worker.init_kv_cache   (the leader sizes the cache; hosts agree)
    Warmup()                   Worker.warmup          (compiles only; no collective runs)
    RunStep(batch, feeds_from) ModelRunner.forward + sample of one StepBatch
    Shutdown(reason)           the follower returns

Messages travel through the coordinator's key-value store (``StepChannel``): the leader writes
message ``seq`` under its own key, followers read the keys in order, so a lost or reordered
message is a clear error, not a silent divergence. With ``--data-parallel-size M`` each replica is
an engine of its own whose TP group spans every host (``mesh.mesh_devices``): host 0 runs M
engines, each with its own channel (``replica`` in the keys), and every follower runs M Workers,
one replaying each channel on a thread of its own (replicas share no device, so their programs
need no order between them). Only the leader reads tokens back (a
follower's step results stay on its devices until the next step replaces them).

A host that dies: every follower bumps a heartbeat counter in the same store; the leader's
``Watchdog`` names a follower whose counter stops for ``dead_after_s`` and makes the engine raise
``HostLost`` (or, if the engine thread is stuck inside a collective, ends the process with that
message), and a follower whose leader is gone stops with the same error.

Messages are pickled: the coordinator port must be reachable by the slice's hosts only (it
already is the control plane of jax.distributed, which trusts its peers the same way).
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tpuserve.tpu_platform.config import ConfigError, EngineConfig, ParallelConfig
from tpuserve.tpu_platform.step_batch import StepBatch

if TYPE_CHECKING:
    from tpuserve.tpu_platform.model_runner import ModelRunner, PendingStep
    from tpuserve.tpu_platform.worker import Worker

log = logging.getLogger(__name__)

_PREFIX = "tpuserve/mh/"
# Keys of messages older than this many are deleted by the leader. A follower is never that far
# behind: every step's forward all-reduces across hosts, so the leader runs at most a couple of
# messages ahead of the slowest follower.
_KEEP_MESSAGES = 256
HEARTBEAT_S = 1.0
DEAD_AFTER_S = 15.0
# How long the leader waits for the engine thread to notice a lost host before it ends the
# process itself (the thread may be blocked in a collective that never completes).
_STUCK_GRACE_S = 5.0
EXIT_HOST_LOST = 75  # EX_TEMPFAIL: restart the slice


class HostLost(RuntimeError):
    """A host of a multi-host engine stopped (its heartbeat ended or its coordinator is gone)."""

    def __init__(self, rank: int, detail: str):
        super().__init__(f"multi-host engine: host {rank} is gone ({detail}); stopping")
        self.rank = rank


class ProtocolError(RuntimeError):
    """A follower received a message out of order (the hosts would run different programs)."""


@dataclass(frozen=True)
class HostGroup:
    """This process's place among the engine's hosts."""

    num_hosts: int
    rank: int

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


# ---- the messages: one per Worker / ModelRunner call that touches the devices ----


@dataclass(frozen=True)
class PlanMemory:
    pass


@dataclass(frozen=True)
class InitKVCache:
    num_pages: int


@dataclass(frozen=True)
class Warmup:
    pass


@dataclass(frozen=True)
class RunStep:
    batch: StepBatch
    feeds_from: int  # seq of the step whose tokens batch.feed_rows refer to; -1: none


@dataclass(frozen=True)
class Shutdown:
    reason: str


Op = PlanMemory | InitKVCache | Warmup | RunStep | Shutdown


@dataclass(frozen=True)
class Message:
    seq: int
    op: Op


# ---- joining the hosts ----


def pod_worker_count() -> int:
    """Workers a Cloud TPU VM's environment names (``TPU_WORKER_HOSTNAMES``, comma-separated);
    1 off a pod slice. Not testable here: no multi-host TPU."""
    names = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return len([n for n in names.split(",") if n.strip()]) or 1


def initialize(parallel: ParallelConfig) -> HostGroup | None:
    """Join the engine's hosts (``jax.distributed.initialize``) before anything touches a device;
    None for a single-host engine. Flags given: connect to that coordinator as that rank. No flags
    on a multi-worker TPU pod slice: JAX reads the pod's own environment. Calling it again (the
    process joined already) returns the group."""
    import jax

    if not parallel.multi_host and pod_worker_count() <= 1:
        return None
    if not jax.distributed.is_initialized():
        # CPU devices (tests, CI) need a collectives backend across processes; TPUs ignore it.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if parallel.distributed_coordinator is not None:
            jax.distributed.initialize(
                coordinator_address=parallel.distributed_coordinator,
                num_processes=parallel.num_hosts,
                process_id=parallel.host_rank,
                # A dead host must not hold the others at exit for jax's default 5 minutes.
                shutdown_timeout_seconds=30,
            )
        else:
            jax.distributed.initialize()
        log.info(
            "host %d of %d: %d local device(s)",
            jax.process_index(),
            jax.process_count(),
            jax.local_device_count(),
        )
    group = HostGroup(jax.process_count(), jax.process_index())
    if parallel.multi_host and (group.num_hosts, group.rank) != (parallel.num_hosts, parallel.host_rank):
        raise ConfigError(
            f"num_hosts/host_rank: flags say host {parallel.host_rank} of {parallel.num_hosts}, "
            f"jax.distributed says {group.rank} of {group.num_hosts}"
        )
    if parallel.tensor_parallel_size % group.num_hosts:
        raise ConfigError(
            f"tensor_parallel_size: {parallel.tensor_parallel_size} must be a multiple of the "
            f"{group.num_hosts} hosts: tensor parallelism spans every host"
        )
    return group


def _channel_prefix(replica: int) -> str:
    """Where one replica's messages and set-up acks live in the store (replica 0: the keys a
    single-replica engine has always used)."""
    return _PREFIX if replica == 0 else _PREFIX + f"r{replica}/"


def _client() -> Any:
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("multihost: jax.distributed is not initialized")
    return client


# ---- the message channel ----


class StepChannel:
    """Messages from the leader to every follower through the coordinator's key-value store, in
    sequence order, for one data-parallel ``replica``. The leader ``send``s; a follower ``recv``s
    the next one."""

    def __init__(self, group: HostGroup, client: Any = None, replica: int = 0):
        self.group = group
        self.client = client if client is not None else _client()
        self.replica = replica
        self.prefix = _channel_prefix(replica)
        self._seq = 0  # last sent (leader) / received (follower)

    def send(self, op: Op) -> int:
        """Publish ``op`` as the next message; returns its sequence number."""
        seq, raw = self.encode(op)
        self.publish(seq, raw)
        return seq

    def encode(self, op: Op) -> tuple[int, bytes]:
        """Number ``op`` as the next message and serialize it (``publish`` sends it; messages
        must be published in the order they were encoded)."""
        self._seq += 1
        return self._seq, pickle.dumps(Message(self._seq, op))

    def publish(self, seq: int, raw: bytes) -> None:
        self.client.key_value_set_bytes(self.prefix + f"msg/{seq}", raw)
        old = seq - _KEEP_MESSAGES
        if old > 0:
            self.client.key_value_delete(self.prefix + f"msg/{old}")

    def recv(self, timeout_s: float) -> Message | None:
        """The next message, or None when none came within ``timeout_s``."""
        key = self.prefix + f"msg/{self._seq + 1}"
        try:
            raw = self.client.blocking_key_value_get_bytes(key, int(timeout_s * 1000))
        except Exception as e:
            if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower():
                return None
            raise HostLost(0, f"the coordinator's key-value store failed: {_first_line(e)}") from e
        msg = pickle.loads(raw)
        if not isinstance(msg, Message) or msg.seq != self._seq + 1:
            got = getattr(msg, "seq", type(msg).__name__)
            raise ProtocolError(
                f"host {self.group.rank}{_of_replica(self.replica)}: expected message {self._seq + 1}, got {got}"
            )
        self._seq = msg.seq
        return msg


def _of_replica(replica: int) -> str:
    return f", replica {replica}" if replica else ""


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


# ---- liveness ----


class Heartbeat:
    """Bumps this host's counter in the key-value store every ``interval_s`` on a daemon thread;
    ``on_error(exc)`` runs once when the store stays unreachable for ``dead_after_s`` (the
    coordinator, i.e. host 0, is gone)."""

    def __init__(
        self,
        group: HostGroup,
        on_error: Callable[[BaseException], None],
        *,
        interval_s: float = HEARTBEAT_S,
        dead_after_s: float = DEAD_AFTER_S,
        client: Any = None,
    ):
        self.client = client if client is not None else _client()
        self.key = _PREFIX + f"alive/{group.rank}"
        self.interval_s, self.dead_after_s = interval_s, dead_after_s
        self._on_error = on_error
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{group.rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        failing_since: float | None = None
        while not self._stop.wait(self.interval_s):
            try:
                self.client.key_value_increment(self.key, 1)
                failing_since = None
            except Exception as e:
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since >= self.dead_after_s:
                    self._on_error(e)
                    return

    def stop(self) -> None:
        self._stop.set()


class Watchdog:
    """The leader's view of its followers: reads their heartbeat counters every ``interval_s``; a
    counter that does not move for ``dead_after_s`` marks that host lost. ``check()`` raises
    ``HostLost`` then (the engine calls it around every step); if no ``check()`` comes within
    ``_STUCK_GRACE_S`` (the engine thread waits in a collective the dead host will never join),
    ``on_stuck`` runs (default: print the error and end the process)."""

    def __init__(
        self,
        group: HostGroup,
        *,
        interval_s: float = HEARTBEAT_S,
        dead_after_s: float = DEAD_AFTER_S,
        on_stuck: Callable[[HostLost], None] | None = None,
        client: Any = None,
    ):
        self.client = client if client is not None else _client()
        self.group = group
        self.interval_s, self.dead_after_s = interval_s, dead_after_s
        self.lost: HostLost | None = None
        self._noticed = threading.Event()
        self._on_stuck = on_stuck or _exit_with
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="multihost-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        start = time.monotonic()
        seen: dict[int, tuple[str | None, float]] = {r: (None, start) for r in range(1, self.group.num_hosts)}
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            for rank, (value, since) in seen.items():
                try:
                    current = self.client.key_value_try_get(_PREFIX + f"alive/{rank}")
                except Exception:
                    current = None  # not written yet (NOT_FOUND), or the store is busy
                if current is not None and current != value:
                    seen[rank] = (current, now)
                elif now - since >= self.dead_after_s:
                    self._mark(HostLost(rank, f"no heartbeat for {now - since:.0f} s"))
                    return

    def _mark(self, lost: HostLost) -> None:
        self.lost = lost
        log.error("%s", lost)
        if not self._noticed.wait(_STUCK_GRACE_S) and not self._stop.is_set():
            self._on_stuck(lost)

    def check(self) -> None:
        """Raise the lost host's error, if any (and tell the watchdog the engine saw it)."""
        if self.lost is not None:
            self._noticed.set()
            raise self.lost

    def check_noticed(self) -> None:
        """The engine saw the loss (it raises it itself): the process need not be ended."""
        self._noticed.set()

    def stop(self) -> None:
        self._stop.set()
        self._noticed.set()


def _exit_with(lost: HostLost) -> None:
    print(f"tpuserve: error: {lost}", file=sys.stderr, flush=True)
    os._exit(EXIT_HOST_LOST)


# ---- the leader's side ----


class Leader:
    """Host 0's end: ``send`` each device call's message before making the call locally;
    ``check`` raises ``HostLost`` once a follower stopped.

    A step waits until every follower finished the set-up calls before it (``InitKVCache``,
    ``Warmup``): a follower still compiling when the first collective starts would leave this
    host waiting in gloo's context set-up, which gives up after 30 s with no name of the host.

    Messages are serialized on the caller's thread (the batch as it is now) and written to the
    store by a sender thread, in order: a store write is a round trip to the coordinator
    (~0.6 ms on localhost, benchmarks/multihost_channel.py) that the engine's step need not wait
    for; the followers wait for it instead, as they wait for the step's collectives anyway."""

    def __init__(
        self, group: HostGroup, *, dead_after_s: float = DEAD_AFTER_S, client: Any = None, replica: int = 0
    ):
        """replica: which data-parallel replica's engine this is (its own channel)."""
        self.group = group
        self.channel = StepChannel(group, client=client, replica=replica)
        # No heartbeat of its own: the coordinator lives in this process, so followers see it go.
        self.watchdog = Watchdog(group, dead_after_s=dead_after_s, client=self.channel.client)
        self.closed = False
        self._unacked: list[int] = []  # set-up messages the followers have not confirmed yet
        self._outbox: queue.Queue[tuple[int, bytes] | None] = queue.Queue()
        self._send_error: BaseException | None = None
        self._sender = threading.Thread(
            target=self._send_loop, name=f"multihost-sender-{replica}", daemon=True
        )
        self._sender.start()

    def send(self, op: Op) -> int:
        self.check()
        if isinstance(op, RunStep):
            self.await_setup()
        seq, raw = self.channel.encode(op)
        self._outbox.put((seq, raw))
        if isinstance(op, PlanMemory | InitKVCache | Warmup):
            self._unacked.append(seq)
        return seq

    def _send_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            try:
                self.channel.publish(*item)
            except Exception as e:  # the coordinator is in this process: this is not a lost host
                self._send_error = e
                log.error("multi-host engine: publishing message %d failed: %s", item[0], e)
                return

    def await_setup(self) -> None:
        """Block until every follower confirmed the set-up messages sent so far (HostLost if one
        stops meanwhile)."""
        client = self.channel.client
        for seq in self._unacked:
            for rank in range(1, self.group.num_hosts):
                key = self.channel.prefix + f"ack/{rank}/{seq}"
                while True:
                    self.check()
                    try:
                        client.blocking_key_value_get(key, int(self.watchdog.interval_s * 1000))
                        break
                    except Exception as e:
                        if "DEADLINE_EXCEEDED" not in str(e) and "timed out" not in str(e).lower():
                            raise
        self._unacked.clear()

    def check(self) -> None:
        self.watchdog.check()
        if self._send_error is not None:
            raise RuntimeError(f"multi-host engine: the step broadcast failed: {self._send_error}")

    def wait_for_loss(self) -> HostLost | None:
        """After a failed device wait (a peer's collective broke): the lost host once the
        watchdog names it, within its timeout; None if every host still beats."""
        deadline = time.monotonic() + self.watchdog.dead_after_s + 2 * self.watchdog.interval_s
        while self.watchdog.lost is None and time.monotonic() < deadline:
            time.sleep(self.watchdog.interval_s / 4)
        lost = self.watchdog.lost
        if lost is not None:
            self.watchdog.check_noticed()
        return lost

    def shutdown(self, reason: str = "leader shut down") -> None:
        """Tell the followers to return (once); stops the liveness threads."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.watchdog.lost is None and self._send_error is None:
                self._outbox.put(self.channel.encode(Shutdown(reason)))
        finally:
            self._outbox.put(None)
            self._sender.join(30.0)
            self.watchdog.stop()


def _exit_on_store_loss(group: HostGroup) -> Callable[[BaseException], None]:
    def on_error(e: BaseException) -> None:
        _exit_with(HostLost(0, f"host {group.rank} cannot reach the coordinator: {_first_line(e)}"))

    return on_error


# ---- the follower's side ----


class Follower:
    """Replays the leader's messages on this host's Worker (``run`` until Shutdown)."""

    def __init__(self, worker: Worker, group: HostGroup, *, poll_s: float = HEARTBEAT_S, replica: int = 0):
        self.worker = worker
        self.group = group
        self.poll_s = poll_s
        self.channel = StepChannel(group, replica=replica)
        self.runner: ModelRunner | None = None
        self.last: PendingStep | None = None  # the latest step (the next one may feed from it)
        self.last_seq = -1
        self.older: PendingStep | None = None  # the step before it: waited on, so errors surface
        self.steps = 0

    def run(self) -> str:
        """Serve messages until the leader's Shutdown; returns its reason."""
        while True:
            msg = self.channel.recv(self.poll_s)
            if msg is None:
                continue
            op = msg.op
            if isinstance(op, Shutdown):
                return op.reason
            self.apply(msg.seq, op)

    def apply(self, seq: int, op: Op) -> None:
        if isinstance(op, PlanMemory):
            self.worker.num_pages()  # for its device work; InitKVCache brings the leader's count
            self._ack(seq)
        elif isinstance(op, InitKVCache):
            self.runner = self.worker.init_kv_cache(op.num_pages)
            self._ack(seq)
        elif isinstance(op, Warmup):
            self.worker.warmup(progress=False)
            self._ack(seq)
        elif isinstance(op, RunStep):
            self._step(seq, op)
        else:
            raise ProtocolError(f"host {self.group.rank}: unknown message {type(op).__name__}")

    def _ack(self, seq: int) -> None:
        """Tell the leader a set-up call is done here (``Leader.await_setup``)."""
        self.channel.client.key_value_set(self.channel.prefix + f"ack/{self.group.rank}/{seq}", "1")

    def _step(self, seq: int, op: RunStep) -> None:
        import jax

        if self.runner is None:
            raise ProtocolError(f"host {self.group.rank}: a step before InitKVCache")
        prev = None
        if op.feeds_from >= 0:
            if op.feeds_from != self.last_seq or self.last is None:
                raise ProtocolError(
                    f"host {self.group.rank}: step {seq} feeds from step {op.feeds_from}, "
                    f"but the last step here was {self.last_seq}"
                )
            prev = self.last
        step = self.runner.sample(self.runner.forward(op.batch, prev))
        if self.older is not None:
            # Two steps in flight at most, as on the leader; a failed collective raises here.
            jax.block_until_ready(self.older.last_tokens)
        self.older, self.last, self.last_seq = self.last, step, seq
        self.steps += 1


def run_follower(config: EngineConfig) -> str:
    """A follower host's whole life: join the hosts, load this host's copy of the model (one per
    data-parallel replica), replay the leader's device calls until it shuts down. Returns the
    leader's reason; raises ``HostLost`` when the leader is gone."""
    from tpuserve.tpu_platform.device import discover
    from tpuserve.tpu_platform.worker import Worker

    group = initialize(config.parallel)
    if group is None or group.is_leader:
        raise ConfigError("run_follower: this process is not a follower host (host_rank must be > 0)")
    backend = discover().backend
    config = config.for_backend(backend)
    # Beating before the load: the leader's watchdog counts from when its own load ended.
    heartbeat = Heartbeat(group, _exit_on_store_loss(group))
    results: queue.Queue[tuple[int, str | BaseException]] = queue.Queue()

    def follow(follower: Follower) -> None:
        try:
            results.put((follower.channel.replica, follower.run()))
        except BaseException as e:  # handed to the main thread, which raises it
            results.put((follower.channel.replica, e))

    followers = []
    try:
        # Replica by replica, as host 0 builds its engines: each replica's set-up messages are
        # served while the next one loads.
        for replica in range(config.parallel.data_parallel_size):
            worker = Worker(config, replica)
            worker.load()
            follower = Follower(worker, group, replica=replica)
            threading.Thread(
                target=follow, args=(follower,), name=f"multihost-follower-{replica}", daemon=True
            ).start()
            followers.append(follower)
        reasons: dict[int, str] = {}
        while len(reasons) < len(followers):
            replica, got = results.get()
            if isinstance(got, BaseException):  # one replica broke: this host cannot go on
                raise got
            reasons[replica] = got
    finally:
        heartbeat.stop()
    log.info("host %d: %d steps; leader: %s", group.rank, sum(f.steps for f in followers), reasons[0])
    return reasons[0]
