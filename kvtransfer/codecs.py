"""The wire codecs of a layer group, by mode (protocol/kv_wire.py names them and their costs).

A sender encodes the exported `[layers, 2, blocks, block_size_tokens, kv_heads, head_dim]` tensor
into flat uint8 wire bytes (`encode`); the header then carries the mode and the wire's length, and
its checksum covers the wire bytes. The receiver verifies the checksum first, then decodes into its
cache's own dtype (`decode`). What each mode writes:

- `none`: the tensor's bytes.
- `lossless`: blosc2 (zstd level 1 after a byte-plane shuffle of the element size) of the tensor's
  bytes, one blosc2 frame; the frame's own sizes are checked against the header before decoding.
  Measured on real KV here (scripts/kv_wire_bench.py), faster to decode than numpy's shuffle plus
  `zstandard` by 3-4x at the same ratio, and lz4 shrinks half as much.
- `fp8` and `int8`: fp32 scales `[layers, 2, blocks, kv_heads]` (each the largest magnitude of its
  block's and head's values over the format's largest value), then one byte per value: e4m3 of
  value / scale, or round(value / scale) clamped to [-127, 127]. A value is recovered within
  scale / 2 (int8), or within 1/16 of itself plus scale * 2^-10 (fp8), before rounding to the
  cache's dtype. Non-finite values are not representable: lossy modes are for finite KV.

Encoding and decoding run where the tensor lies (torch ops; lossless through the host).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import torch

from engine.kv_cache import KVLayout
from kvtransfer.errors import WireFormatError
from protocol.kv_wire import LOSSY_WIRE_MODES, WIRE_MODES

_SCALE_DIMS = (3, 5)  # block_size_tokens and head_dim: one scale per (layer, k/v, block, head)


def group_shape(layout: KVLayout, num_layers: int, num_blocks: int) -> tuple[int, ...]:
    return (
        num_layers,
        2,
        num_blocks,
        layout.block_size_tokens,
        layout.num_kv_heads,
        layout.head_dim,
    )


class WireCodec(ABC):
    name: str
    lossy: bool

    @abstractmethod
    def encode(self, data: torch.Tensor) -> torch.Tensor:
        """The wire bytes (a flat uint8 tensor) of an exported group."""

    @abstractmethod
    def decode(
        self, wire: torch.Tensor, layout: KVLayout, num_layers: int, num_blocks: int
    ) -> torch.Tensor:
        """The group, in `layout`'s dtype and shape, from wire bytes whose length `check_length`
        accepted (a flat uint8 tensor, possibly read-only: only ever read)."""

    @abstractmethod
    def check_length(
        self, wire_bytes: int, layout: KVLayout, num_layers: int, num_blocks: int
    ) -> Optional[str]:
        """Why `wire_bytes` cannot be this mode's encoding of such a group; None when it can."""


class _Scaled(WireCodec):
    """fp8 and int8: scales first, then one byte per value."""

    lossy = True
    max_value: float
    wire_dtype: torch.dtype

    @staticmethod
    def _scale_bytes(layout: KVLayout, num_layers: int, num_blocks: int) -> int:
        return num_layers * 2 * num_blocks * layout.num_kv_heads * 4

    def wire_bytes(self, layout: KVLayout, num_layers: int, num_blocks: int) -> int:
        values = num_layers * 2 * num_blocks * layout.block_size_tokens * layout.num_kv_heads
        return self._scale_bytes(layout, num_layers, num_blocks) + values * layout.head_dim

    def check_length(self, wire_bytes, layout, num_layers, num_blocks):
        expected = self.wire_bytes(layout, num_layers, num_blocks)
        if wire_bytes != expected:
            return (
                f"{self.name} wire of {num_layers} layers x {num_blocks} blocks is {expected} bytes"
            )
        return None

    def encode(self, data: torch.Tensor) -> torch.Tensor:
        values = data.to(torch.float32)
        amax = values.abs().amax(dim=_SCALE_DIMS, keepdim=True)
        scales = torch.where(amax > 0, amax / self.max_value, torch.ones_like(amax))
        quantized = self._quantize(values / scales)  # not in place: fp32 data is `values`
        scales = scales.reshape(-1).contiguous().view(torch.uint8)
        return torch.cat((scales, quantized.reshape(-1).view(torch.uint8)))

    @abstractmethod
    def _quantize(self, scaled: torch.Tensor) -> torch.Tensor: ...

    def decode(self, wire, layout, num_layers, num_blocks):
        shape = group_shape(layout, num_layers, num_blocks)
        scale_bytes = self._scale_bytes(layout, num_layers, num_blocks)
        scales = wire[:scale_bytes].view(torch.float32)
        scales = scales.view(num_layers, 2, num_blocks, 1, layout.num_kv_heads, 1)
        quantized = wire[scale_bytes:].view(self.wire_dtype).view(shape)
        return quantized.to(torch.float32).mul_(scales).to(layout.torch_dtype)


class _Fp8(_Scaled):
    name = "fp8"
    max_value = 448.0  # e4m3's largest finite value
    wire_dtype = torch.float8_e4m3fn

    def _quantize(self, scaled):
        return scaled.clamp_(-self.max_value, self.max_value).to(torch.float8_e4m3fn)


class _Int8(_Scaled):
    name = "int8"
    max_value = 127.0
    wire_dtype = torch.int8

    def _quantize(self, scaled):
        return scaled.round_().clamp_(-self.max_value, self.max_value).to(torch.int8)


class _Lossless(WireCodec):
    name = "lossless"
    lossy = False
    clevel = 1

    def encode(self, data: torch.Tensor) -> torch.Tensor:
        import blosc2

        raw = data.reshape(-1).view(torch.uint8).cpu().numpy()
        frame = blosc2.compress2(
            raw,
            typesize=data.element_size(),
            codec=blosc2.Codec.ZSTD,
            clevel=self.clevel,
            filters=[blosc2.Filter.SHUFFLE],
            nthreads=1,  # a worker computes on the cores Ray gives it
        )
        return torch.frombuffer(bytearray(frame), dtype=torch.uint8)

    def check_length(self, wire_bytes, layout, num_layers, num_blocks):
        raw_bytes = num_layers * num_blocks * layout.bytes_per_block_per_layer
        if not 0 < wire_bytes < raw_bytes:
            return f"lossless wire of a {raw_bytes}-byte group must be 1..{raw_bytes - 1} bytes"
        return None

    def decode(self, wire, layout, num_layers, num_blocks):
        import blosc2

        raw_bytes = num_layers * num_blocks * layout.bytes_per_block_per_layer
        frame = wire.cpu().numpy()
        try:
            decoded_bytes, frame_bytes, _ = blosc2.get_cbuffer_sizes(frame)
        except Exception as error:  # blosc2 raises several types for a header it cannot read
            raise WireFormatError(f"lossless KV frame unreadable: {error}") from None
        if decoded_bytes != raw_bytes or frame_bytes != frame.nbytes:
            raise WireFormatError(
                f"lossless KV frame holds {decoded_bytes} bytes in {frame_bytes}; the header says "
                f"{raw_bytes} in {frame.nbytes}"
            )
        out = torch.empty(raw_bytes, dtype=torch.uint8)
        blosc2.decompress2(frame, dst=out.numpy(), nthreads=1)
        return out.view(layout.torch_dtype).view(group_shape(layout, num_layers, num_blocks))


_CODECS: dict[str, WireCodec] = {codec.name: codec for codec in (_Lossless(), _Fp8(), _Int8())}
assert set(_CODECS) | {"none"} == set(WIRE_MODES)
assert {name for name, codec in _CODECS.items() if codec.lossy} == LOSSY_WIRE_MODES


def codec(mode: str) -> Optional[WireCodec]:
    """The codec of a mode; None for `none`. A mode this receiver does not know is a
    `WireFormatError` naming the ones it does."""
    if mode == "none":
        return None
    found = _CODECS.get(mode)
    if found is None:
        raise WireFormatError(
            f"KV wire mode {mode!r} is not one this receiver decodes ({', '.join(WIRE_MODES)})"
        )
    return found


def encode(data: torch.Tensor, mode: str) -> tuple[str, torch.Tensor]:
    """(the mode used, the wire bytes) of an exported group. A lossless frame no smaller than the
    group is not worth decoding: it goes as `none`."""
    chosen = codec(mode)
    raw = data.reshape(-1).view(torch.uint8)
    if chosen is None:
        return "none", raw
    wire = chosen.encode(data)
    if not chosen.lossy and wire.numel() >= raw.numel():
        return "none", raw
    return mode, wire
