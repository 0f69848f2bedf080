"""KV transfer between engines (disaggregated prefill/decode).

Pages are the unit: a request's pages travel as one array ``[L, n, page_size, C, D]`` (the device
cache's ``[L, P, page_size, C, D]`` indexed at the request's page ids). Modules:

* ``layout``: ``KVLayout``, what both ends must agree on, and its digest (checked at handshake).
* ``auth``: the shared secret (``TPUSERVE_KV_SECRET`` or a file) and HMAC-SHA256 challenges.
* ``framing``: length-prefixed frames (JSON header + raw bytes) over a socket, with deadlines.
* ``transport``: the interface (``KVSender`` on the producer, ``KVReceiver`` on the consumer),
  ``TransferHandle`` (what a producer hands out, as vLLM-style ``kv_transfer_params``), errors.
* ``lease``: pages held by the producer until pulled or until their lease expires.
* ``tcp``: the framed-TCP implementation (and the authenticated control channel).
* ``jax_transfer``: pages over ``jax.experimental.transfer``, gated by that control channel.
* ``errors``: ``KVTransferError`` and its kinds (auth, layout, not found, timeout, peer closed).
* ``device_pages``: device cache <-> host page arrays (jitted gather, donated scatter).

Nothing here runs at import time; jax is imported only by ``device_pages``.
"""
