"""A KV producer in its own process, for the transport tests (run as a script, not collected).

Offers one request's pages (random bit patterns of the given dtype, from ``--seed``) on a
``TcpKVSender``, prints the handle as one JSON line, then reads commands from stdin: ``events``
prints the drained lease events as a JSON line; EOF closes the sender and exits.
``--fault stall-half`` sends half the pages frame, prints ``STALLED`` and sleeps (the tests then
kill it, or let the consumer time out).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import numpy as np

from tpuserve.kv_cache.transfer.layout import KVLayout
from tpuserve.kv_cache.transfer.tcp import TcpKVSender


def random_pages(layout: KVLayout, num_pages: int, seed: int) -> np.ndarray:
    """Random *bits* viewed as the layout's dtype: NaN payloads, -0.0, subnormals all included."""
    dt = layout.np_dtype
    bits = np.random.default_rng(seed).integers(0, 256, layout.pages_nbytes(num_pages), dtype=np.uint8)
    return bits.view(dt).reshape(layout.pages_shape(num_pages))


class _HalfSocket:
    """Forwards to a socket until ``limit`` bytes were sent, then announces a stall and sleeps."""

    def __init__(self, sock, limit: int):
        self.sock, self.limit, self.sent = sock, limit, 0

    def settimeout(self, t):
        self.sock.settimeout(t)

    def sendall(self, buf):
        mv = memoryview(buf).cast("B")
        room = self.limit - self.sent
        if mv.nbytes > room:
            self.sock.sendall(mv[:room])
            print("STALLED", flush=True)
            time.sleep(3600)
        self.sock.sendall(mv)
        self.sent += mv.nbytes


class StallingSender(TcpKVSender):
    def _write_pages(self, conn, header, buffers, deadline):
        half = sum(b.nbytes for b in buffers) // 2
        super()._write_pages(_HalfSocket(conn, half), header, buffers, deadline)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", required=True, help="KVLayout as JSON")
    ap.add_argument("--num-pages", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ttl", type=float, default=60.0)
    ap.add_argument("--fault", choices=["none", "stall-half"], default="none")
    args = ap.parse_args()
    layout = KVLayout.from_dict(json.loads(args.layout))
    cls = StallingSender if args.fault == "stall-half" else TcpKVSender
    sender = cls(layout, io_timeout_s=30.0)  # secret from $TPUSERVE_KV_SECRET
    pages = random_pages(layout, args.num_pages, args.seed)
    handle = sender.offer(
        "req-1",
        pages,
        num_tokens=args.num_pages * layout.page_size - 1,
        meta={"seed": args.seed},
        ttl_s=args.ttl,
    )
    print(json.dumps(dataclasses.asdict(handle)), flush=True)
    for line in sys.stdin:
        if line.strip() == "events":
            print(json.dumps([dataclasses.asdict(e) for e in sender.drain_finished()]), flush=True)
    sender.close()


if __name__ == "__main__":
    main()
