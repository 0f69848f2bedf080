"""A ModelRunner over a loaded checkpoint, as the model tests build one (f32, asked to scan)."""

from __future__ import annotations


def scan_runner(path: str, loaded):
    """The runner for ``loaded`` (``load_model(path, jnp.float32)``) with layer_loop "scan": models
    whose layers differ in structure run unrolled instead, which the tests check."""
    import jax.numpy as jnp

    from tpuserve.tpu_platform.config import EngineConfig
    from tpuserve.tpu_platform.device import discover
    from tpuserve.tpu_platform.model_runner import ModelRunner

    return ModelRunner(
        EngineConfig.from_kwargs(model=path, max_num_batched_tokens=64, layer_loop="scan"),
        loaded.arch,
        loaded.params,
        discover(),
        jnp.float32,
        num_pages=32,
        max_model_len=256,
    )


def _scan_eqns(jaxpr):
    """Every scan equation in a (closed) jaxpr, nested ones included."""
    import jax

    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            yield eqn
        for sub in jax.core.jaxprs_in_params(eqn.params):
            yield from _scan_eqns(sub)


def assert_layer_scan_takes_whole(runner, stacks: set, what: str) -> None:
    """The runner's step hands arrays of shapes ``stacks`` ([L, ...]) to its layer scan as
    constants, never as per-layer slices (on a TPU a slice feeding a Pallas kernel is
    materialized: a copy of the layer's weights every step)."""
    num_layers = runner.arch.num_layers
    slices = {s[1:] for s in stacks}
    traced = runner._step.trace(*runner.step_args(runner._empty_batch(1, runner.page_buckets[0])))
    scans = [e for e in _scan_eqns(traced.jaxpr.jaxpr) if e.params["length"] == num_layers]
    assert scans, "the step has no layer scan"
    for eqn in scans:
        n_consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
        consts = {tuple(v.aval.shape) for v in eqn.invars[:n_consts]}
        xs_body = eqn.params["jaxpr"].jaxpr.invars[n_consts + n_carry :]
        assert stacks <= consts, f"{what} {stacks} are not scan constants ({consts})"
        assert not slices & {tuple(v.aval.shape) for v in xs_body}, f"the scan slices the {what}"
