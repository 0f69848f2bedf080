"""Names of the attention implementations (no jax import: the engine config validates against them)."""

ATTENTION_IMPLS = ("auto", "reference", "blocked", "pallas_tpu", "pallas_tpu_interpret", "pallas_gpu")
