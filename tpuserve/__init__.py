"""tpuserve."""
