"""Loading keeps a checkpoint's stored dtype through the layout transforms (issue 35's start-up
work): the parameter tree must hold exactly the values the all-float32 pipeline gave.

The reference is the same tiny checkpoint read as float32 first (what the loader did before: every
tensor upcast, transformed, then cast to the model dtype), compared bit for bit with the loader's
own read of the stored tensors (memory-mapped, bf16 / f16 / f32 on disk).
"""

from __future__ import annotations

import json
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from tiny_models import tiny_model  # tests/tpu_platform/tiny_models.py

from tpuserve.tpu_platform.loader.safetensors_raw import SafetensorsFiles
from tpuserve.tpu_platform.models.weights import _copy_into, _to_device, build_params
from tpuserve.tpu_platform.startup_timing import StartupTimings

_ST_DTYPES = {
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.uint8): "U8",
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
}


def _write_safetensors(path, tensors: dict[str, np.ndarray]) -> None:
    """The format's layout (safetensors_raw.py's docstring), written directly: the safetensors
    package's numpy writer has no bfloat16."""
    header, offset, blobs = {}, 0, []
    for name, t in tensors.items():
        data = np.ascontiguousarray(t).tobytes()
        header[name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
        blobs.append(data)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def _bits(tree) -> dict:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(p): (np.asarray(x).dtype, np.asarray(x).tobytes()) for p, x in leaves}


@pytest.mark.parametrize("stored", [np.float32, ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("target", [jnp.float32, jnp.bfloat16])
def test_stored_dtype_load_equals_f32_pipeline(tmp_path, stored, target):
    arch, tensors, _ = tiny_model("qwen2", layers=3, tied=False)  # qkv biases, separate LM head
    stored_tensors = {k: v.astype(stored) for k, v in tensors.items()}
    _write_safetensors(tmp_path / "model.safetensors", stored_tensors)
    raw = SafetensorsFiles([str(tmp_path / "model.safetensors")]).get
    timings = StartupTimings()
    got = build_params(arch, raw, target, timings=timings)
    # the reference: every stored tensor upcast to f32 before any transform
    want = build_params(arch, lambda n: None if raw(n) is None else raw(n).astype(np.float32), target)
    got_bits, want_bits = _bits(got), _bits(want)
    assert got_bits.keys() == want_bits.keys()
    for k in want_bits:
        assert got_bits[k] == want_bits[k], k
    assert {"layer transforms", "stack layers", "to device"} <= set(timings.as_dict())


def test_qkv_layout_from_bf16_checkpoint(tmp_path):
    """One stacked tensor checked against the layout formula, independently of build_params."""
    arch, tensors, _ = tiny_model("llama", layers=2)
    _write_safetensors(
        tmp_path / "model.safetensors", {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    )
    got = build_params(arch, SafetensorsFiles([str(tmp_path / "model.safetensors")]).get, jnp.bfloat16)
    hkv, d, hid = arch.num_kv_heads, arch.head_dim, arch.hidden_size
    for i in range(arch.num_layers):
        p = f"model.layers.{i}.self_attn."
        q, k, v = (tensors[p + f"{n}_proj.weight"].astype(ml_dtypes.bfloat16).T for n in "qkv")
        want = np.concatenate(
            [q.reshape(hid, hkv, -1, d), k.reshape(hid, hkv, 1, d), v.reshape(hid, hkv, 1, d)], axis=-2
        )
        np.testing.assert_array_equal(np.asarray(got["layers"]["qkv"][i]), want)
        assert got["layers"]["qkv"].dtype == jnp.bfloat16


def test_device_cast_equals_the_old_cast():
    """``_to_device`` casts exactly as ``jnp.asarray(host, dtype)`` did, special values included
    (subnormals, ties, infinities, NaN payloads: a device cast to f16 rounds those differently)."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 1 << 16, dtype=np.uint64).astype(np.uint32)
    x = np.concatenate(
        [
            bits.view(np.float32),
            np.array(
                [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-45, 1.0 + 2**-8, 1.0 + 3 * 2**-8], np.float32
            ),
        ]
    )
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        a, b = np.asarray(_to_device(x, dtype)), np.asarray(jnp.asarray(x, dtype))
        assert a.dtype == b.dtype
        assert a.tobytes() == b.tobytes(), dtype


def test_tiled_copy_equals_assignment():
    """The tiled copy of transposed views (several tiles: axes longer than _TILE) moves the same
    values as a plain assignment, and refuses a shape it would broadcast."""
    x = np.random.default_rng(1).standard_normal((200, 130)).astype(ml_dtypes.bfloat16)
    for src in (x.T, x.T.reshape(130, 4, 5, 10), x[:, ::2], x):
        dst = np.empty(src.shape, src.dtype)
        _copy_into(dst, src)
        np.testing.assert_array_equal(dst, src)
    with pytest.raises(ValueError):
        _copy_into(np.empty((2, 130, 200), x.dtype), x.T)
