"""The KV wire format, version 3: a msgpack header followed by the payload bytes.

One message carries one *layer group* of one request: layers `[layer_start, layer_stop)` of all its
blocks, exported by `PagedKVCache.export_blocks` as a contiguous
`[layers, 2, num_blocks, block_size_tokens, kv_heads, head_dim]` tensor, shipped as its bytes or
encoded by the request's wire mode (`wire`: none, lossless, fp8, int8; kvtransfer/codecs.py).
The header carries the format version, the handoff identity (request id, sender id and epoch), the
layout fingerprint (the `KVLayout` fields), the layer range, the block count, the wire mode, the
payload length (the bytes on the wire) and an XXH3-64 checksum of those bytes (v1 used CRC-32:
4 GB/s here, XXH3 30 GB/s; `rdt` on device memory puts its on-device checksum there,
kvtransfer/rdt_transport.py). v2 had no wire mode. A receiver checks version, layout and wire mode
on the first message it reads and fails with a typed error; nothing received is ever unpickled.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch
import xxhash

from engine.kv_cache import KVLayout
from kvtransfer import codecs
from kvtransfer.errors import LayoutMismatchError, WireFormatError, WireVersionError

WIRE_VERSION = 3
_MAX_HEADER_BYTES = 4096
_LAYOUT_FIELDS = tuple(field.name for field in dataclasses.fields(KVLayout))
_LAYOUT_TYPES = (int, int, int, int, str)  # KVLayout's fields, in order


def checksum(payload: Any) -> int:
    """XXH3-64 of a bytes-like payload (any buffer: bytes, memoryview, a contiguous numpy array)."""
    return xxhash.xxh3_64_intdigest(payload)


def group_payload_bytes(layout: KVLayout, num_layers: int, num_blocks: int) -> int:
    return num_layers * num_blocks * layout.bytes_per_block_per_layer


@dataclass(frozen=True)
class KVGroupHeader:
    """The header of one layer group; `payload_bytes` bytes follow it, the group encoded as `wire`
    says (kvtransfer/codecs.py)."""

    request_id: str
    sender_id: str
    sender_epoch: int
    layout: KVLayout
    layer_start: int
    layer_stop: int
    num_blocks: int
    payload_bytes: int
    checksum: int
    wire: str = "none"
    version: int = WIRE_VERSION

    @property
    def layers(self) -> slice:
        return slice(self.layer_start, self.layer_stop)

    @property
    def raw_bytes(self) -> int:
        """The group's size in the cache's own dtype (`payload_bytes` where `wire` is none)."""
        return group_payload_bytes(self.layout, self.layer_stop - self.layer_start, self.num_blocks)

    def encode(self) -> bytes:
        return msgpack.packb(
            {
                "version": self.version,
                "request_id": self.request_id,
                "sender_id": self.sender_id,
                "sender_epoch": self.sender_epoch,
                "layout": [getattr(self.layout, name) for name in _LAYOUT_FIELDS],
                "layer_start": self.layer_start,
                "layer_stop": self.layer_stop,
                "num_blocks": self.num_blocks,
                "payload_bytes": self.payload_bytes,
                "checksum": self.checksum,
                "wire": self.wire,
            }
        )

    @classmethod
    def decode(cls, data: bytes, expected_layout: KVLayout) -> "KVGroupHeader":
        """Parse and validate a header against our layout; raises a `WireFormatError` subclass or
        `LayoutMismatchError`, checking the version before anything else."""
        if len(data) > _MAX_HEADER_BYTES:
            raise WireFormatError(f"KV header of {len(data)} bytes exceeds {_MAX_HEADER_BYTES}")
        try:
            fields = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as error:  # msgpack raises several unrelated types for garbage input
            raise WireFormatError(
                f"KV header is not valid msgpack ({len(data)} bytes): {error}"
            ) from None
        if not isinstance(fields, dict):
            raise WireFormatError(f"KV header must be a msgpack map, got {type(fields).__name__}")
        request_id = fields.get("request_id") if isinstance(fields.get("request_id"), str) else None
        version = fields.get("version")
        if version != WIRE_VERSION:
            raise WireVersionError(
                f"KV wire format version {version!r} from sender {fields.get('sender_id')!r}; "
                f"this receiver speaks version {WIRE_VERSION}",
                request_id,
            )
        try:
            layout = _layout(fields["layout"])
            header = cls(
                request_id=_typed(fields, "request_id", str),
                sender_id=_typed(fields, "sender_id", str),
                sender_epoch=_typed(fields, "sender_epoch", int),
                layout=layout,
                layer_start=_typed(fields, "layer_start", int),
                layer_stop=_typed(fields, "layer_stop", int),
                num_blocks=_typed(fields, "num_blocks", int),
                payload_bytes=_typed(fields, "payload_bytes", int),
                checksum=_typed(fields, "checksum", int),
                wire=_typed(fields, "wire", str),
            )
        except (KeyError, TypeError) as error:
            raise WireFormatError(f"malformed KV header: {error}", request_id) from None
        if layout != expected_layout:
            differing = [
                f"{name} {getattr(layout, name)!r} != ours {getattr(expected_layout, name)!r}"
                for name in _LAYOUT_FIELDS
                if getattr(layout, name) != getattr(expected_layout, name)
            ]
            raise LayoutMismatchError(
                f"KV layout of sender {header.sender_id!r} does not match this receiver: "
                f"{', '.join(differing)}",
                request_id,
            )
        try:  # a mode this receiver does not decode is refused at the first message
            codecs.codec(header.wire)
        except WireFormatError as error:
            raise WireFormatError(
                f"sender {header.sender_id!r}: {error}", header.request_id
            ) from None
        header.validate_shape()
        return header

    def validate_shape(self) -> None:
        if not 0 <= self.layer_start < self.layer_stop <= self.layout.num_layers:
            raise WireFormatError(
                f"layer range [{self.layer_start}, {self.layer_stop}) outside [0, "
                f"{self.layout.num_layers})",
                self.request_id,
            )
        if self.num_blocks < 1:
            raise WireFormatError(
                f"num_blocks must be >= 1, got {self.num_blocks}", self.request_id
            )
        wire_codec = codecs.codec(self.wire)
        num_layers = self.layer_stop - self.layer_start
        if wire_codec is None:
            expected = group_payload_bytes(self.layout, num_layers, self.num_blocks)
            problem = None if self.payload_bytes == expected else f"{expected} bytes expected"
        else:
            problem = wire_codec.check_length(
                self.payload_bytes, self.layout, num_layers, self.num_blocks
            )
        if problem is not None:
            raise WireFormatError(
                f"payload_bytes {self.payload_bytes} ({self.wire}) for {num_layers} layers x "
                f"{self.num_blocks} blocks: {problem}",
                self.request_id,
            )


def _layout(values: Any) -> KVLayout:
    """A layout as sent: a list of its fields, each of its own type. Refused, not converted, when
    one is not: 4.0 or True compare equal to 4 or 1, so they would pass the comparison with ours and
    flow into tensor shapes."""
    if not isinstance(values, list) or len(values) != len(_LAYOUT_FIELDS):
        raise TypeError(f"field 'layout' must be a list of {len(_LAYOUT_FIELDS)} values")
    return KVLayout(
        *(
            _of_type(value, f"layout.{name}", kind)
            for value, name, kind in zip(values, _LAYOUT_FIELDS, _LAYOUT_TYPES)
        )
    )


def _typed(fields: dict, name: str, kind: type) -> Any:
    return _of_type(fields[name], name, kind)


def _of_type(value: Any, name: str, kind: type) -> Any:
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TypeError(
            f"field {name!r} must be {kind.__name__}, got {type(value).__name__} {value!r:.40}"
        )
    return value


def as_bytes_view(tensor: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view (no copy) of a contiguous CPU tensor of any dtype (bf16 included)."""
    if not tensor.is_contiguous():
        raise ValueError("KV payload tensor must be contiguous")
    return tensor.reshape(-1).view(torch.uint8).numpy()


def payload_as_kv(payload: Any, header: KVGroupHeader) -> torch.Tensor:
    """The `[layers, 2, blocks, ...]` tensor, in the layout's dtype, that a received (and verified)
    payload buffer encodes: a view (no copy) where the wire mode is none, else decoded.

    The buffer may be read-only (a Ray object store mapping); the tensor is only ever read from. A
    uint8 tensor (rdt, on the device it arrived on) is viewed as it is.
    """
    if isinstance(payload, torch.Tensor):
        data = payload.reshape(-1).view(torch.uint8)[: header.payload_bytes]
    else:
        flat = np.frombuffer(payload, dtype=np.uint8, count=header.payload_bytes)
        with warnings.catch_warnings():
            # "non-writable array": we never write into it
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(flat)
    wire_codec = codecs.codec(header.wire)
    if wire_codec is not None:
        return wire_codec.decode(
            data, header.layout, header.layer_stop - header.layer_start, header.num_blocks
        )
    layout = header.layout
    shape = (
        header.layer_stop - header.layer_start,
        2,
        header.num_blocks,
        layout.block_size_tokens,
        layout.num_kv_heads,
        layout.head_dim,
    )
    return data.view(layout.torch_dtype).view(shape)
