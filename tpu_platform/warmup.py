"""Warm-up as a plan of independent compile tasks, run by a thread pool in priority order.

A runner describes what to compile as a ``WarmupPlan``: named ``CompileTask``s (each compiles one
or a few programs and touches no runner state, so tasks may run on any thread while the engine
serves), and ``ShapeGroup``s, the step shapes those tasks unlock, most wanted first. ``Warmup``
runs the plan: XLA compiles outside the GIL, so tasks on a pool of threads overlap; a group's
``on_ready`` fires once all of its tasks have finished, which is when the runner may start using
that shape without compiling on the request path.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

log = logging.getLogger(__name__)

# More threads than this only add memory: the plans hold a few dozen programs.
MAX_WORKERS = 8


@dataclass(frozen=True)
class CompileTask:
    key: str  # unique within a plan, e.g. "forward t=32 p=512"
    run: Callable[[], object]


@dataclass(frozen=True)
class ShapeGroup:
    """A step shape and the tasks it needs; ``first``: compiled before the engine serves."""

    shape: Hashable
    tasks: tuple[str, ...]
    first: bool = False


@dataclass(frozen=True)
class WarmupPlan:
    tasks: tuple[CompileTask, ...]  # every task once
    groups: tuple[ShapeGroup, ...]  # in priority order

    def ordered_tasks(self) -> list[CompileTask]:
        """Tasks in the order they should start: the first groups' tasks, then each group's in turn."""
        by_key = {t.key: t for t in self.tasks}
        order: dict[str, None] = {}
        for g in sorted(self.groups, key=lambda g: not g.first):  # stable: keeps priority order
            order.update(dict.fromkeys(g.tasks))
        order.update(dict.fromkeys(by_key))  # tasks no group names still run
        return [by_key[k] for k in order]


def default_workers() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cores))


class Warmup:
    """Runs a ``WarmupPlan`` on a thread pool. ``wait_first`` / ``wait`` block until the first
    groups / every task finished; ``remaining`` counts tasks not finished. A task that fails is
    logged and its groups never become ready (the runner keeps to the shapes that did); a failure
    among the first groups is raised by ``wait_first``."""

    def __init__(
        self,
        plan: WarmupPlan,
        on_ready: Callable[[Hashable], None],
        *,
        workers: int | None = None,
        progress: bool = True,
    ):
        self.plan = plan
        self._on_ready = on_ready
        self._lock = threading.Lock()
        self._pending = {g.shape: set(g.tasks) for g in plan.groups}
        self._failed: dict[str, BaseException] = {}
        self._tasks = plan.ordered_tasks()
        self.total = len(self._tasks)
        self._done = 0
        self._ready: set[Hashable] = set()  # groups whose on_ready has returned
        self._first_done = threading.Event()
        self._all_done = threading.Event()
        self._t0 = time.perf_counter()
        self.seconds: float | None = None  # wall time of the whole plan, once done
        self._bar = _progress_bar(self.total) if progress else None
        workers = workers or default_workers()
        self._pool = ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="tpuserve-compile", initializer=_yield_to_serving
        )
        self._futures: list[Future] = []
        # Groups with no tasks (already compiled) are ready at once.
        for g in plan.groups:
            if not g.tasks:
                self._group_ready(g.shape)
        self._check_first()
        if not self._tasks:
            self._finish()
        for task in self._tasks:
            self._futures.append(self._pool.submit(self._run, task))
        self._pool.shutdown(wait=False)  # threads end when the queue is drained

    @property
    def remaining(self) -> int:
        return self.total - self._done

    @property
    def done(self) -> bool:
        return self._all_done.is_set()

    @property
    def failed(self) -> dict[str, BaseException]:
        return dict(self._failed)

    def wait_first(self, timeout: float | None = None) -> None:
        """Block until every first group is ready; raise when one of their tasks failed."""
        self._first_done.wait(timeout)
        bad = {k: e for k, e in self._failed.items() if any(k in g.tasks for g in self._first_groups())}
        if bad:
            key, err = next(iter(bad.items()))
            raise RuntimeError(f"warm-up: compiling {key} failed: {type(err).__name__}: {err}") from err

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every task finished (or ``timeout``); True when done."""
        return self._all_done.wait(timeout)

    def cancel(self) -> None:
        """Drop the tasks not started yet (a shutdown must not wait for them); running compiles
        finish on their own, and what they compiled is in the persistent cache for next time."""
        for f in self._futures:
            f.cancel()
        with self._lock:
            if not self._all_done.is_set():
                self._finish()

    def _first_groups(self) -> list[ShapeGroup]:
        return [g for g in self.plan.groups if g.first]

    def _run(self, task: CompileTask) -> None:
        try:
            task.run()
        except BaseException as e:  # one program's failure must not stop the others
            log.exception("warm-up: compiling %s failed", task.key)
            self._failed[task.key] = e
        ready = []
        with self._lock:
            if self._all_done.is_set():  # cancelled
                return
            self._done += 1
            for shape, pending in self._pending.items():
                if task.key in pending:
                    pending.discard(task.key)
                    if not pending and not any(k in self._failed for k in self._group(shape).tasks):
                        ready.append(shape)
            if self._bar is not None:
                self._bar.update(1)
        for shape in ready:
            self._group_ready(shape)
        self._check_first()
        with self._lock:
            if self._done == self.total and not self._all_done.is_set():
                self._finish()

    def _group(self, shape: Hashable) -> ShapeGroup:
        return next(g for g in self.plan.groups if g.shape == shape)

    def _group_ready(self, shape: Hashable) -> None:
        self._on_ready(shape)
        with self._lock:
            self._ready.add(shape)

    def _check_first(self) -> None:
        # Settled once each first group is usable (its on_ready returned) or cannot become so.
        with self._lock:
            settled = all(
                g.shape in self._ready or any(k in self._failed for k in g.tasks)
                for g in self._first_groups()
            )
        if settled:
            if not self._first_done.is_set():
                log.info(
                    "warm-up: the first programs are ready after %.1f s (%d of %d tasks done)",
                    time.perf_counter() - self._t0,
                    self._done,
                    self.total,
                )
            self._first_done.set()

    def _finish(self) -> None:
        """Called with the lock held."""
        self.seconds = time.perf_counter() - self._t0
        if self._bar is not None:
            self._bar.close()
        self._first_done.set()
        self._all_done.set()
        log.info(
            "warm-up: %d of %d tasks done in %.1f s%s",
            self._done,
            self.total,
            self.seconds,
            f", {len(self._failed)} failed" if self._failed else "",
        )


# How much lower a compile thread's scheduling priority is than the serving threads' (Linux nice).
COMPILE_NICENESS = 10


def _yield_to_serving() -> None:
    """Lower this compile thread's CPU priority: on a host with few cores, the background warm-up
    must not slow the steps of the requests it serves meanwhile (XLA compiles on the calling
    thread). Linux only: elsewhere a thread's priority is left as it is."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + COMPILE_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not permitted
        pass


def _progress_bar(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="warm-up", unit="task", mininterval=1.0)
