"""The framed-TCP KV transport across two processes on loopback.

The producer runs in a child process (``kv_producer_child.py``); pages are random bit patterns
(NaN payloads included), so "equal" below means bitwise equal, checked on the raw bytes against the
same pages regenerated here from the seed.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from kv_producer_child import random_pages  # tests/kv_cache/transfer/kv_producer_child.py
from polling import wait_until  # tests/polling.py

from tpuserve.kv_cache.transfer.errors import (
    AuthError,
    KVTransferError,
    LayoutMismatchError,
    PeerClosedError,
    TransferNotFoundError,
    TransferTimeoutError,
)
from tpuserve.kv_cache.transfer.layout import KVLayout
from tpuserve.kv_cache.transfer.tcp import TcpKVReceiver, TcpKVSender
from tpuserve.kv_cache.transfer.transport import TransferHandle, check_kv_transfer_params

pytestmark = pytest.mark.timeout(90)

CHILD = Path(__file__).with_name("kv_producer_child.py")
SECRET = "0123456789abcdef-test-secret"


def _layout(dtype: str = "float32", **kw) -> KVLayout:
    base = dict(model_id="tiny", num_layers=3, page_size=4, combined_heads=4, head_dim=8, dtype=dtype)
    return KVLayout(**{**base, **kw})


class Producer:
    """The child producer process; ``handle`` is what it offered."""

    def __init__(self, layout: KVLayout, *args: str, secret: str = SECRET):
        env = {**os.environ, "TPUSERVE_KV_SECRET": secret}
        env.pop("TPUSERVE_KV_SECRET_FILE", None)
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), "--layout", json.dumps(layout.to_dict()), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=str(CHILD.parent),
        )
        self.handle = TransferHandle(**json.loads(self.line()))

    def line(self, timeout: float = 30.0) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, "producer child printed nothing"
        out = self.proc.stdout.readline()
        assert out, f"producer child exited with {self.proc.poll()}"
        return out

    def events(self) -> list[dict]:
        self.proc.stdin.write("events\n")
        self.proc.stdin.flush()
        return json.loads(self.line())

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(10)
            except (subprocess.TimeoutExpired, BrokenPipeError):
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def producer():
    made: list[Producer] = []

    def make(layout: KVLayout, *args: str, **kw) -> Producer:
        made.append(Producer(layout, *args, **kw))
        return made[-1]

    yield make
    for p in made:
        p.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pages_arrive_bitwise_equal_and_the_lease_ends_pulled(producer, dtype):
    layout = _layout(dtype)
    p = producer(layout, "--num-pages", "5", "--seed", "7")
    h = p.handle
    assert (h.host, h.num_pages, h.num_tokens, h.layout_digest) == ("127.0.0.1", 5, 19, layout.digest())
    batch = TcpKVReceiver(layout, secret=SECRET).pull(h, timeout_s=30)
    want = random_pages(layout, 5, 7)
    assert batch.pages.shape == (3, 5, 4, 4, 8) and batch.pages.dtype == want.dtype
    assert batch.pages.tobytes() == want.tobytes()
    assert (batch.request_id, batch.num_tokens, batch.meta) == ("req-1", 19, {"seed": 7})
    assert p.events() == [{"request_id": "req-1", "transfer_id": h.transfer_id, "reason": "pulled"}]
    with pytest.raises(TransferNotFoundError, match="already pulled"):  # freed: nothing to pull twice
        TcpKVReceiver(layout, secret=SECRET).pull(h, timeout_s=30)


def test_kv_transfer_params_round_trip(producer):
    layout = _layout()
    p = producer(layout)
    params = json.loads(json.dumps(p.handle.to_kv_transfer_params()))  # as it crosses HTTP
    assert params["do_remote_prefill"] is True
    h = TransferHandle.from_kv_transfer_params(params)
    assert h == p.handle
    assert (
        TcpKVReceiver(layout, secret=SECRET).pull(h).pages.tobytes() == random_pages(layout, 5, 0).tobytes()
    )
    with pytest.raises(ValueError, match="remote_port"):
        TransferHandle.from_kv_transfer_params({**params, "remote_port": "80"})


def test_wrong_secret_is_refused_and_the_pages_stay_for_the_right_one(producer):
    layout = _layout()
    p = producer(layout)
    with pytest.raises(AuthError, match="refused authentication.*TPUSERVE_KV_SECRET"):
        TcpKVReceiver(layout, secret="not-the-secret-at-all").pull(p.handle, timeout_s=30)
    assert p.events() == []
    got = TcpKVReceiver(layout, secret=SECRET).pull(p.handle, timeout_s=30)
    assert got.pages.tobytes() == random_pages(layout, 5, 0).tobytes()


def test_impostor_producer_is_refused_by_the_consumer():
    """A listener without the secret cannot feed a consumer pages (mutual authentication)."""
    layout = _layout()
    with TcpKVSender(layout, secret="an-impostor-secret-value") as fake:
        h = fake.offer("req-1", random_pages(layout, 2, 0), num_tokens=8)
        with pytest.raises(AuthError):
            TcpKVReceiver(layout, secret=SECRET).pull(h, timeout_s=10)


@pytest.mark.parametrize(
    "change,field",
    [
        ({"page_size": 8}, "page_size: 8 != 4"),
        ({"dtype": "bfloat16"}, "dtype: 'bfloat16' != 'float32'"),
        ({"tp_size": 2}, "tp_size: 2 != 1"),
        ({"model_id": "other"}, "model_id: 'other' != 'tiny'"),
    ],
)
def test_mismatched_layout_is_refused_naming_the_field(producer, change, field):
    p = producer(_layout())
    with pytest.raises(LayoutMismatchError, match=field.replace("(", r"\(")):
        TcpKVReceiver(_layout(**change), secret=SECRET).pull(p.handle, timeout_s=30)
    assert p.events() == []  # nothing was handed out


def test_producer_killed_mid_transfer_gives_a_clean_error_quickly(producer):
    layout = _layout(num_layers=4, page_size=16, combined_heads=8, head_dim=64)  # 1 MiB of pages
    p = producer(layout, "--num-pages", "8", "--fault", "stall-half")
    result: dict = {}

    def pull():
        try:
            TcpKVReceiver(layout, secret=SECRET, io_timeout_s=30).pull(p.handle, timeout_s=60)
        except Exception as e:
            result["error"] = e

    t = threading.Thread(target=pull)
    t.start()
    assert p.line().strip() == "STALLED"
    t0 = time.monotonic()
    os.kill(p.proc.pid, signal.SIGKILL)
    t.join(20)
    assert not t.is_alive(), "the consumer hung after the producer died"
    assert time.monotonic() - t0 < 10
    err = result.get("error")
    assert isinstance(err, PeerClosedError), repr(err)
    assert "of 1048576 bytes" in str(err)


def test_stalled_producer_times_out_instead_of_hanging(producer):
    layout = _layout()
    p = producer(layout, "--fault", "stall-half")
    t0 = time.monotonic()
    with pytest.raises(TransferTimeoutError, match="sent nothing for 1s"):
        TcpKVReceiver(layout, secret=SECRET, io_timeout_s=1.0).pull(p.handle, timeout_s=30)
    assert time.monotonic() - t0 < 8


def test_dead_producer_address_fails_fast():
    layout = _layout()
    with TcpKVSender(layout, secret=SECRET) as s:
        h = s.offer("r", random_pages(layout, 1, 0), num_tokens=4)
    t0 = time.monotonic()
    with pytest.raises(PeerClosedError, match="cannot connect"):
        TcpKVReceiver(layout, secret=SECRET).pull(h, timeout_s=10)
    assert time.monotonic() - t0 < 5


def test_lease_expiry_frees_the_pages():
    layout = _layout()
    with TcpKVSender(layout, secret=SECRET) as s:
        h = s.offer("req-9", random_pages(layout, 3, 1), num_tokens=12, ttl_s=0.3)
        keep = s.offer("req-10", random_pages(layout, 1, 2), num_tokens=4, ttl_s=60)
        assert s.leases.held_bytes == layout.pages_nbytes(4)
        wait_until(lambda: len(s.leases) <= 1, 30, what="the reaper")  # the reaper thread, no drain call
        assert len(s.leases) == 1 and s.leases.held_bytes == layout.pages_nbytes(1)
        assert [(e.request_id, e.reason) for e in s.drain_finished()] == [("req-9", "expired")]
        with pytest.raises(TransferNotFoundError, match="expired"):
            TcpKVReceiver(layout, secret=SECRET).pull(h, timeout_s=10)
        assert TcpKVReceiver(layout, secret=SECRET).pull(keep).request_id == "req-10"


def test_lease_events_expired_released_pulled():
    layout = _layout()
    with TcpKVSender(layout, secret=SECRET) as s:
        s.offer("a", random_pages(layout, 1, 0), num_tokens=4, ttl_s=0.2)
        b = s.offer("b", random_pages(layout, 1, 1), num_tokens=4)
        c = s.offer("c", random_pages(layout, 1, 2), num_tokens=4)
        r = TcpKVReceiver(layout, secret=SECRET)
        assert r.release(b) is True and r.release(b) is False
        r.pull(c)
        got: set[tuple[str, str]] = set()

        def three_ended() -> bool:  # "a" ends when its ttl has passed, whenever that is
            got.update((e.request_id, e.reason) for e in s.drain_finished())
            return len(got) >= 3

        wait_until(three_ended, 30, what="three lease events")
        assert got == {("a", "expired"), ("b", "released"), ("c", "pulled")}
        assert len(s.leases) == 0 and s.drain_finished() == []


def test_byte_cap_refuses_offers_beyond_it():
    layout = _layout()
    with TcpKVSender(layout, secret=SECRET, max_held_bytes=layout.pages_nbytes(2)) as s:
        s.offer("a", random_pages(layout, 2, 0), num_tokens=8)
        with pytest.raises(KVTransferError, match="cap"):
            s.offer("b", random_pages(layout, 1, 0), num_tokens=4)


def test_listener_is_loopback_and_survives_garbage():
    import socket

    layout = _layout()
    with TcpKVSender(layout, secret=SECRET) as s:
        assert s._listener.getsockname()[0] == "127.0.0.1"
        h = s.offer("r", random_pages(layout, 2, 3), num_tokens=8)
        with socket.create_connection(s.address, timeout=5) as junk:
            junk.recv(4096)  # the hello
            junk.sendall(b"GET / HTTP/1.1\r\n\r\n" * 4)
            junk.settimeout(5)
            try:
                assert junk.recv(4096) == b""  # dropped without a reply ...
            except ConnectionResetError:
                pass  # ... or reset, as unread bytes make the close an RST
        assert (
            TcpKVReceiver(layout, secret=SECRET).pull(h).pages.tobytes()
            == random_pages(layout, 2, 3).tobytes()
        )


def test_secret_is_required_and_read_from_env_or_file(tmp_path, monkeypatch):
    from tpuserve.kv_cache.transfer.auth import load_secret

    monkeypatch.delenv("TPUSERVE_KV_SECRET", raising=False)
    monkeypatch.delenv("TPUSERVE_KV_SECRET_FILE", raising=False)
    with pytest.raises(ValueError, match="TPUSERVE_KV_SECRET"):
        TcpKVSender(_layout())
    with pytest.raises(ValueError, match="at least 16"):
        load_secret("short")
    f = tmp_path / "secret"
    f.write_text(SECRET + "\n")
    monkeypatch.setenv("TPUSERVE_KV_SECRET_FILE", str(f))
    assert load_secret() == SECRET.encode()
    monkeypatch.setenv("TPUSERVE_KV_SECRET", "from-the-env-variable")
    assert load_secret() == b"from-the-env-variable"


def test_offer_checks_the_pages_against_the_layout():
    layout = _layout()
    with TcpKVSender(layout, secret=SECRET) as s:
        with pytest.raises(ValueError, match=r"\[3, n, 4, 4, 8\]"):
            s.offer("r", np.zeros((3, 2, 4, 4, 9), np.float32), num_tokens=8)
        with pytest.raises(ValueError, match="dtype"):
            s.offer("r", np.zeros((3, 2, 4, 4, 8), np.float16), num_tokens=8)


def test_check_kv_transfer_params_takes_vllm_shapes_and_names_bad_keys():
    # What vLLM's P/D proxies put on a prefill request: every remote key null.
    check_kv_transfer_params(
        {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
    )
    # vLLM's producer answers, with one block list per KV cache group on hybrid models; keys of
    # other connectors (pp_size) pass.
    ok = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_port": 5600, "tp_size": 2}
    check_kv_transfer_params({**ok, "remote_block_ids": [1, 2], "pp_size": 1})
    check_kv_transfer_params({**ok, "remote_block_ids": [[1, 2], [7]]})
    for key, bad in [
        ("do_remote_decode", 1),
        ("remote_port", True),
        ("remote_port", 0),
        ("remote_port", 65536),
        ("tp_size", 0),
        ("remote_block_ids", [1, -1]),
        ("remote_block_ids", [True]),
        ("remote_block_ids", "1,2"),
        ("remote_num_pages", "3"),
        ("remote_host", 127),
    ]:
        with pytest.raises(ValueError, match=f"kv_transfer_params\\.{key} "):
            check_kv_transfer_params({**ok, key: bad})


def test_a_vllm_producers_params_are_refused_by_name():
    nixl = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "nixl-engine",
        "remote_block_ids": [3, 4],
        "remote_request_id": "r",
        "remote_host": "10.0.0.2",
        "remote_port": 5600,
        "tp_size": 1,
    }
    with pytest.raises(ValueError, match="remote_transfer_id is missing.*not tpuserve"):
        TransferHandle.from_kv_transfer_params(nixl)
