"""Quantized formats (FP8, MXFP4, NVFP4): quantize, pack, load, matmul kernels (coming)."""
