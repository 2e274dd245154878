"""Typed errors of a KV handoff: each names what went wrong and which request it hit."""

from __future__ import annotations

from typing import Optional


class KVTransferError(RuntimeError):
    """Base of every kvtransfer failure; `request_id` is None where the message could not be
    read."""

    def __init__(self, message: str, request_id: Optional[str] = None):
        super().__init__(message)
        self.request_id = request_id


class WireFormatError(KVTransferError):
    """A message that is not a well-formed KV header (missing field, wrong type, truncated
    payload)."""


class WireVersionError(WireFormatError):
    """The peer speaks another wire format version."""


class LayoutMismatchError(KVTransferError):
    """The peer's KV layout fingerprint (layers, kv heads, head dim, block size, dtype) differs from
    ours."""


class ChecksumError(KVTransferError):
    """A payload whose checksum does not match its header: corrupted in flight, nothing
    installed."""


class UnknownRequestError(KVTransferError):
    """KV for a request the receiver holds no reservation for (never reserved, expired, or
    aborted)."""


class TransferAbortedError(KVTransferError):
    """One side aborted the handoff (client gone, sender lost, receiver shut down)."""


class LeaseExpiredError(KVTransferError):
    """The sender's lease ran out before the receiver acknowledged; the sender's blocks were
    freed."""


class ReservationExpiredError(KVTransferError):
    """The receiver's reservation ran out before all layers arrived; its blocks were freed."""
