"""SGLang platform plugin: SGLang's scheduler and radix cache over our JAX runtime."""
