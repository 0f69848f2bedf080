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
