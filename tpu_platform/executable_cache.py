"""Compiled step programs kept on disk, so a restart with the same model and flags traces nothing.

JAX's persistent compilation cache skips XLA's compile on a restart, but every program is still
traced and lowered first (the cache key is the lowered module's hash): on a 2-core CPU host that
was 44 s of a 54 s warm restart of the default model, all of it Python under the GIL. Here a
compiled executable is stored under a key computed *without tracing*: the program's name, the
abstract signature of its arguments (shapes, dtypes, shardings, the tree structure), and a context
string naming everything the trace closes over (the engine config, the model architecture, the
attention implementation, FP8 KV scales...) together with the tpuserve sources' hash and the
jax / jaxlib versions and devices. A hit is deserialized and called directly (a ``Compiled`` has
the same C++ dispatch path as ``jax.jit``).

Anything that goes wrong (a file from another build, a pytree that does not pickle) is a miss
and a log line, never an error: the program is then traced and compiled as without this cache.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
from typing import Any

import jax

log = logging.getLogger(__name__)

# The packages whose code a step program is traced from.
_TRACED_PACKAGES = ("attention", "kv_cache", "moe", "quant", "tpu_platform")
_FORMAT = 1  # bump when what a file holds changes


@functools.lru_cache(maxsize=1)
def sources_digest() -> str:
    """sha256 over the .py files of the packages step programs are traced from (read once)."""
    import importlib

    h = hashlib.sha256()
    for name in _TRACED_PACKAGES:
        root = os.path.dirname(importlib.import_module(f"tpuserve.{name}").__file__ or "")
        for dirpath, dirnames, filenames in sorted(os.walk(root)):
            dirnames.sort()
            for f in sorted(filenames):
                if f.endswith(".py"):
                    h.update(f"{name}/{os.path.relpath(os.path.join(dirpath, f), root)}\0".encode())
                    with open(os.path.join(dirpath, f), "rb") as fh:
                        h.update(fh.read())
    return h.hexdigest()


def signature(args: Any) -> str:
    """The abstract signature of a program's arguments: tree structure, then per leaf its shape,
    dtype and sharding (a concrete array and its ShapeDtypeStruct alike)."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    parts = [str(tree)]
    for x in leaves:
        shape = getattr(x, "shape", None)
        dtype = getattr(x, "dtype", None)
        if shape is None or dtype is None:
            parts.append(f"py:{type(x).__name__}:{x!r}")  # a Python scalar is baked into the trace
            continue
        # The sharding only: a concrete array also reports its memory layout, which a stand-in
        # need not name (a pinned cache layout follows from the context's attention impl).
        parts.append(f"{tuple(shape)}:{dtype}:{getattr(x, 'sharding', None)}")
    return "\n".join(parts)


class ExecutableCache:
    """A directory of serialized executables (``jax.experimental.serialize_executable``)."""

    def __init__(self, directory: str, context: str):
        self.directory = directory
        versions = f"jax {jax.__version__} jaxlib {jax.lib.__version__}"
        devices = ",".join(f"{d.platform}:{d.device_kind}" for d in jax.devices())
        self._context = "\n".join((f"format {_FORMAT}", versions, devices, sources_digest(), context))
        self.hits = 0
        self.misses = 0

    def key(self, name: str, args: Any) -> str:
        h = hashlib.sha256(self._context.encode())
        h.update(f"\0{name}\0".encode())
        h.update(signature(args).encode())
        return f"{name}-{h.hexdigest()[:40]}"

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, key + ".exe")

    def load(self, key: str):
        """The executable stored under ``key``, loaded onto this process's devices; None on a miss."""
        from jax.experimental.serialize_executable import deserialize_and_load

        path = self._path(key)
        if not os.path.exists(path):
            self.misses += 1
            return None
        try:
            with open(path, "rb") as f:
                payload, in_tree, out_tree = pickle.load(f)
            compiled = deserialize_and_load(payload, in_tree, out_tree)
        except Exception as e:  # a file from another build or a torn write: compile instead
            log.warning("executable cache: %s unreadable (%s: %s); compiling it", path, type(e).__name__, e)
            self.misses += 1
            return None
        self.hits += 1
        return compiled

    def compiled(self, name: str, jitted, args: tuple, static: dict | None = None):
        """``jitted.lower(*args, **static).compile()``, loaded from here when stored (then nothing is
        traced) and stored here otherwise. Static arguments are part of the key (by their repr);
        the executable is called without them."""
        static = static or {}
        key = self.key(name, (args, sorted(static.items())) if static else args)
        program = self.load(key)
        if program is None:
            program = jitted.lower(*args, **static).compile()
            self.save(key, program)
        return program

    def save(self, key: str, compiled) -> None:
        """Store ``compiled`` under ``key`` (atomically: a reader sees the whole file or none)."""
        from jax.experimental.serialize_executable import serialize

        try:
            blob = pickle.dumps(serialize(compiled))
        except Exception as e:  # e.g. a pytree node that does not pickle: this program stays uncached
            log.info("executable cache: %s not stored (%s: %s)", key, type(e).__name__, e)
            return
        try:
            os.makedirs(self.directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, self._path(key))
        except OSError as e:
            log.warning("executable cache: cannot write %s (%s)", self._path(key), e)


def _leaf_key(x: Any) -> Any:
    """What of one argument decides the executable that takes it: shape, dtype and placement of an
    array; the type of a Python scalar (traced weakly typed, its value is an operand)."""
    shape = getattr(x, "shape", None)
    if shape is None:
        return type(x)
    return (shape, x.dtype, getattr(x, "sharding", None))


class CachedJit:
    """A jitted function called through executables of an ``ExecutableCache``, one per argument
    signature, so a restart loads the small programs around the forward (the sampler's stages, the
    prompt-logprobs head) instead of tracing and lowering them again: on a TPU v5e those were 2.5 of
    the 2.9 s a warm engine spent on its first programs.

    Without a cache (``disk`` None: CPU by default, several processes) it is the jitted function
    itself. The lookup per call (a tree flatten and a dict probe, a few microseconds) is what a
    step pays for it."""

    def __init__(self, name: str, jitted, disk: ExecutableCache | None):
        self.name = name
        self.jitted = jitted
        self.disk = disk
        self._programs: dict[tuple, Any] = {}

    def __call__(self, *args, **static):
        if self.disk is None:
            return self.jitted(*args, **static)
        leaves, tree = jax.tree_util.tree_flatten(args)
        key = (tree, tuple(sorted(static.items())), tuple(_leaf_key(x) for x in leaves))
        program = self._programs.get(key)
        if program is None:  # two threads may both build it: the same program, the last one kept
            program = self._programs[key] = self.disk.compiled(self.name, self.jitted, args, static)
        return program(*args)

    def lower(self, *args, **static):
        return self.jitted.lower(*args, **static)
