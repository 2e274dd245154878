"""The paged KV cache: one preallocated tensor per worker, and the layout `kvtransfer` moves.

Layout: `[num_layers, 2 (k, v), num_blocks, block_size_tokens, num_kv_heads, head_dim]`. A layer's K
(or V) cache is a contiguous `[num_blocks, block_size_tokens, kv_heads, head_dim]` view, and the
blocks of one request, for all layers or a group of layers, export as one contiguous tensor of shape
`[layers, 2, request_blocks, block_size_tokens, kv_heads, head_dim]` — what a transport ships.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from engine.config import ModelConfig

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class KVLayout:
    """Everything both ends of a KV handoff must agree on (the wire format's fingerprint)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size_tokens: int
    dtype: str

    @classmethod
    def for_model(
        cls, config: ModelConfig, block_size_tokens: int, dtype: torch.dtype
    ) -> "KVLayout":
        return cls(
            config.num_layers,
            config.num_kv_heads,
            config.head_dim,
            block_size_tokens,
            _DTYPE_NAMES[dtype],
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def bytes_per_block_per_layer(self) -> int:
        return 2 * self.block_size_tokens * self.num_kv_heads * self.head_dim * self.element_bytes

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * self.bytes_per_block_per_layer

    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size_tokens


AUTO_KV_FRACTION = 0.10  # of the memory available on the node, per worker
AUTO_KV_MAX_BYTES = 4 << 30  # as vLLM-CPU's default KV space
AUTO_KV_MIN_BYTES = 256 << 20
AUTO_KV_CUDA_FRACTION = 0.8  # of the GPU's free memory after the weights


def auto_kv_cache_bytes(device: str | torch.device = "cpu") -> int:
    """A worker's KV cache when none is configured: a tenth of the memory available on its node now
    (as vLLM sizes its cache from free memory), between 256 MiB and 4 GiB; on a GPU,
    `AUTO_KV_CUDA_FRACTION` of its free memory once the weights are in (vLLM's
    `gpu_memory_utilization`), the rest left to activations and CUDA graphs."""
    if torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free * AUTO_KV_CUDA_FRACTION)
    available = _available_memory_bytes()
    if available is None:
        return 512 << 20
    return int(min(AUTO_KV_MAX_BYTES, max(AUTO_KV_MIN_BYTES, available * AUTO_KV_FRACTION)))


def _available_memory_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class PagedKVCache:
    def __init__(self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu"):
        self.layout = layout
        self.num_blocks = num_blocks
        shape = (
            layout.num_layers,
            2,
            num_blocks,
            layout.block_size_tokens,
            layout.num_kv_heads,
            layout.head_dim,
        )
        self.kv = torch.zeros(shape, dtype=layout.torch_dtype, device=device)
        self._copy_stream = None  # CUDA: host staging of exported blocks (`_stage_to_host`)
        self.k_caches = [self.kv[layer, 0] for layer in range(layout.num_layers)]
        self.v_caches = [self.kv[layer, 1] for layer in range(layout.num_layers)]

    @classmethod
    def num_blocks_for_bytes(cls, layout: KVLayout, kv_cache_bytes: int) -> int:
        return max(1, kv_cache_bytes // layout.bytes_per_block)

    def export_blocks(
        self,
        block_ids: Sequence[int],
        layers: slice = slice(None),
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """A contiguous copy `[layers, 2, len(block_ids), block, kv_heads, head_dim]` of these
        blocks; with `out` (a uint8 buffer, large enough) written into its head instead of fresh
        memory (a reused buffer is several times faster to fill here than never-touched pages)."""
        index = torch.as_tensor(block_ids, dtype=torch.long, device=self.kv.device)
        source = self.kv[layers]
        if out is None:
            return source.index_select(2, index)
        shape = (source.shape[0], 2, len(block_ids), *source.shape[3:])
        view = out[: source.element_size() * math.prod(shape)].view(source.dtype).view(shape)
        if out.device == self.kv.device:
            return torch.index_select(source, 2, index, out=view)
        return self._stage_to_host(source.index_select(2, index), view)

    def _stage_to_host(self, gathered: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        """Copies gathered device KV into a host buffer (pinned, for the `ray` and `grpc`
        transports) on a stream of its own, so the copy does not queue behind, or hold up, the
        engine's kernels; returns once the bytes are on the host."""
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.kv.device)
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(self.kv.device))  # the gather is queued there
        with torch.cuda.stream(stream):
            host.copy_(gathered, non_blocking=True)
            gathered.record_stream(stream)
        stream.synchronize()
        return host

    def import_blocks(
        self, block_ids: Sequence[int], data: torch.Tensor, layers: slice = slice(None)
    ) -> None:
        """Write exported blocks (same shape as `export_blocks` gives) into these block ids."""
        index = torch.as_tensor(block_ids, dtype=torch.long, device=self.kv.device)
        target = self.kv[layers]
        expected = (target.shape[0], 2, len(block_ids), *target.shape[3:])
        if tuple(data.shape) != expected or data.dtype != self.kv.dtype:
            raise ValueError(
                f"KV data {tuple(data.shape)} {data.dtype} does not fit {expected} {self.kv.dtype}"
            )
        target.index_copy_(2, index, data.to(self.kv.device))
