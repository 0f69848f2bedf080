"""benchmarks/hlo_param_copies.py on an entry computation written like XLA:TPU's optimized dumps:
the per-step weight copies found on a v5e (a relayout copy of the embedding, a bitcast-convert of
MXFP4 expert bytes) are named, largest first; views, an in-place kernel update of the cache, small
reads of a weight and small parameters are not."""

from __future__ import annotations

import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")

HLO = """HloModule jit__traced_step

%fused_computation.1 (param_0: bf16[64]) -> bf16[64] {
  %param_0 = bf16[64]{0} parameter(0)
  ROOT %copy.1 = bf16[64]{0} copy(%param_0)
}

ENTRY %main.189 (params__embed__.1: bf16[201088,2880], packed.1: u8[32,1440,5760], kv_cache.1: bf16[24,16,256,16,64]) -> bf16[24,16,256,16,64] {
  %params__embed__.1 = bf16[201088,2880]{0,1:T(8,128)(2,1)} parameter(0), metadata={op_name="params['embed']"}
  %packed.1 = u8[32,1440,5760]{2,1,0:T(32,128)(4,1)} parameter(1)
  %kv_cache.1 = bf16[24,16,256,16,64]{4,3,2,1,0:T(8,128)(2,1)} parameter(2)
  %small.1 = f32[8]{0} parameter(3)
  %copy.778 = bf16[201088,2880]{1,0:T(8,128)(2,1)} copy(%params__embed__.1), metadata={op_name="params['embed']"}
  %bitcast_convert_type.96 = s8[32,1440,5760]{2,1,0:T(32,128)(4,1)} bitcast-convert(%packed.1), metadata={op_name="x"}
  %bitcast.7 = bf16[24,16,4096,64]{3,2,1,0:T(8,128)(2,1)} bitcast(%kv_cache.1)
  %gather.1 = bf16[8,2880]{1,0:T(8,128)(2,1)} gather(%copy.778, %small.1), offset_dims={1}
  %slice.1 = u8[1,1440,5760]{2,1,0:T(32,128)(4,1)} slice(%packed.1), slice={[0:1], [0:1440], [0:5760]}
  %neg.1 = f32[8]{0} negate(%small.1)
  ROOT %custom-call.1 = bf16[24,16,256,16,64]{4,3,2,1,0:T(8,128)(2,1)} custom-call(%bitcast.7, %kv_cache.1), custom_call_target="tpu_custom_call", output_to_operand_aliasing={{}: (1, {})}
}
"""


def test_names_the_weight_copies_of_a_step_largest_first(monkeypatch):
    monkeypatch.syspath_prepend(os.path.abspath(BENCHMARKS))
    import hlo_param_copies as h

    try:
        hits = h.param_copies(HLO)
    finally:
        sys.modules.pop("hlo_param_copies", None)
    assert [(x["op"], x["name"], x["param"]) for x in hits] == [
        ("copy", "copy.778", "params__embed__.1"),
        ("bitcast-convert", "bitcast_convert_type.96", "packed.1"),
    ]
    assert hits[0]["bytes"] == 201088 * 2880 * 2 and hits[1]["bytes"] == 32 * 1440 * 5760


# A layer loop as XLA:TPU writes it: the body slices a stacked weight for a dot. Fused into the dot's
# fusion (kind=kOutput) it writes nothing of its own; as a loop fusion of slice + bitcast alone it
# writes the layer's whole slice every iteration.
LOOP = """HloModule jit__traced_step

%slice_only (p0: bf16[16,2,2048,8192], p1: s32[]) -> bf16[2,2048,8192] {
  %p0 = bf16[16,2,2048,8192]{3,2,1,0} parameter(0)
  %p1 = s32[]{:T(128)} parameter(1)
  %c = s32[]{:T(128)} constant(0)
  %ds = bf16[1,2,2048,8192]{3,2,1,0} dynamic-slice(%p0, %p1, %c, %c, %c), dynamic_slice_sizes={1,2,2048,8192}
  ROOT %b = bf16[2,2048,8192]{2,1,0:S(1)} bitcast(%ds)
}

%slice_dot (p0: bf16[16,8192,2048], p1: s32[], x: bf16[8,8192]) -> bf16[8,2048] {
  %p0 = bf16[16,8192,2048]{2,1,0} parameter(0)
  %p1 = s32[]{:T(128)} parameter(1)
  %x = bf16[8,8192]{1,0} parameter(2)
  %c = s32[]{:T(128)} constant(0)
  %ds = bf16[1,8192,2048]{2,1,0} dynamic-slice(%p0, %p1, %c, %c), dynamic_slice_sizes={1,8192,2048}
  %b = bf16[8192,2048]{1,0} bitcast(%ds)
  ROOT %d = bf16[8,2048]{1,0} dot(%x, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (t: (s32[], bf16[16,2,2048,8192], bf16[16,8192,2048], bf16[8,8192])) -> (s32[], bf16[16,2,2048,8192], bf16[16,8192,2048], bf16[8,8192]) {
  %t = (s32[], bf16[16,2,2048,8192], bf16[16,8192,2048], bf16[8,8192]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %gu = bf16[16,2,2048,8192]{3,2,1,0} get-tuple-element(%t), index=1
  %dn = bf16[16,8192,2048]{2,1,0} get-tuple-element(%t), index=2
  %x = bf16[8,8192]{1,0} get-tuple-element(%t), index=3
  %dynamic-slice_bitcast_fusion.8 = bf16[2,2048,8192]{2,1,0:S(1)} fusion(%gu, %i), kind=kLoop, calls=%slice_only
  %down_dot = bf16[8,2048]{1,0} fusion(%dn, %i, %x), kind=kOutput, calls=%slice_dot
  ROOT %r = (s32[], bf16[16,2,2048,8192], bf16[16,8192,2048], bf16[8,8192]) tuple(%i, %gu, %dn, %x)
}

%cond (t: (s32[], bf16[16,2,2048,8192], bf16[16,8192,2048], bf16[8,8192])) -> pred[] {
  %t = (s32[], bf16[16,2,2048,8192], bf16[16,8192,2048], bf16[8,8192]) parameter(0)
  ROOT %p = pred[] constant(false)
}

ENTRY %main (gu: bf16[16,2,2048,8192], dn: bf16[16,8192,2048], x: bf16[8,8192]) -> bf16[8,8192] {
  %gu = bf16[16,2,2048,8192]{3,2,1,0} parameter(0)
  %dn = bf16[16,8192,2048]{2,1,0} parameter(1)
  %x = bf16[8,8192]{1,0} parameter(2)
  %z = s32[] constant(0)
  %tup = (s32[], bf16[16,2,2048,8192], bf16[16,8192,2048], bf16[8,8192]) tuple(%z, %gu, %dn, %x)
  %while.52 = (s32[], bf16[16,2,2048,8192], bf16[16,8192,2048], bf16[8,8192]) while(%tup), condition=%cond, body=%body
  ROOT %out = bf16[8,8192]{1,0} get-tuple-element(%while.52), index=3
}
"""


def test_names_the_slice_a_layer_loop_writes_every_iteration(monkeypatch):
    """The gate_up copy of 2026-12-06, in XLA's own dump of the 1B shape's 128-token step before
    f5a2971 (benchmarks/results/tpu-v5e-2026-12-06c/call1_parts): the only data-movement write in
    its layer loop, the layer's bf16[2, 2048, 8192] slice (64 MiB). A slice fused into its dot is
    not one; nor is anything in the entry computation's weight-copy list."""
    monkeypatch.syspath_prepend(os.path.abspath(BENCHMARKS))
    import hlo_param_copies as h

    try:
        hits = h.loop_moves(LOOP)
        dump = os.path.join(BENCHMARKS, "results", "tpu-v5e-2026-12-06c", "call1_parts")
        real = h.loop_moves(h.read_text(os.path.join(dump, "llama-1b_pallas_tpu_t128.hlo.gz")))
        assert h.param_copies(LOOP) == []
    finally:
        sys.modules.pop("hlo_param_copies", None)
    assert [(x["op"], x["name"], x["body"], x["bytes"]) for x in hits] == [
        ("fusion", "dynamic-slice_bitcast_fusion.8", "body", 2 * 2048 * 8192 * 2)
    ]
    assert [(x["name"], x["bytes"]) for x in real] == [
        ("dynamic-slice_bitcast_fusion.8", 2 * 2048 * 8192 * 2)
    ]
