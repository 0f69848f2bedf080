"""benchmarks/rpa_v3_peer.py: the adapter that runs tpu-inference's RPA v3 kernel beside ours on a TPU
(benchmarks/attention_tpu.py). What a CPU can check:

* the cache layout conversion: our interleaved ``[pages, page_size, C, D]`` cache into v3's
  ``[pages, page_size, 2*Hkv/packing, packing, align(D, 128)]`` and back, padding included, and
  that it packs exactly as v3's own ``merge_kv`` / ``get_kv_cache_shape`` do;
* the step reordering (decodes first, ``distribution``) and its inverse;
* the whole adapter through v3's own jnp reference (its semantics, in its layout and order) against
  jax's ``ref_ragged_paged_attention`` on our inputs: outputs and the written cache;
* that the v3 call lowers for a TPU (Mosaic) at a decode and a mixed shape;
* the same for v3's head_dim-64 variant (``kernel_hd64``, what tpu-inference runs for head_dim-64
  models): its dense layout, its own jnp reference through the adapter, its lowering.

v3's kernel itself does not run in Pallas's interpret modes on jax 0.10.2, so its compiled output
is checked on the chip only (attention_tpu.py's ``rpa`` checks).

The wheel (tpu-inference, no dependencies) is downloaded once into ~/.cache/tpuserve/; tests that
need it skip, saying why, only when it can be neither found nor downloaded.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu import ragged_paged_attention as jax_rpa

from tpuserve.attention.reference import write_kv_ref

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load_adapter():
    # benchmarks/ is not a package: load the module by path, as the benchmark imports it.
    spec = importlib.util.spec_from_file_location(
        "rpa_v3_peer", os.path.join(REPO, "benchmarks", "rpa_v3_peer.py")
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


peer = _load_adapter()


@pytest.fixture(scope="module")
def kernel():
    """v3's kernel module; skips only when the wheel is neither here nor downloadable."""
    try:
        peer.find_package()
    except peer.PeerUnavailable:
        try:
            peer.download_wheel()
        except peer.PeerUnavailable as e:
            pytest.skip(f"tpu-inference {peer.VERSION} wheel unavailable: {e}")
    return peer.load()  # the wheel is here: a failure to import it must fail, not skip


def _random(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape), dtype)


@pytest.mark.parametrize(
    "hkv, d, c, dtype",
    [
        (2, 64, 16, jnp.bfloat16),  # our padded TPU cache (C=16), v3 pads D to 128
        (3, 128, 6, jnp.bfloat16),  # odd KV heads: 6 combined heads, 3 words of 2
        (1, 64, 8, jnp.float32),  # packing 1, our C padded to 8
        (2, 128, 4, jnp.float32),  # no padding anywhere: a reshape
    ],
)
def test_cache_layout_round_trip(hkv, d, c, dtype):
    rng = np.random.default_rng(0)
    pages, ps = 5, 4
    cache = np.zeros((pages, ps, c, d), np.float32)
    cache[:, :, : 2 * hkv] = rng.standard_normal((pages, ps, 2 * hkv, d))
    cache = jnp.asarray(cache, dtype)
    p = 4 // jnp.dtype(dtype).itemsize
    got = peer.to_peer_cache(cache, hkv)
    assert got.shape == peer.peer_cache_shape(pages, ps, hkv, d, dtype)
    assert got.shape[-2] == p and got.shape[-1] == max(d, 128)
    flat = got.reshape(pages, ps, -1, got.shape[-1])
    for h in range(hkv):  # combined head 2h is K of KV head h, 2h+1 its V, on both sides
        np.testing.assert_array_equal(flat[:, :, 2 * h, :d], cache[:, :, 2 * h])
        np.testing.assert_array_equal(flat[:, :, 2 * h + 1, :d], cache[:, :, 2 * h + 1])
    assert not np.asarray(flat[:, :, :, d:], np.float32).any()  # lane padding is zero
    assert not np.asarray(flat[:, :, 2 * hkv :], np.float32).any()  # head padding is zero
    back = peer.from_peer_cache(got, hkv, d, c)
    assert back.shape == cache.shape and back.dtype == cache.dtype
    np.testing.assert_array_equal(np.asarray(back, np.float32), np.asarray(cache, np.float32))
    # a stacked (layers) cache converts the same way, layer by layer
    stacked = peer.to_peer_cache(jnp.stack([cache, cache[::-1]]), hkv)
    np.testing.assert_array_equal(
        np.asarray(stacked[1], np.float32), np.asarray(peer.to_peer_cache(cache[::-1], hkv), np.float32)
    )


@pytest.mark.parametrize(
    "hkv, d, dtype", [(2, 64, jnp.bfloat16), (3, 128, jnp.bfloat16), (1, 64, jnp.float32)]
)
def test_layout_is_v3s(kernel, hkv, d, dtype):
    """Our conversion packs a step's new K/V exactly as v3's own merge_kv does, into its shape."""
    rng = np.random.default_rng(1)
    t = 7
    new_kv = _random(rng, (t, 2 * hkv, d), dtype)
    keys, values = peer.split_new_kv(new_kv)
    assert keys.shape == values.shape == (t, hkv, d)
    theirs = kernel.merge_kv(keys, values)
    ours = peer.to_peer_cache(new_kv[None], hkv)[0]  # the step's tokens as one page of t slots
    np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(theirs, np.float32))
    assert tuple(kernel.get_kv_cache_shape(9, 16, hkv, d, dtype)) == peer.peer_cache_shape(
        9, 16, hkv, d, dtype
    )


SEQS = [(5, 21), (1, 9), (7, 7), (1, 33), (1, 1), (16, 40)]  # (q_len, kv_len): decodes interleaved


def _step(seqs, ps, rng, extra_tokens=3, extra_slots=1):
    slots = len(seqs) + extra_slots
    pps = max(-(-kv // ps) for _, kv in seqs)
    pages = np.zeros((slots, pps), np.int32)
    pages[: len(seqs)] = rng.permutation(np.arange(1, 1 + len(seqs) * pps)).reshape(len(seqs), pps)
    q_lens = [q for q, _ in seqs]
    cu = np.full(slots + 1, sum(q_lens), np.int32)
    cu[0], cu[1 : len(seqs) + 1] = 0, np.cumsum(q_lens)
    kv_lens = np.zeros(slots, np.int32)
    kv_lens[: len(seqs)] = [kv for _, kv in seqs]
    ns = np.asarray([len(seqs)], np.int32)
    return (kv_lens, pages, cu, ns), 1 + len(seqs) * pps, int(cu[-1]) + extra_tokens


def test_step_layout_orders_decodes_first():
    rng = np.random.default_rng(2)
    md, _, t = _step(SEQS, 16, rng)
    kv_lens, pages, cu, ns = md
    lay = peer.StepLayout(*md, t)
    assert lay.reordered
    order = [1, 3, 4, 0, 2, 5]  # the decodes, then the rest, each in their order
    np.testing.assert_array_equal(lay.distribution, [3, 3, 6])
    np.testing.assert_array_equal(lay.kv_lens[:6], kv_lens[order])
    assert lay.kv_lens[6] == 0
    np.testing.assert_array_equal(lay.page_indices.reshape(pages.shape)[:6], pages[order])
    q_lens = np.diff(cu[:7])
    np.testing.assert_array_equal(np.diff(lay.cu_q_lens[:7]), q_lens[order])
    assert lay.cu_q_lens[-1] == lay.cu_q_lens[6] == cu[6]
    tokens = np.arange(t)
    moved = lay.permute_tokens(tokens)
    for new, old in enumerate(order):  # each sequence's tokens follow it, in order
        np.testing.assert_array_equal(
            moved[lay.cu_q_lens[new] : lay.cu_q_lens[new + 1]], tokens[cu[old] : cu[old + 1]]
        )
    np.testing.assert_array_equal(moved[cu[6] :], tokens[cu[6] :])  # padding tokens stay last
    np.testing.assert_array_equal(lay.restore_tokens(moved), tokens)
    np.testing.assert_array_equal(lay.restore_tokens(moved[: cu[6]]), tokens[: cu[6]])
    # already in order (decode-only, prefill-only): nothing moves
    md2, _, t2 = _step([(1, 5), (1, 9)], 16, rng)
    lay2 = peer.StepLayout(*md2, t2)
    assert not lay2.reordered and list(lay2.distribution) == [2, 2, 2]
    md3, _, t3 = _step([(4, 5), (3, 9)], 16, rng)
    assert list(peer.StepLayout(*md3, t3).distribution) == [0, 0, 2]


def _reference_step(rng, hkv, hq, d, ps, c, dtype, options):
    """Our step over SEQS with a random padded cache (C = c) and what jax's reference says of it:
    (metadata, tokens, q, new_kv, cache, kwargs, written cache f32, output f32, real tokens)."""
    md, num_pages, t = _step(SEQS, ps, rng)
    q = _random(rng, (t, hq, d), dtype)
    new_kv = _random(rng, (t, 2 * hkv, d), dtype)
    cache = np.zeros((num_pages, ps, c, d), np.float32)
    cache[:, :, : 2 * hkv] = rng.standard_normal((num_pages, ps, 2 * hkv, d))
    cache = jnp.asarray(cache, dtype)
    mdj = tuple(map(jnp.asarray, md))
    kw = dict(sm_scale=d**-0.5, **options)
    f32 = jnp.float32
    want_kv = write_kv_ref(cache[:, :, : 2 * hkv].astype(f32), new_kv.astype(f32), *mdj)
    want = jax_rpa.ref_ragged_paged_attention(q.astype(f32), want_kv, *mdj, **kw)
    return md, t, q, new_kv, cache, kw, want_kv, want, int(md[2][len(SEQS)])


@pytest.mark.parametrize("hkv, hq, d, dtype", [(2, 4, 128, jnp.float32), (2, 6, 64, jnp.bfloat16)])
@pytest.mark.parametrize("options", [dict(), dict(sliding_window=8, soft_cap=20.0)])
def test_adapter_through_v3_reference(kernel, hkv, hq, d, dtype, options):
    """Our step, converted by the adapter and fed to v3's own jnp reference (its layout, order and
    distribution), gives jax's reference output on our step and the cache write_kv_ref writes."""
    rng = np.random.default_rng(3)
    c = 16 if dtype == jnp.bfloat16 else 2 * hkv  # our padded TPU cache for bf16
    f32 = jnp.float32
    md, t, q, new_kv, cache, kw, want_kv, want, real = _reference_step(rng, hkv, hq, d, 8, c, dtype, options)
    lay = peer.StepLayout(*md, t)
    keys, values = peer.split_new_kv(lay.permute_tokens(new_kv))
    got, got_cache = kernel.ref_ragged_paged_attention(
        lay.permute_tokens(q),
        keys,
        values,
        peer.to_peer_cache(cache, hkv),
        *map(jnp.asarray, lay.metadata()),
        out_dtype=f32,
        **kw,
    )
    got = lay.restore_tokens(got)
    assert got.shape[0] == real
    tol = 1e-5 if dtype == jnp.float32 else 5e-2
    np.testing.assert_allclose(np.asarray(got, f32), np.asarray(want[:real]), atol=tol, rtol=0)
    back = peer.from_peer_cache(got_cache, hkv, d, c)
    np.testing.assert_array_equal(
        np.asarray(back[:, :, : 2 * hkv], f32), np.asarray(want_kv.astype(dtype), f32)
    )
    assert not np.asarray(back[:, :, 2 * hkv :], f32).any()


def _lowered_peer_call(kernel, cache_shape, tokens, hq, hkv, d, slots, pps):
    """(abstract inputs, Mosaic text) of the adapter's bf16 call of ``kernel`` lowered for a v5e from
    CPU, cache donated as the benchmark does."""
    bf = jnp.bfloat16
    shapes = [
        jax.ShapeDtypeStruct(cache_shape, bf),
        jax.ShapeDtypeStruct((tokens, hq, d), bf),
        jax.ShapeDtypeStruct((tokens, hkv, d), bf),
        jax.ShapeDtypeStruct((tokens, hkv, d), bf),
        jax.ShapeDtypeStruct((slots,), jnp.int32),
        jax.ShapeDtypeStruct((slots * pps,), jnp.int32),
        jax.ShapeDtypeStruct((slots + 1,), jnp.int32),
        jax.ShapeDtypeStruct((3,), jnp.int32),
    ]
    fn = jax.jit(
        lambda cache, q, k, v, *md: peer.attention(kernel, q, k, v, cache, *md, sm_scale=d**-0.5),
        donate_argnums=(0,),
    )
    with peer.v5e_lowering():
        return shapes, jax.export.export(fn, platforms=["tpu"])(*shapes).mlir_module()


@pytest.mark.parametrize(
    "name, tokens, slots",
    [("decode b64", 64, 64), ("mixed 4x128 + 60 decodes", 4 * 128 + 60, 64)],
)
def test_lowers_for_tpu(kernel, name, tokens, slots):
    """The adapter's v3 call (its default blocks, cache donated as the benchmark does) lowers to
    Mosaic for a v5e from CPU: its decode and mixed kernels, one tpu_custom_call each."""
    hq, hkv, d, ps, pps, pages = 32, 8, 128, 16, 128, 4097
    bf = jnp.bfloat16
    cache = peer.peer_cache_shape(pages, ps, hkv, d, bf)
    shapes, text = _lowered_peer_call(kernel, cache, tokens, hq, hkv, d, slots, pps)
    assert text.count("tpu_custom_call") == 2
    blocks = peer.default_block_sizes(kernel, bf, bf, hq, hkv, d, ps, tokens, slots, pps)
    assert blocks["decode"] == (1, 2048, 1, 2048)  # v3's v5e decode formula: all of a 2k context
    for case, sym in (("decode", "d"), ("mixed", "m")):  # the kernels ran with the reported blocks
        bq, bkv, bqc, bkvc = blocks[case]
        assert f"RPA{sym}-p_{ps}-bq_{bq}_{bqc}-bkv_{bkv}_{bkvc}" in text


# ---- the head_dim-64 variant (kernel_hd64): what tpu-inference runs for head_dim-64 models ----


@pytest.fixture(scope="module")
def hd64(kernel):
    return peer.for_head_dim(kernel, 64)


def test_head_dim_picks_the_variant(kernel, hd64):
    """At head_dim 64 the peer is the variant, loaded without vllm or torch; elsewhere the kernel."""
    assert peer.is_hd64(hd64) and not peer.is_hd64(kernel)
    assert peer.for_head_dim(kernel, 128) is kernel and peer.for_head_dim(hd64, 64) is hd64
    # its block-size table's helpers are the stand-ins (the real ones import vllm and torch)
    assert sys.modules["tpu_inference.logger"].init_logger is peer._OnceLogger
    assert sys.modules["tpu_inference.utils"].get_device_name() == "TPU v5e"  # off a TPU: a v5e's


@pytest.mark.parametrize("hkv, c, dtype", [(2, 16, jnp.bfloat16), (3, 8, jnp.float32), (1, 16, jnp.bfloat16)])
def test_hd64_layout_round_trip_and_is_the_variants(hd64, hkv, c, dtype):
    """Our padded cache into the variant's dense layout and back (real heads exact, padding heads
    zero), packed as the variant's own merge_kv packs a step's K/V, in its cache shape."""
    rng = np.random.default_rng(5)
    cache = np.zeros((5, 4, c, 64), np.float32)
    cache[:, :, : 2 * hkv] = rng.standard_normal((5, 4, 2 * hkv, 64))
    cache = jnp.asarray(cache, dtype)
    there = peer.to_peer_cache(cache, hkv, hd64=True)
    assert there.shape == peer.peer_cache_shape_hd64(5, 4, hkv, dtype)
    assert tuple(hd64.get_kv_cache_shape(5, 4, hkv, 64, dtype)) == there.shape
    back = peer.from_peer_cache(there, hkv, 64, c, hd64=True)
    np.testing.assert_array_equal(np.asarray(back, np.float32), np.asarray(cache, np.float32))
    new_kv = _random(rng, (7, 2 * hkv, 64), dtype)
    theirs = hd64.merge_kv(*peer.split_new_kv(new_kv))
    ours = peer.to_peer_cache(new_kv[None], hkv, hd64=True)[0]
    np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(theirs, np.float32))


@pytest.mark.parametrize("options", [dict(), dict(sliding_window=8, soft_cap=20.0)])
def test_adapter_through_the_hd64_reference(hd64, options):
    """Our step through the adapter into the variant's own jnp reference gives jax's reference
    output on our step, and the cache write_kv_ref writes (back in our layout)."""
    rng = np.random.default_rng(4)
    hkv, hq, d, ps, c, dtype, f32 = 2, 6, 64, 8, 16, jnp.bfloat16, jnp.float32
    md, t, q, new_kv, cache, kw, want_kv, want, real = _reference_step(rng, hkv, hq, d, ps, c, dtype, options)
    lay = peer.StepLayout(*md, t)
    keys, values = peer.split_new_kv(lay.permute_tokens(new_kv))
    got, got_cache = hd64.ref_ragged_paged_attention_hd64(
        lay.permute_tokens(q),
        keys,
        values,
        peer.to_peer_cache(cache, hkv, hd64=True),
        *map(jnp.asarray, lay.metadata()),
        **kw,
    )
    got = lay.restore_tokens(got[:real])
    np.testing.assert_allclose(np.asarray(got, f32), np.asarray(want[:real]), atol=5e-2, rtol=0)
    back = peer.from_peer_cache(got_cache, hkv, d, c, hd64=True)
    np.testing.assert_array_equal(
        np.asarray(back[:, :, : 2 * hkv], f32), np.asarray(want_kv.astype(dtype), f32)
    )
    assert not np.asarray(back[:, :, 2 * hkv :], f32).any()


def test_hd64_lowers_for_tpu(hd64):
    """The adapter's call of the variant (its tuned v5e blocks, cache donated) lowers to Mosaic for a
    v5e from CPU at the 1B shape's heads, and it refuses an attend-only call it has no mode for."""
    hq, hkv, d, ps, pps, pages, tokens, slots = 32, 8, 64, 16, 128, 4097, 4 * 128 + 60, 64
    bf = jnp.bfloat16
    shapes, text = _lowered_peer_call(
        hd64, peer.peer_cache_shape_hd64(pages, ps, hkv, bf), tokens, hq, hkv, d, slots, pps
    )
    assert "tpu_custom_call" in text
    bq, bkv = peer.default_block_sizes(hd64, bf, bf, hq, hkv, d, ps, tokens, slots, pps)["decode"]
    assert bq >= 1 and bkv % ps == 0
    with pytest.raises(ValueError, match="always writes"):
        peer.attention(
            hd64,
            *[jnp.zeros(s.shape, s.dtype) for s in shapes[1:4]],
            shapes[0],
            *shapes[4:],
            sm_scale=0.1,
            update_kv_cache=False,
        )
