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
* ``dispatch``: ``quant_linear(x, record, impl="auto")``, the Pallas kernel on a TPU, XLA elsewhere.
* ``search``: ``quantize_mxfp4_search`` / ``quantize_nvfp4_search``, the same formats with each
  block's scale searched for the least squared error (what online FP4 quantization uses).
* ``gptq``: ``gptq_fp4``, GPTQ rounding of one weight to FP4 codes given its input statistics.
* ``fuse``: concatenate / permute records along the output axis (q|k|v -> qkv, gate|up -> gate_up
  for pre-quantized checkpoints).

Nothing here knows the model. Built on these, a layer up: ``tpu_platform/linear.py``
(``quant_linear_impls()``: a runner's table routing ``linear(x, record)`` to ``quant_linear``),
``tpu_platform/models/quantize.py`` (``quantize_params(params, method)`` -> (tree of records,
``QuantReport``), with GPTQ over the decoder's layers in ``tpu_platform/models/calibrate.py``),
``tpu_platform/worker.py`` (``Worker._quantize``: ``--quantization``) and
``tpu_platform/loader/quantized.py`` (pre-quantized HF fp8 / compressed-tensors / ModelOpt checkpoints).
"""
