"""tpu_platform."""
