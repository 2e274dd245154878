"""Transports by name. A transport's module is imported only when it is chosen, so a worker that
uses `grpc` never imports Ray's client, and one that uses `ray` never starts a gRPC server."""

from __future__ import annotations

import importlib
from typing import NamedTuple

from kvtransfer.base import KVReceiver, KVSender


class TransportEntry(NamedTuple):
    module: str
    sender_class: str
    receiver_class: str


_TRANSPORTS: dict[str, TransportEntry] = {
    "ray": TransportEntry("kvtransfer.ray_transport", "RayKVSender", "RayKVReceiver"),
    "grpc": TransportEntry("kvtransfer.grpc_transport", "GrpcKVSender", "GrpcKVReceiver"),
    "rdt": TransportEntry("kvtransfer.rdt_transport", "RdtKVSender", "RdtKVReceiver"),
}


def transport_names() -> list[str]:
    return sorted(_TRANSPORTS)


def _load(name: str, attribute: str) -> type:
    entry = _TRANSPORTS.get(name)
    if entry is None:
        raise ValueError(f"unknown KV transport {name!r}; known: {', '.join(transport_names())}")
    return getattr(importlib.import_module(entry.module), getattr(entry, attribute))


def create_sender(name: str, *args, **kwargs) -> KVSender:
    """A sender of the named transport: `create_sender("grpc", cache, allocator, sender_id,
    epoch)`."""
    return _load(name, "sender_class")(*args, **kwargs)


def create_receiver(name: str, *args, **kwargs) -> KVReceiver:
    """A receiver of the named transport: `create_receiver("grpc", cache, allocator, host=...,
    port=0)`."""
    return _load(name, "receiver_class")(*args, **kwargs)
