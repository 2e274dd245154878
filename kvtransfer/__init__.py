"""Moving a request's KV blocks from a prefill worker to a decode worker: see `kvtransfer.base`.

Transports are created by name (`create_sender("grpc", ...)`, `create_receiver("ray", ...)`) and
their modules are imported only then.
"""

from kvtransfer.base import KVReceiver, KVSender
from kvtransfer.errors import (
    ChecksumError,
    KVTransferError,
    LayoutMismatchError,
    LeaseExpiredError,
    ReservationExpiredError,
    TransferAbortedError,
    UnknownRequestError,
    WireFormatError,
    WireVersionError,
)
from kvtransfer.leases import SenderEvents
from kvtransfer.registry import create_receiver, create_sender, transport_names
from kvtransfer.reservations import ReceiverEvents
from kvtransfer.wire import WIRE_VERSION, KVGroupHeader

__all__ = [
    "KVSender",
    "KVReceiver",
    "SenderEvents",
    "ReceiverEvents",
    "KVGroupHeader",
    "WIRE_VERSION",
    "create_sender",
    "create_receiver",
    "transport_names",
    "KVTransferError",
    "WireFormatError",
    "WireVersionError",
    "LayoutMismatchError",
    "ChecksumError",
    "UnknownRequestError",
    "TransferAbortedError",
    "LeaseExpiredError",
    "ReservationExpiredError",
]
