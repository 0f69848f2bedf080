"""KV pages over jax.experimental.transfer, gated by the authenticated control channel (in process:
two transfer servers on loopback)."""

from __future__ import annotations

import pytest
from kv_producer_child import random_pages  # tests/kv_cache/transfer/kv_producer_child.py

from tpuserve.kv_cache.transfer.errors import AuthError, LayoutMismatchError, TransferNotFoundError
from tpuserve.kv_cache.transfer.jax_transfer import JaxKVReceiver, JaxKVSender
from tpuserve.kv_cache.transfer.layout import KVLayout

pytestmark = pytest.mark.timeout(120)

SECRET = "jax-transfer-test-secret"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pull_through_jax_transfer_is_bitwise_and_authenticated(dtype):
    layout = KVLayout("tiny", 2, 4, 4, 8, dtype)
    pages = random_pages(layout, 3, 5)
    with JaxKVSender(layout, secret=SECRET) as s:
        assert s._jax_server.address().startswith("127.0.0.1:")
        h = s.offer("r", pages, num_tokens=12)
        assert h.transport == "jax"
        with pytest.raises(AuthError):
            JaxKVReceiver(layout, secret="some-other-secret-xx").pull(h, timeout_s=20)
        with pytest.raises(LayoutMismatchError, match="page_size"):
            JaxKVReceiver(KVLayout("tiny", 2, 8, 4, 8, dtype), secret=SECRET).pull(h, timeout_s=20)
        got = JaxKVReceiver(layout, secret=SECRET).pull(h, timeout_s=20)
        assert got.pages.tobytes() == pages.tobytes() and got.num_tokens == 12
        assert [e.reason for e in s.drain_finished()] == ["pulled"]
        with pytest.raises(TransferNotFoundError):
            JaxKVReceiver(layout, secret=SECRET).pull(h, timeout_s=20)
