"""``linear``: the one place the model multiplies activations by a weight.

Every projection (qkv, o, gate_up, down, the LM head) calls ``linear(x, w, bias)``. It picks an
implementation from the weight's type, so a quantized weight record (FP8, MXFP4, NVFP4, ...) plugs in
with ``register_linear(RecordType, fn)`` and the decoder does not change; ``register_quant_linears()``
does that for every record type of ``quant/``. Plain arrays (``jax.Array``, tracers under jit,
``np.ndarray``) take the dense path.

Weights are ``[in, *out]``: the first axis is contracted with the last axis of ``x``, the remaining
axes are kept (qkv is ``[H, Hkv, G+2, D]``, so its output is ``[T, Hkv, G+2, D]`` with no reshape in
the model).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tpuserve.quant.dispatch import IMPLS as QUANT_IMPLS
from tpuserve.quant.dispatch import RECORD_TYPES, quant_linear

# fn(x [..., in], w, bias [*out] | None, out_dtype | None) -> [..., *out]
LinearFn = Callable[[jax.Array, Any, Any, Any], jax.Array]

_REGISTRY: dict[type, LinearFn] = {}


def register_linear(weight_type: type, fn: LinearFn) -> None:
    """Route ``linear(x, w, ...)`` to ``fn(x, w, bias, out_dtype)`` when ``w`` is a ``weight_type``.

    ``fn`` returns ``[..., *out]``; with ``out_dtype`` None it returns the activation dtype. A record
    that goes through ``jax.jit`` must be a registered pytree (so it keeps its type inside the trace).
    Registering a type again replaces its function.
    """
    if not isinstance(weight_type, type):
        raise TypeError(f"register_linear wants a type, got {weight_type!r}")
    _REGISTRY[weight_type] = fn


def register_quant_linears(impl: str = "auto", *, interpret=None) -> None:
    """Route ``linear(x, record)`` to ``quant.dispatch.quant_linear`` for every quantized record type
    (``Fp8Weight``, ``Mxfp4Weight``, ``Nvfp4Weight``); idempotent, and nothing registers at import
    time: the worker (or ``quantize_params``, or a test) calls it when the weights hold records.

    impl: "auto" (the Pallas kernels on a TPU, XLA elsewhere, decided at trace time), "xla" or
    "pallas_tpu"; interpret: a ``pltpu.InterpretParams`` to run the Pallas path on CPU (tests).
    """
    if impl not in QUANT_IMPLS:
        raise ValueError(f"quantized linear impl must be one of {QUANT_IMPLS}, got {impl!r}")
    fn = functools.partial(quant_linear, impl=impl, interpret=interpret)
    for t in RECORD_TYPES:
        register_linear(t, fn)


def _dense(x, w, bias, out_dtype):
    # One dot_general contracting x's last axis with w's first: XLA folds the extra output axes into
    # a plain 2-D GEMM (a free reshape of a row-major weight), so [H, Hkv, G+2, D] costs what
    # [H, (Hq+2Hkv)*D] did, and a sharded output axis stays visible to the partitioner.
    y = jnp.tensordot(x, w, axes=1, preferred_element_type=out_dtype)
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y


def _lookup(w) -> LinearFn:
    for t in type(w).__mro__:  # exact registration (or a base class's) wins
        fn = _REGISTRY.get(t)
        if fn is not None:
            return fn
    # Tracers are jax.Array only as a virtual subclass (absent from their MRO): test with isinstance.
    if isinstance(w, (jax.Array, np.ndarray)):
        return _dense
    for t, fn in _REGISTRY.items():  # virtual subclasses of registered ABCs
        if isinstance(w, t):
            return fn
    known = ", ".join(t.__name__ for t in _REGISTRY) or "none"
    raise TypeError(
        f"linear: no implementation for weight of type {type(w).__module__}."
        f"{type(w).__qualname__} (dense arrays are built in; registered types: {known}); "
        f"add one with register_linear(type, fn)"
    )


def linear(x, w, bias=None, *, out_dtype=None):
    """``x [..., in] @ w [in, *out] (+ bias [*out]) -> [..., *out]``.

    out_dtype: None keeps the activation dtype (the dense path multiplies in it); the LM head passes
    ``jnp.float32`` so logits come out of the dot in f32 (accumulation too).
    """
    return _lookup(w)(x, w, bias, out_dtype)
