"""Errors of KV transfer. All derive from ``KVTransferError`` so a caller can fall back on any."""

from __future__ import annotations


class KVTransferError(RuntimeError):
    """A transfer failed; the consumer should recompute the request (or fail it)."""


class AuthError(KVTransferError):
    """The peer did not prove knowledge of the shared secret (or refused ours)."""


class LayoutMismatchError(KVTransferError):
    """The two engines' KV layouts differ (model, page size, heads, dtype, TP, ...)."""


class TransferNotFoundError(KVTransferError):
    """The producer holds no pages under that transfer id (never offered, pulled, or expired)."""


class TransferTimeoutError(KVTransferError):
    """The peer did not answer within the deadline."""


class PeerClosedError(KVTransferError):
    """The peer closed the connection (or died) before the exchange finished."""


class ProtocolError(KVTransferError):
    """The peer sent something that is not a valid frame or not the expected message."""
