"""Two engines in one process share no state: each runner counts its own compiles, keeps its own
sampler programs and neutral arrays on its own device, and routes ``linear`` through its own table.

Runs itself as a child with two fake CPU devices (the device count is fixed when JAX starts), one
runner on each, as two data-parallel replicas are placed (``mesh.replica_mesh``).
"""

from __future__ import annotations

import pytest
from fake_devices import run_with_devices  # tests/tpu_platform/fake_devices.py


def _two_runners() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tiny_models import tiny_model

    from tpuserve.tpu_platform.config import EngineConfig
    from tpuserve.tpu_platform.device import discover
    from tpuserve.tpu_platform.mesh import plan_devices, replica_mesh
    from tpuserve.tpu_platform.model_runner import ModelRunner
    from tpuserve.tpu_platform.step_batch import SamplingRow, ScheduledSeq

    assert jax.device_count() == 2, jax.devices()
    arch, _, params = tiny_model("llama", layers=2, heads=4, kv_heads=2, ffn=64, vocab=96)
    cfg = EngineConfig.from_kwargs(
        model="tiny",
        max_num_batched_tokens=4,
        max_num_seqs=2,
        block_size=16,
        data_parallel_size=2,
        speculative_config={"method": "ngram", "num_speculative_tokens": 1},
    )
    plan = plan_devices(1, 2)

    def runner(replica: int) -> ModelRunner:
        mesh = replica_mesh(plan, replica)
        return ModelRunner(
            cfg, arch, params, discover(), jnp.float32, num_pages=8, max_model_len=32, mesh=mesh
        )

    r0, r1 = runner(0), runner(1)
    assert r0.linears is not r1.linears and r0.sampler is not r1.sampler
    start1 = r1.compile_count
    warm0 = r0.warmup()
    assert warm0 > 0
    assert r1.compile_count == start1, "replica 0's warm-up was counted by replica 1"
    warm1 = r1.warmup()
    # Replica 1 compiles its own full set: nothing of replica 0's programs is reused or counted.
    assert warm1 == warm0, (warm0, warm1)
    print(f"OK each runner counts its own warm-up ({warm0} programs each)", flush=True)

    for i, r in enumerate((r0, r1)):
        devices = {d for a in r.sampler._neutral_arrays.values() for d in a.devices()}
        assert r.sampler._neutral_arrays and devices == {plan.rows[i][0]}, (i, devices)
    print("OK neutral sampler arrays sit on their own runner's device", flush=True)

    # A step with penalties (the extras stage, neutral arrays for what it lacks) on each runner:
    # same weights, same tokens, and no compile on either after warm-up.
    counts = (r0.compile_count, r1.compile_count)
    prompt = [int(t) for t in np.random.RandomState(0).randint(0, arch.vocab_size, 3)]
    row = SamplingRow(temperature=0.0, repetition_penalty=1.2, prompt_token_ids=prompt)
    outs = []
    for r in (r0, r1):
        batch = r.build_batch([ScheduledSeq(prompt, 0, [1], row)])
        out = r.execute(batch)
        assert set(r.kv_cache.devices()) == set(r.mesh.devices.flat)
        outs.append(out.token_ids[:1].tolist())
    assert outs[0] == outs[1], outs
    assert (r0.compile_count, r1.compile_count) == counts, (counts, r0.compile_count, r1.compile_count)
    print("OK both runners sample alike and compile nothing after warm-up", flush=True)


@pytest.mark.timeout(600)
def test_two_runners_in_one_process_share_no_state():
    out = run_with_devices(__file__, devices=2, timeout=580)
    for line in ("OK each runner counts", "OK neutral sampler arrays", "OK both runners sample alike"):
        assert line in out, out


if __name__ == "__main__":
    _two_runners()
