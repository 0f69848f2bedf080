"""Where one engine's start-up time goes: a per-phase record (issue 35).

Each engine (its ``Worker``) owns one ``StartupTimings``; the loader, the worker, the runner's
memory plan and the warm-up add their phases to it, the engine logs it once at INFO in one line
when it is ready, and ``benchmarks/startup.py`` writes ``as_dict()`` into its JSON. Nothing is
global: two engines in one process keep two records.

Phases on the main thread run one after another, so their sum is (nearly) the wall time. A phase
run on a helper thread beside them (the tokenizer) is marked ``background``: it is not part of
that sum, and the main thread's wait for it, if any, is a phase of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class Phase:
    name: str
    seconds: float
    background: bool = False  # ran on another thread, overlapping the phases around it


@dataclass
class StartupTimings:
    phases: list[Phase] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)  # perf_counter() when the record began
    logged: bool = False  # the one INFO line was written (log_once)
    # Phases may be added from a helper thread (the tokenizer's); the list is shared.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, name: str, seconds: float, *, background: bool = False) -> None:
        """Charge ``seconds`` to phase ``name``; a name seen before accumulates (a phase entered
        once per layer or per key stays one entry, in the order it first ran)."""
        with self._lock:
            for p in self.phases:
                if p.name == name and p.background == background:
                    p.seconds += seconds
                    return
            self.phases.append(Phase(name, seconds, background))

    @contextmanager
    def phase(self, name: str, *, background: bool = False) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0, background=background)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def as_dict(self) -> dict[str, float]:
        """{phase: seconds} in the order the phases first ran; background ones as "name (bg)"."""
        with self._lock:
            return {(f"{p.name} (bg)" if p.background else p.name): p.seconds for p in self.phases}

    def summary(self) -> str:
        with self._lock:
            phases = list(self.phases)
        parts = [f"{p.name} {p.seconds:.2f}" + (" (background)" if p.background else "") for p in phases]
        accounted = sum(p.seconds for p in phases if not p.background)
        return f"start-up {self.elapsed():.1f} s ({accounted:.1f} s in phases): " + ", ".join(parts)

    def log_once(self, logger: logging.Logger) -> None:
        """The one INFO line, when the engine is ready (the first caller writes it)."""
        with self._lock:
            if self.logged:
                return
            self.logged = True
        logger.info("%s", self.summary())
