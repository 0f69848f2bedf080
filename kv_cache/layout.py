"""The one KV cache layout shared by attention kernels, the block pool and (later) offload/transfer.

Per layer, K and V of ``page_size`` consecutive tokens of one sequence live in one *page*:

    kv_pages: [num_pages, page_size, C, head_dim]        C >= 2 * num_kv_heads

with K and V *interleaved* along the combined-head axis: combined head ``2*h`` is K of KV head
``h`` and ``2*h + 1`` is V of KV head ``h`` (``interleave_kv`` / ``split_kv`` in
``attention/dispatch.py``, which writes the pages). One DMA of a page slice therefore fetches K and V
together, which is what the Pallas kernels want, and it is the layout of jax's own
``ref_ragged_paged_attention`` so that function can serve as an independent oracle.

The attention backend chooses C (``attention/kv_cache_shape.py``, ``kv_cache_shape(impl, spec)``):

* ``reference``, ``blocked``, ``pallas_gpu``: C = 2*Hkv exactly.
* ``pallas_tpu`` / ``pallas_tpu_interpret``: C = 2*Hkv rounded up to a multiple of the TPU
  sublane tile of the cache dtype (8 for 32-bit, 16 for bf16/f16, 32 for fp8/int8). A TPU tiles the
  last two dims, so a ``[C, D]`` slice below the tile costs a whole tile anyway; padding makes the
  kernel's ``[page_size*C, D]`` page view a free bitcast. Combined heads ``2*Hkv .. C-1`` are
  padding: zero at allocation, never written, never read into the attention math.
* ``pallas_tpu`` for head_dim 64 (any cache width): *lane-packed*, ``[page_size, C, 128]``
  with row h = ``[K_h | V_h]`` and C = Hkv rounded up to 8 (``kv_cache_shape.lane_packed``;
  ``pack_kv_lanes`` / ``unpack_kv_lanes`` convert). Page movers, the host tier and P/D move its
  pages as bytes like any other; ``KVLayout`` tells the two layouts apart by C and D.

The model keeps all layers in one array, ``[num_layers, num_pages, page_size, C, D]``, so a
``lax.scan`` over layers can carry it. Page 0 is never handed to a sequence: padded page-table
entries point at it, so stray reads of padding are harmless.

Device layout: the compiled TPU kernel reads and writes the cache in place through a Pallas call,
which takes it row-major. Left to itself, XLA:TPU lays a head_dim-64 cache out with the page axis
minor-most (no lane padding), so every step copied the whole cache into row-major and back (on a
v5e an empty step took 30 ms with a 2 GiB cache against 7 ms with 128 MiB). So that cache is
allocated row-major (``kv_cache_format``), and every program that returns an updated cache pins
its output to the format its input had (``cache_out_format``). Row-major, a row of head_dim 64
takes a whole 128-lane tile row (``device_head_dim``; page sizing counts it).

A sequence's token at position ``p`` sits in page ``page_table[p // page_size]`` at row
``p % page_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from tpuserve.attention.kv_cache_shape import device_head_dim, kv_cache_shape, tpu_tiling

RESERVED_PAGE = 0


def stage_for(kv, host_array):
    """``host_array`` on ``kv``'s device, committed exactly when ``kv`` is.

    For the pages a program scatters into ``kv`` (host-tier loads, transferred prefills). A jitted
    program's output is committed when any input is, and the model step compiles once per
    committedness of its cache argument: a committed staging array would hand the step a committed
    cache after every load and recompile every (tokens, pages) shape it meets afterwards.
    """
    return jax.device_put(host_array, kv.sharding) if kv.committed else jax.device_put(host_array)


def tpu_row_major_format(dtype, sharding, ndim: int):
    """The ``jax.experimental.layout.Format`` of a row-major ``ndim``-d array of ``dtype`` in TPU
    memory, over ``sharding``."""
    from jax.experimental.layout import Format, Layout

    return Format(Layout(major_to_minor=tuple(range(ndim)), tiling=tpu_tiling(dtype)), sharding)


def kv_cache_format(impl: str, dtype, sharding, ndim: int = 5):
    """The ``jax.experimental.layout.Format`` a cache of ``impl`` must live in, or None where the
    compiler's own choice serves (every implementation but the compiled TPU kernel)."""
    if impl != "pallas_tpu":
        return None
    return tpu_row_major_format(dtype, sharding, ndim)


def gathered_table_format(impl: str, table):
    """The format an embedding table gathered by row every step is re-placed in, or None to leave
    it where it is. XLA:TPU lays a ``[V, H]`` table out V-minor when H is no multiple of 128 lanes
    and V is (less padding): gpt-oss's [201088, 2880] came so, and every step copied the whole
    table (1.08 GiB) row-major before its gather. Only where the cache is pinned too (``impl`` the
    compiled TPU kernel): a committed table makes the step's outputs committed, which an
    uncommitted cache must not become (``stage_for``)."""
    if impl != "pallas_tpu" or not isinstance(table, jax.Array):
        return None
    fmt = tpu_row_major_format(table.dtype, table.sharding, table.ndim)
    placed = getattr(table, "format", None)  # jax.Array.format (not in its type stubs)
    return None if placed is not None and placed.layout == fmt.layout else fmt


def cache_out_format(kv):
    """What a program that returns an updated ``kv`` pins its output to: ``kv``'s own format when
    the cache was placed explicitly (committed: an explicit layout, or a mesh), else None (the
    compiler's default, as the cache came). Without the pin, XLA may return the cache in another
    layout, and the next step would copy it back."""
    return kv.format if kv.committed else None


def warm_page_transfers(kv, gather, scatter, staged_shape, max_pages: int):
    """Compile a page mover's ``gather(kv, idx)`` and donating ``scatter(kv, staged, idx)`` for
    every power-of-two page count up to ``max_pages``; touches no page (gathers are discarded,
    scatter indices all out of range, so dropped). ``staged_shape(b)`` is the staging array's
    shape for b pages. Returns the cache (``kv`` is donated)."""
    import numpy as np

    b = 1
    while True:
        # Indices go up the way a transfer sends them (jnp.asarray of numpy), which jax compiles
        # a small program for per shape too.
        gather(kv, jnp.asarray(np.zeros(b, np.int32)))
        staged = stage_for(kv, np.zeros(staged_shape(b), kv.dtype))
        kv = scatter(kv, staged, jnp.asarray(np.full(b, kv.shape[1], np.int32)))
        if b >= max_pages:
            return kv
        b *= 2


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: jnp.dtype
    num_shards: int = 1  # devices the KV heads split over (tensor parallel); must divide them

    def __post_init__(self):
        if self.num_shards < 1 or self.num_kv_heads % self.num_shards:
            raise ValueError(
                f"{self.num_kv_heads} KV heads cannot split evenly over {self.num_shards} devices"
            )

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """The unpadded ``[L, P, page_size, 2*Hkv, D]``; ``shape_for(impl)`` is what gets allocated."""
        return (self.num_layers, self.num_pages, self.page_size, 2 * self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_page(self) -> int:
        """Bytes of K and V one page holds across all layers, *without* any head padding.

        This is the payload (what vLLM's own page accounting computes); the memory one page
        really takes depends on the attention impl: ``page_bytes(impl)``.
        """
        return (
            self.num_layers
            * self.page_size
            * 2
            * self.num_kv_heads
            * self.head_dim
            * jnp.dtype(self.dtype).itemsize
        )

    def shape_for(self, impl: str) -> tuple[int, int, int, int, int]:
        """The stacked cache shape attention impl ``impl`` (concrete, not 'auto') works on."""
        return kv_cache_shape(impl, self)

    def page_bytes(self, impl: str) -> int:
        """Bytes one page really takes across all layers in ``impl``'s layout (padding included)."""
        _, _, page_size, combined, head_dim = self.shape_for(impl)
        return (
            self.num_layers
            * page_size
            * combined
            * device_head_dim(impl, head_dim)
            * jnp.dtype(self.dtype).itemsize
        )

    def allocate(self, impl: str | None = None, sharding=None):
        """A zeroed cache in ``impl``'s shape and device layout (``kv_cache_format``), placed by
        ``sharding`` (None: the default device); ``impl=None`` keeps the unpadded ``shape``."""
        shape = self.shape if impl is None else self.shape_for(impl)
        fmt = (
            None
            if impl is None
            else kv_cache_format(
                impl, self.dtype, sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
            )
        )
        if fmt is None and sharding is None:
            return jnp.zeros(shape, self.dtype)
        return jax.jit(lambda: jnp.zeros(shape, self.dtype), out_shardings=fmt or sharding)()
