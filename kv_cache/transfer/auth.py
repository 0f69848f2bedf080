"""The shared secret of a KV transfer deployment and the HMAC-SHA256 challenge proofs.

Every engine of a P/D deployment holds the same secret: ``TPUSERVE_KV_SECRET`` (the value) or
``TPUSERVE_KV_SECRET_FILE`` (a file holding it), or one given explicitly. A connection proves
knowledge of it without sending it: each side sends a fresh random nonce and answers the other's
nonce with ``HMAC(secret, label | nonces)`` (the producer's proof also covers its layout digest,
which it shows only to a consumer that has proven the secret). Labels differ per direction so a
proof cannot be reflected back. No secret, no transfer: an unauthenticated transport is never the
default.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

SECRET_ENV = "TPUSERVE_KV_SECRET"
SECRET_FILE_ENV = "TPUSERVE_KV_SECRET_FILE"
MIN_SECRET_BYTES = 16
NONCE_BYTES = 32

CLIENT_LABEL = b"tpuserve-kv/consumer-proof/v1"
SERVER_LABEL = b"tpuserve-kv/producer-proof/v1"


def load_secret(secret: bytes | str | None = None, path: str | None = None) -> bytes:
    """The shared secret: ``secret``, else the file ``path``, else ``$TPUSERVE_KV_SECRET``, else the
    file named by ``$TPUSERVE_KV_SECRET_FILE``. ValueError when none is set or it is too short."""
    source = "the given secret"
    if secret is None and path is None:
        if os.environ.get(SECRET_ENV):
            secret, source = os.environ[SECRET_ENV], f"${SECRET_ENV}"
        elif os.environ.get(SECRET_FILE_ENV):
            path = os.environ[SECRET_FILE_ENV]
    if secret is None and path is not None:
        with open(path, "rb") as f:
            secret, source = f.read().strip(), f"secret file {path}"
    if secret is None:
        raise ValueError(
            f"KV transfer needs a shared secret: set {SECRET_ENV} (or {SECRET_FILE_ENV} "
            f"to a file holding it) to the same value on every engine"
        )
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(
            f"{source} is {len(raw)} bytes; a KV transfer secret needs at least "
            f"{MIN_SECRET_BYTES} (e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)"
        )
    return raw


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over ``label`` and length-prefixed ``parts`` (so part boundaries are unambiguous)."""
    m = hmac.new(secret, label, hashlib.sha256)
    for p in parts:
        m.update(len(p).to_bytes(4, "big"))
        m.update(p)
    return m.digest()


def check_proof(expected: bytes, got: bytes) -> bool:
    """Constant-time comparison."""
    return hmac.compare_digest(expected, got)
