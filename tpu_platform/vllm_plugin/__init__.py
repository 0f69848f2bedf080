"""vLLM platform plugin: vLLM's scheduler and KV manager over our JAX runtime."""
