"""``linear``: the one place the model multiplies activations by a weight.

Every projection (qkv, o, gate_up, down, the LM head) calls ``linear(x, w, bias)``. It picks an
implementation from the weight's type in the active ``LinearImpls``: each runner owns one
(``quant_linear_impls()`` routes every quantized record type of ``quant/``: FP8, MXFP4, NVFP4) and
activates it while its programs trace, so engines in one process never share a routing table and a
quantized weight record plugs in without the decoder changing. Plain arrays (``jax.Array``, tracers
under jit, ``np.ndarray``) take the dense path, with or without an active table.

Weights are ``[in, *out]``: the first axis is contracted with the last axis of ``x``, the remaining
axes are kept (qkv is ``[H, Hkv, G+2, D]``, so its output is ``[T, Hkv, G+2, D]`` with no reshape in
the model).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tpuserve.quant.dispatch import IMPLS as QUANT_IMPLS
from tpuserve.quant.dispatch import RECORD_TYPES, quant_linear

# fn(x [..., in], w, bias [*out] | None, out_dtype | None) -> [..., *out]
LinearFn = Callable[[jax.Array, Any, Any, Any], jax.Array]


@dataclasses.dataclass(frozen=True)
class LayerOfStack:
    """Layer ``layer`` (an i32 scalar, a scan's counter) of a weight stacked over layers, handed to
    ``linear`` unsliced. A scan's sliced weight that feeds a Pallas kernel is materialized (copied
    out of the stack every layer of every step); the quantized kernels read the layer in place
    instead. Built by the decoder for the weights ``keeps_stack_whole`` accepts, only while tracing.
    """

    stack: Any
    layer: Any


def keeps_stack_whole(w) -> bool:
    """Whether a layer scan should pass this stacked weight whole (as a ``LayerOfStack``): the
    quantized records, whose kernels index the layer themselves. Dense arrays stay sliced: XLA fuses
    their slice into the dot."""
    return isinstance(w, RECORD_TYPES)


class LinearImpls:
    """Which function multiplies by which weight type: one runner's table (never process-wide)."""

    def __init__(self) -> None:
        self._by_type: dict[type, LinearFn] = {}
        self._reads_layer: set[type] = set()  # types whose fn takes ``layer=`` (a stacked weight)

    def register(self, weight_type: type, fn: LinearFn) -> LinearImpls:
        """Route ``linear(x, w, ...)`` to ``fn(x, w, bias, out_dtype)`` when ``w`` is a ``weight_type``;
        returns self.

        ``fn`` returns ``[..., *out]``; with ``out_dtype`` None it returns the activation dtype. A record
        that goes through ``jax.jit`` must be a registered pytree (so it keeps its type inside the trace).
        Registering a type again replaces its function.
        """
        if not isinstance(weight_type, type):
            raise TypeError(f"LinearImpls.register wants a type, got {weight_type!r}")
        self._by_type[weight_type] = fn
        return self

    def register_quant(self, impl: str = "auto", *, interpret=None) -> LinearImpls:
        """Route every quantized record type (``Fp8Weight``, ``Mxfp4Weight``, ``Nvfp4Weight``) to
        ``quant.dispatch.quant_linear``; returns self.

        impl: "auto" (the Pallas kernels on a TPU, XLA elsewhere, decided at trace time), "xla" or
        "pallas_tpu"; interpret: a ``pltpu.InterpretParams`` to run the Pallas path on CPU (tests).
        """
        if impl not in QUANT_IMPLS:
            raise ValueError(f"quantized linear impl must be one of {QUANT_IMPLS}, got {impl!r}")
        fn = functools.partial(quant_linear, impl=impl, interpret=interpret)
        for t in RECORD_TYPES:
            self.register(t, fn)
            self._reads_layer.add(t)
        return self

    @contextlib.contextmanager
    def active(self) -> Iterator[LinearImpls]:
        """``linear`` calls inside the block (in this thread or task) route through this table."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def lookup(self, w) -> LinearFn:
        for t in type(w).__mro__:  # exact registration (or a base class's) wins
            fn = self._by_type.get(t)
            if fn is not None:
                return fn
        # Tracers are jax.Array only as a virtual subclass (absent from their MRO): test with isinstance.
        if isinstance(w, (jax.Array, np.ndarray)):
            return _dense
        for t, fn in self._by_type.items():  # virtual subclasses of registered ABCs
            if isinstance(w, t):
                return fn
        known = ", ".join(t.__name__ for t in self._by_type) or "none"
        raise TypeError(
            f"linear: no implementation for weight of type {type(w).__module__}."
            f"{type(w).__qualname__} (dense arrays are built in; registered types: {known}); "
            f"add one with LinearImpls.register(type, fn) and run under its active()"
        )


def quant_linear_impls(impl: str = "auto", *, interpret=None) -> LinearImpls:
    """A table routing dense arrays and every quantized record type (``LinearImpls.register_quant``)."""
    return LinearImpls().register_quant(impl, interpret=interpret)


# The table of the code tracing now (a context variable: per thread and task, never shared state).
# None outside any runner: only dense weights multiply.
_ACTIVE: contextvars.ContextVar[LinearImpls | None] = contextvars.ContextVar("linear_impls", default=None)


def _dense(x, w, bias, out_dtype):
    # One dot_general contracting x's last axis with w's first: XLA folds the extra output axes into
    # a plain 2-D GEMM (a free reshape of a row-major weight), so [H, Hkv, G+2, D] costs what
    # [H, (Hq+2Hkv)*D] did, and a sharded output axis stays visible to the partitioner.
    y = jnp.tensordot(x, w, axes=1, preferred_element_type=out_dtype)
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y


def linear(x, w, bias=None, *, out_dtype=None):
    """``x [..., in] @ w [in, *out] (+ bias [*out]) -> [..., *out]``.

    out_dtype: None keeps the activation dtype (the dense path multiplies in it); the LM head passes
    ``jnp.float32`` so logits come out of the dot in f32 (accumulation too).
    """
    impls = _ACTIVE.get()
    if isinstance(w, LayerOfStack):
        if impls is not None and type(w.stack) in impls._reads_layer:
            return impls.lookup(w.stack)(x, w.stack, bias, out_dtype, layer=w.layer)
        # no layer-reading implementation: take the slice, as a scan would have
        w = jax.tree.map(lambda a: a[w.layer], w.stack)
    if impls is not None:
        return impls.lookup(w)(x, w, bias, out_dtype)
    if isinstance(w, (jax.Array, np.ndarray)):
        return _dense(x, w, bias, out_dtype)
    raise TypeError(
        f"linear: a weight of type {type(w).__module__}.{type(w).__qualname__} needs an active "
        f"LinearImpls (a runner activates its own while tracing; elsewhere: "
        f"`with quant_linear_impls().active():`)"
    )
