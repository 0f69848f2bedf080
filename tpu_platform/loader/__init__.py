"""tpu_platform/loader."""
