"""Mixture-of-experts kernels: the grouped matmul that runs every expert on its tokens.

Modules:

* ``grouped_matmul``: ``grouped_matmul_reference`` (pure jnp) and ``grouped_matmul(...,
  impl=...)``, the one entry point that picks the implementation.
* ``pallas_tpu_gmm``: the Pallas TPU kernel ``grouped_matmul_tpu`` and its visit schedule.

Nothing here knows the model, the cache or the engine (a kernel package, pyproject.toml).
"""
