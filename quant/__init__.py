"""Quantized weight formats (FP8, MXFP4, NVFP4): records, exact dequant, quantize, matmuls.

Modules (import what you need; importing registers nothing with ``linear``):

* ``codecs``: e2m1 / e8m0 / e4m3 bit codecs, saturating fp8 cast, exact division.
* ``fp8``: ``Fp8Weight`` (per-tensor / per-channel / block scales), ``quantize_fp8``,
  ``dequantize_fp8``, ``fp8_from_checkpoint``, ``quantize_per_token``.
* ``fp4``: ``Mxfp4Weight``, ``Nvfp4Weight``, ``quantize_mxfp4`` / ``quantize_nvfp4``, their
  dequants, ``*_from_checkpoint`` (HF / compressed-tensors / ModelOpt / gpt-oss) and ``*_from_gguf``.
* ``linear_xla``: the CPU/GPU ``linear`` implementations.
* ``pallas_tpu_matmul``: Pallas TPU kernels ``fp8_matmul_tpu`` / ``fp4_matmul_tpu`` and their
  references ``fp8_matmul_ref`` / ``fp4_matmul_ref``.
* ``dispatch``: ``register_quant_linears(impl="auto")`` routes ``linear(x, record)``.
* ``search``: ``quantize_mxfp4_search`` / ``quantize_nvfp4_search``, the same formats with each
  block's scale searched for the least squared error (what online FP4 quantization uses).
* ``fuse``: concatenate / permute records along the output axis (q|k|v -> qkv, gate|up -> gate_up
  for pre-quantized checkpoints).
* ``params``: ``quantize_params(params, method)`` -> (tree of records, ``QuantReport``).

Where they are used: ``tpu_platform/worker.py`` (``Worker._quantize``: ``--quantization``, and
``register_quant_linears`` whenever the weights hold records) and ``tpu_platform/loader/quantized.py``
(pre-quantized HF fp8 / compressed-tensors / ModelOpt checkpoints).
"""
