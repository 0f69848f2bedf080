"""tpu_platform/models."""
