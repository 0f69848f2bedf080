"""tpu-inference's ragged paged attention v3 (the kernel vLLM's TPU backend runs) as a benchmark peer.

Nothing of tpu-inference is vendored: its published wheel is found (or downloaded) at run time and
only the v3 kernel is imported from it, without the package's dependencies (torch, vllm, a newer jax).
Where the wheel is looked for, first hit wins:

1. ``find_package(path)``: a ``tpu_inference`` folder, the folder holding one, or a wheel file;
2. ``$TPU_INFERENCE_DIR`` (``../shared/tpu/on_tpu_setup.sh`` unzips a carried wheel to
   ``/tmp/rpa/tpu_inference`` and exports it);
3. ``~/.cache/tpuserve/tpu-inference-<VERSION>/``: an unzipped copy, else a wheel there
   (``download_wheel`` puts one there with pip);
4. ``.whl-tpu/rpa/*.whl`` in this checkout (``build_carry.sh --rpa``).

Loading: the package's ``__init__`` imports vllm, so a bare module named ``tpu_inference`` whose
``__path__`` is the unzipped folder is registered first; the kernel modules under it import only
jax. On jax 0.10.2 the kernel calls one function jax does not have under that name
(``pltpu.reciprocal``; jax has ``pl.reciprocal``): the loaded module gets its own view of ``pltpu``
with that name added. jax itself is not changed.

Calling convention, next to ours (attention/pallas_tpu.py):

* cache: ours is ``[pages, page_size, C, D]`` with K and V interleaved on the combined-head axis
  (combined head ``2h`` is K of KV head ``h``, ``2h+1`` its V; C >= 2*Hkv, the rest zero padding).
  v3's is ``[pages, page_size, align(2*Hkv, packing) / packing, packing, align(D, 128)]`` with the
  same interleave, ``packing`` values of the dtype per 32-bit word (bf16: 2) and head_dim padded to
  128 lanes (a head_dim-64 model reads twice its KV bytes through it). For head_dim 64
  tpu-inference runs another kernel (``kernel_hd64``, ``for_head_dim``) whose cache is dense:
  ``[pages, page_size, align(Hkv, packing) / packing, packing, 128]``, K of a KV head in lanes 0-63
  and its V in 64-127. ``to_peer_cache`` / ``from_peer_cache`` convert (``hd64=True`` for that one).
* new KV: ours takes this step's ``[T, 2*Hkv, D]`` interleaved; v3 takes keys and values apart
  (``split_new_kv``). Both kernels write them into the cache themselves.
* sequences: v3 wants decode sequences first and a ``distribution`` = (end of decodes, end of
  fixed-length chunked prefills, total). ``StepLayout`` reorders a step's sequences (and their
  tokens) that way, as tpu-inference's runner does (decodes first, no chunked-prefill group: its
  runner passes ``(decodes, decodes, total)``), and maps the output back to our token order.
* page table: ours ``[slots, pages_per_seq]``, v3's flattened.
* ``sm_scale`` is explicit (v3's default is 1.0): pass ``1/sqrt(D)``.
* the head_dim-64 variant has no attend-only mode (it always writes the step's K/V), and takes its
  block sizes from a tuned table keyed by the chip's name (``device_name``); that table's module
  imports vllm and torch for a logger and the name, so stand-ins for those two helpers are
  registered instead (``_stand_in_for_package_helpers``).
* v3's jit donates queries, keys, values and the cache; called inside another jit only that outer
  function's donation counts (the benchmark donates the cache alone, as for ours).

Block sizes: v3 takes (bq, bkv, bq_compute, bkv_compute) per case (decode / chunked prefill / mixed)
or, given none, derives them from a formula per TPU generation (``get_default_block_sizes``; the
tuned tables in the wheel, which import vllm, are not read by this entry point, and tpu-inference
passes none unless its RPA_V3_*_BLOCK_SIZES variables are set). ``attention`` passes none, as
tpu-inference does; ``default_block_sizes`` reports what the formula picked. Off a TPU (lowering
and interpret runs on CPU) v3's device queries are answered for a v5e.
"""

from __future__ import annotations

import contextlib
import glob
import os
import subprocess
import sys
import tempfile
import types
import zipfile

import numpy as np

VERSION = "0.32.0"
KERNEL_MODULE = "tpu_inference.kernels.ragged_paged_attention.v3.kernel"
# tpu-inference's attention backend runs this variant, not the one above, for head_dim-64 models.
KERNEL_HD64_MODULE = "tpu_inference.kernels.ragged_paged_attention.v3.kernel_hd64"
TUNED_HD64_MODULE = "tpu_inference.kernels.ragged_paged_attention.v3.tuned_block_sizes_hd64"
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "tpuserve", f"tpu-inference-{VERSION}")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V5E_VMEM_BYTES = 128 * 2**20  # a v5e's VMEM capacity: v3's default vmem limit on that chip


class PeerUnavailable(RuntimeError):
    """The wheel is not here (or cannot be imported); the message says where it was looked for."""


# ----------------------------------------------------------------------------- finding the wheel


def _unzip(wheel: str, dest: str) -> str:
    """Extract ``wheel`` into ``dest`` (atomically: a half-written folder is never used)."""
    if os.path.isdir(os.path.join(dest, "tpu_inference")):
        return os.path.join(dest, "tpu_inference")
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".unzip-", dir=os.path.dirname(dest))
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp)
    try:
        os.rename(tmp, dest)
    except OSError:  # another process got there first
        pass
    return os.path.join(dest, "tpu_inference")


def _package_in(path: str) -> str | None:
    if os.path.isfile(path) and path.endswith(".whl"):
        name = os.path.basename(path)[: -len(".whl")]
        return _unzip(path, os.path.join(os.path.dirname(path), name + "-unzipped"))
    if os.path.isfile(os.path.join(path, "kernels", "ragged_paged_attention", "v3", "kernel.py")):
        return path
    inner = os.path.join(path, "tpu_inference")
    if os.path.isdir(inner):
        return _package_in(inner)
    return None


def find_package(path: str | None = None) -> str:
    """The ``tpu_inference`` package folder to import the kernel from (see the module doc)."""
    looked = []
    if path:
        found = _package_in(path)
        if found:
            return found
        raise PeerUnavailable(f"no tpu_inference package or wheel at {path!r}")
    env = os.environ.get("TPU_INFERENCE_DIR")
    if env:
        found = _package_in(env)
        if found:
            return found
        looked.append(f"$TPU_INFERENCE_DIR={env}")
    unzipped = os.path.join(CACHE_DIR, "unzipped")
    if os.path.isdir(os.path.join(unzipped, "tpu_inference")):
        return os.path.join(unzipped, "tpu_inference")
    wheels = sorted(glob.glob(os.path.join(CACHE_DIR, f"tpu_inference-{VERSION}-*.whl")))
    wheels += sorted(glob.glob(os.path.join(REPO, ".whl-tpu", "rpa", "tpu_inference-*.whl")))
    looked += [CACHE_DIR, os.path.join(REPO, ".whl-tpu", "rpa")]
    if wheels:
        return _unzip(wheels[0], unzipped)
    raise PeerUnavailable(
        f"tpu-inference {VERSION} wheel not found (looked in {', '.join(looked)}); get it with "
        f"`pip download --no-deps tpu-inference=={VERSION} -d {CACHE_DIR}` or, for a TPU run, "
        "`bash ../shared/tpu/build_carry.sh --rpa`"
    )


def download_wheel(timeout: float = 120.0) -> str:
    """pip-download the wheel (no dependencies) into CACHE_DIR once; returns its path."""
    have = glob.glob(os.path.join(CACHE_DIR, f"tpu_inference-{VERSION}-*.whl"))
    if have:
        return have[0]
    os.makedirs(CACHE_DIR, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    cmd += ["-d", CACHE_DIR, f"tpu-inference=={VERSION}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise PeerUnavailable(f"pip download tpu-inference=={VERSION} failed: {e}") from e
    have = glob.glob(os.path.join(CACHE_DIR, f"tpu_inference-{VERSION}-*.whl"))
    if done.returncode != 0 or not have:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise PeerUnavailable(f"pip download tpu-inference=={VERSION} failed: {' | '.join(tail)}")
    return have[0]


def package_version(package_dir: str) -> str | None:
    """The version in the ``.dist-info`` folder beside the package (None if there is none)."""
    infos = glob.glob(os.path.join(os.path.dirname(package_dir), "tpu_inference-*.dist-info"))
    if not infos:
        return None
    return os.path.basename(infos[0])[len("tpu_inference-") : -len(".dist-info")]


# ----------------------------------------------------------------------------- importing the kernel


def load(path: str | None = None) -> types.ModuleType:
    """Import v3's kernel module from the wheel without running the package's own ``__init__``."""
    package_dir = os.path.abspath(find_package(path))
    present = sys.modules.get("tpu_inference")
    if present is None:
        stub = types.ModuleType("tpu_inference")
        stub.__path__ = [package_dir]
        stub.__file__ = None
        sys.modules["tpu_inference"] = stub
    elif [os.path.abspath(p) for p in getattr(present, "__path__", [])] != [package_dir]:
        raise PeerUnavailable(
            f"a different tpu_inference is already imported ({getattr(present, '__path__', None)})"
        )
    return _import_kernel(KERNEL_MODULE, package_dir)


def _import_kernel(name: str, package_dir: str) -> types.ModuleType:
    import importlib

    try:
        kernel = importlib.import_module(name)
    except ImportError as e:
        raise PeerUnavailable(f"importing {name} from {package_dir} failed: {e}") from e
    _add_missing_reciprocal(kernel)
    return kernel


def is_hd64(kernel: types.ModuleType) -> bool:
    return kernel.__name__ == KERNEL_HD64_MODULE


def for_head_dim(kernel: types.ModuleType, head_dim: int) -> types.ModuleType:
    """The v3 kernel tpu-inference runs for ``head_dim``: at 64 its head_dim-64 variant (a dense
    cache: K and V of a KV head side by side in one 128-lane row), else ``kernel`` (from ``load``)."""
    if head_dim != 64 or is_hd64(kernel):
        return kernel
    _stand_in_for_package_helpers()
    return _import_kernel(KERNEL_HD64_MODULE, sys.modules["tpu_inference"].__path__[0])


class _OnceLogger:
    """What the variant's block-size table asks of tpu-inference's logger: a logger with
    ``warning_once`` / ``info_once``."""

    def __init__(self, name: str):
        import logging

        self._log, self._seen = logging.getLogger(name), set()

    def __getattr__(self, attr):
        if attr.endswith("_once"):
            level = attr[: -len("_once")]

            def once(msg, *args):
                if (level, msg, args) not in self._seen:
                    self._seen.add((level, msg, args))
                    getattr(self._log, level)(msg, *args)

            return once
        return getattr(self._log, attr)


def device_name() -> str:
    """The chip's name as the variant's tuned table keys it ("TPU v5e" for a v5e's "TPU v5 lite");
    off a TPU, a v5e's."""
    import jax

    kind = jax.devices()[0].device_kind if on_tpu() else "TPU v5 lite"
    return kind[: -len(" lite")] + "e" if kind.endswith(" lite") else kind


def _stand_in_for_package_helpers() -> None:
    """The variant's tuned table imports ``tpu_inference.logger`` (needs vllm) and
    ``tpu_inference.utils`` (needs torch) for a logger and the device's name only: stand-ins for
    both, registered once, so neither vllm nor torch is imported."""
    for name, attr, value in (
        ("tpu_inference.logger", "init_logger", _OnceLogger),
        ("tpu_inference.utils", "get_device_name", lambda num_devices=None: device_name()),
    ):
        if name not in sys.modules:
            module = types.ModuleType(name)
            setattr(module, attr, value)
            sys.modules[name] = module


def _add_missing_reciprocal(kernel: types.ModuleType) -> None:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    if getattr(kernel, "pltpu", None) is not pltpu or hasattr(pltpu, "reciprocal"):
        return
    view = types.ModuleType(pltpu.__name__)
    view.__dict__.update(pltpu.__dict__)
    view.reciprocal = pl.reciprocal
    kernel.pltpu = view


# ----------------------------------------------------------------------------- layout conversion


def align(x: int, a: int) -> int:
    return -(-x // a) * a


def packing(dtype) -> int:
    """Values of ``dtype`` per 32-bit word (v3 packs that many combined heads on one axis)."""
    return 4 // np.dtype(dtype).itemsize


def peer_cache_shape(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype):
    p = packing(dtype)
    return (num_pages, page_size, align(2 * num_kv_heads, p) // p, p, align(head_dim, 128))


def peer_cache_shape_hd64(num_pages: int, page_size: int, num_kv_heads: int, dtype):
    p = packing(dtype)
    return (num_pages, page_size, align(num_kv_heads, p) // p, p, 128)


def to_peer_cache(cache, num_kv_heads: int, hd64: bool = False):
    """Our ``[..., pages, page_size, C, D]`` cache in v3's layout (padding heads dropped, v3's
    own padding added: combined heads to the packing, head_dim to 128). ``hd64``: the head_dim-64
    variant's, ``[..., pages, page_size, align(Hkv, packing) / packing, packing, 128]`` with K of
    a KV head in lanes 0-63 and its V in 64-127."""
    import jax.numpy as jnp

    *lead, pages, ps, _, d = cache.shape
    if hd64:
        p = packing(cache.dtype)
        heads = align(num_kv_heads, p)
        x = jnp.concatenate(
            [cache[..., 0 : 2 * num_kv_heads : 2, :], cache[..., 1 : 2 * num_kv_heads : 2, :]], -1
        )
        if heads > num_kv_heads:
            x = jnp.pad(x, [(0, 0)] * (len(lead) + 2) + [(0, heads - num_kv_heads), (0, 0)])
        return x.reshape(*lead, pages, ps, heads // p, p, 2 * d)
    p = packing(cache.dtype)
    heads = align(2 * num_kv_heads, p)
    x = cache[..., : 2 * num_kv_heads, :]
    pad = [(0, 0)] * (len(lead) + 2) + [(0, heads - 2 * num_kv_heads), (0, align(d, 128) - d)]
    if any(hi for _, hi in pad):
        x = jnp.pad(x, pad)
    return x.reshape(*lead, pages, ps, heads // p, p, align(d, 128))


def from_peer_cache(
    peer_cache, num_kv_heads: int, head_dim: int, combined_heads: int | None = None, hd64: bool = False
):
    """v3's cache (``hd64``: its head_dim-64 variant's) back in our layout, with ``combined_heads``
    (default 2*Hkv) combined heads."""
    import jax.numpy as jnp

    *lead, pages, ps, hp, p, dp = peer_cache.shape
    if hd64:
        x = peer_cache.reshape(*lead, pages, ps, hp * p, dp)[..., :num_kv_heads, :]
        x = jnp.stack([x[..., :head_dim], x[..., head_dim:]], axis=-2)  # [.., Hkv, 2, D]: K then V
        x = x.reshape(*lead, pages, ps, 2 * num_kv_heads, head_dim)
    else:
        x = peer_cache.reshape(*lead, pages, ps, hp * p, dp)[..., : 2 * num_kv_heads, :head_dim]
    c = combined_heads or 2 * num_kv_heads
    if c > 2 * num_kv_heads:
        x = jnp.pad(x, [(0, 0)] * (len(lead) + 2) + [(0, c - 2 * num_kv_heads), (0, 0)])
    return x


def split_new_kv(new_kv):
    """This step's interleaved ``[T, 2*Hkv(+pad), D]`` K/V as v3's (keys, values) ``[T, Hkv, D]``."""
    return new_kv[:, 0::2], new_kv[:, 1::2]


class StepLayout:
    """One step's sequences in v3's order (decodes first) and metadata in its form, from ours.

    ``kv_lens [slots]``, ``page_indices [slots, pps]``, ``cu_q_lens [slots+1]`` and ``num_seqs`` as
    the numpy arrays our kernel gets. Tokens past the last sequence (padding) keep their places at
    the end. ``permute_tokens`` puts an array indexed by our token order into v3's; ``restore_tokens``
    does the reverse (both are identity, no gather, when the order does not change)."""

    def __init__(self, kv_lens, page_indices, cu_q_lens, num_seqs, num_tokens: int):
        kv_lens, page_indices = np.asarray(kv_lens), np.asarray(page_indices)
        cu_q_lens = np.asarray(cu_q_lens)
        n = int(np.asarray(num_seqs).reshape(-1)[0])
        q_lens = np.diff(cu_q_lens[: n + 1])
        decode = q_lens == 1
        order = np.concatenate([np.flatnonzero(decode), np.flatnonzero(~decode)]).astype(np.int64)
        self.num_seqs, self.num_decodes = n, int(decode.sum())
        self.reordered = bool(np.any(order != np.arange(n)))
        slots = len(kv_lens)
        full = np.concatenate([order, np.arange(n, slots)])
        self.kv_lens = kv_lens[full].astype(np.int32)
        self.page_indices = page_indices[full].reshape(-1).astype(np.int32)
        cu = np.zeros(slots + 1, np.int32)
        cu[1 : n + 1] = np.cumsum(q_lens[order])
        cu[n + 1 :] = cu[n]
        self.cu_q_lens = cu
        self.distribution = np.asarray([self.num_decodes, self.num_decodes, n], np.int32)
        gather = [np.arange(cu_q_lens[i], cu_q_lens[i + 1]) for i in order]
        gather.append(np.arange(cu_q_lens[n], num_tokens))
        self.token_order = np.concatenate(gather).astype(np.int32)
        self.inverse_order = np.argsort(self.token_order).astype(np.int32)

    def metadata(self):
        """(kv_lens, page_indices, cu_q_lens, distribution) as v3 takes them (numpy)."""
        return self.kv_lens, self.page_indices, self.cu_q_lens, self.distribution

    def permute_tokens(self, x):
        return x[self.token_order[: x.shape[0]]] if self.reordered else x

    def restore_tokens(self, x):
        """``x`` may stop after the last real token (v3's reference returns no padding rows)."""
        return x[self.inverse_order[: x.shape[0]]] if self.reordered else x


# ----------------------------------------------------------------------------- calling it


def on_tpu() -> bool:
    import jax

    return jax.devices()[0].platform == "tpu"


@contextlib.contextmanager
def _as_v5e_off_tpu(kernel):
    """Off a TPU, v3 asks the device for its generation (-1: no defaults); answer 5 (a v5e). The
    head_dim-64 variant asks from its block-size table's module."""
    if on_tpu():
        yield
        return
    modules = [sys.modules[TUNED_HD64_MODULE]] if is_hd64(kernel) else [kernel]
    real = [m.get_tpu_version for m in modules]
    for m in modules:
        m.get_tpu_version = lambda: 5
    try:
        yield
    finally:
        for m, f in zip(modules, real):
            m.get_tpu_version = f


def default_block_sizes(
    kernel,
    q_dtype,
    kv_dtype,
    num_q_heads,
    num_kv_heads,
    head_dim,
    page_size,
    max_num_tokens,
    max_num_seqs,
    pages_per_seq,
) -> dict:
    """The decode and mixed block sizes v3's formula gives at this shape (what it runs when none are
    passed; with its chunked-prefill group unused these are the two kernels a step launches), as
    ``{case: (bq, bkv, bq_compute, bkv_compute)}``. Off a TPU it answers for a v5e. A compute
    size above its block (small steps) is clipped by the kernel, but refused if passed in. The
    head_dim-64 variant's are ``(bq, bkv)`` from its tuned table, the same for both cases."""
    args = (
        q_dtype,
        kv_dtype,
        num_q_heads,
        num_kv_heads,
        head_dim,
        page_size,
        max_num_tokens,
        max_num_seqs,
        pages_per_seq,
    )
    out = {}
    if is_hd64(kernel):  # one (pages, queries) pair from its tuned table, for every step
        with _as_v5e_off_tpu(kernel):
            tuned = sys.modules[TUNED_HD64_MODULE].get_tuned_block_sizes
            bkv_p, bq = tuned(*args[:7], pages_per_seq)  # its table takes no max_num_seqs
        return {"decode": (bq, bkv_p * page_size), "mixed": (bq, bkv_p * page_size)}
    with _as_v5e_off_tpu(kernel):
        for name, case in (("decode", kernel.RpaCase.DECODE), ("mixed", kernel.RpaCase.MIXED)):
            b = kernel.get_default_block_sizes(*args, case=case)
            out[name] = (b["bq_sz"], b["bkv_sz"], b["bq_csz"], b["bkv_csz"])
    return out


@contextlib.contextmanager
def v5e_lowering():
    """Lower for a v5e with no TPU attached: Mosaic's lowering asks the device for its chip (v3's
    sign() does), so an abstract TPU v5e device is set for the trace. For ``jax.export`` on CPU."""
    import jax

    dev = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)):
        yield


def vmem_limit_bytes() -> int:
    """v3's default VMEM limit: the chip's VMEM capacity (a v5e's off a TPU)."""
    if on_tpu():
        from jax.experimental.pallas import tpu as pltpu

        return int(pltpu.get_tpu_info().vmem_capacity_bytes)
    return V5E_VMEM_BYTES


def attention(
    kernel,
    q,
    keys,
    values,
    peer_cache,
    kv_lens,
    page_indices,
    cu_q_lens,
    distribution,
    *,
    sm_scale: float,
    update_kv_cache: bool = True,
    sliding_window=None,
    soft_cap=None,
    blocks: dict | None = None,
):
    """v3 on inputs already in its order and layout -> (out [T, Hq, D] in its token order, cache).

    Block sizes and the VMEM limit are v3's defaults unless ``blocks`` (``{"d_block_sizes": ...}``)
    is given. It runs compiled on a TPU only: off a TPU this is for lowering it for one
    (``jax.export(..., platforms=["tpu"])``). Pallas's interpret modes cannot run it on jax 0.10.2
    (the TPU interpreter has no reshaped-ref DMAs, the generic one no dynamic-size slices)."""
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, **(blocks or {}))
    if is_hd64(kernel):  # the head_dim-64 variant: its own entry point, always writing the step's K/V
        if not update_kv_cache:
            raise ValueError("v3's head_dim-64 kernel always writes the step's K/V (no update_kv_cache)")
        with _as_v5e_off_tpu(kernel):
            return kernel.ragged_paged_attention_hd64(
                q, keys, values, peer_cache, kv_lens, page_indices, cu_q_lens, distribution, **kw
            )
    kw["update_kv_cache"] = update_kv_cache
    if not on_tpu():
        kw["vmem_limit_bytes"] = V5E_VMEM_BYTES  # its default asks the attached chip
    with _as_v5e_off_tpu(kernel):
        return kernel.ragged_paged_attention(
            q, keys, values, peer_cache, kv_lens, page_indices, cu_q_lens, distribution, **kw
        )
