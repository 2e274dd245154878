"""How a request's KV is written on the wire (`--kv-wire`), torch-free: the modes, and what each
costs on the CPUs measured (the router's `auto` choice reads it: router/kv_wire.py).

- `none`: the cache's own bytes (bf16 or fp32);
- `lossless`: a byte-plane shuffle, then zstd (blosc2, level 1): bit-exact;
- `fp8`: e4m3, with an fp32 scale per (layer, k/v, block, kv head);
- `int8`: symmetric int8, with a scale per (layer, k/v, block, kv head).

The codecs themselves are `kvtransfer/codecs.py`; the receiver decodes into its cache's dtype.
"""

from __future__ import annotations

from typing import NamedTuple

WIRE_MODES = ("none", "lossless", "fp8", "int8")
LOSSY_WIRE_MODES = frozenset({"fp8", "int8"})


class CodecCost(NamedTuple):
    """One codec on one cache dtype, on one core: the wire's size over the raw KV's, and the raw KV
    bytes it encodes and decodes per second."""

    wire_ratio: float
    encode_bytes_per_s: float
    decode_bytes_per_s: float

    def codec_s(self, raw_bytes: int) -> float:
        return raw_bytes / self.encode_bytes_per_s + raw_bytes / self.decode_bytes_per_s


# Measured by `scripts/kv_wire_bench.py` on a prompt's real KV (the default model, 512 tokens), one
# thread, on an AMD EPYC with AVX-512 and AVX512_BF16 (torch's `get_cpu_capability()`: AVX512);
# speeds are of raw KV bytes. `none` costs nothing more than the handoff already pays.
_INF = float("inf")
CODEC_COSTS: dict[tuple[str, str], CodecCost] = {
    ("none", "float32"): CodecCost(1.0, _INF, _INF),
    ("none", "bfloat16"): CodecCost(1.0, _INF, _INF),
    ("lossless", "float32"): CodecCost(0.842, 690e6, 1900e6),
    ("lossless", "bfloat16"): CodecCost(0.689, 500e6, 1780e6),
    ("fp8", "float32"): CodecCost(0.251, 1540e6, 1200e6),
    ("fp8", "bfloat16"): CodecCost(0.502, 970e6, 570e6),
    ("int8", "float32"): CodecCost(0.251, 2440e6, 11900e6),
    ("int8", "bfloat16"): CodecCost(0.502, 790e6, 3500e6),
}
