"""Decode attention that reads the paged KV cache in place: a small C kernel on CPU (built on first
use), a Triton kernel on CUDA (engine/triton_paged_attention.py); `decode_kernel_for` picks one.

The torch path gathers every sequence's blocks into a padded copy and runs SDPA over it with a
mask; on CPU that copy and SDPA's per-call setup are two thirds of a batched decode step. The kernel
walks each sequence's block table instead and reads every K and V row once (engine/csrc).

It is compiled with the system C compiler into the disk cache (engine/disk_cache.py) the first time
a process needs it (about a second), keyed by the source, the flags, the compiler and the CPU's
features, and loaded with ctypes. Without a compiler, or with `PDSERVE_DISABLE_KERNELS=1`, the
engine uses the torch path: the same results to float rounding, only slower. The same switch, or a
missing Triton, sends CUDA to the torch path too.
"""

from __future__ import annotations

import ctypes
import logging
import os
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch

from engine import kernels
from engine.kernel_build import (  # noqa: F401 (built through here by tests and benchmarks)
    CFLAGS,
    OPENMP_FLAGS,
    KernelBuildError,
    build,
)
from engine.kernels import DISABLE_ENV, KernelFailed, open_library

log = logging.getLogger(__name__)

SOURCE = kernels.candidate("decode_attention", "native").source
MAX_HEAD_DIM = 256  # as in the C source
# The suffix of a C kernel's function for each dtype it serves (e.g. `silu_mul_bf16`)
DTYPE_SUFFIXES = {torch.bfloat16: "bf16", torch.float32: "f32"}
_FUNCTIONS = {
    torch.bfloat16: "paged_decode_attention_bf16",
    torch.float32: "paged_decode_attention_f32",
}
_ARGTYPES = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int64]


class PagedDecodeAttention:
    """`__call__` computes one decode step's attention for a batch, reading K/V blocks in place."""

    def __init__(self, library_path: Path):
        lib = open_library(library_path)
        self._functions = {}
        for dtype, name in _FUNCTIONS.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
            self._functions[dtype] = fn

    def supports(self, cache: torch.Tensor) -> bool:
        """Whether this cache (`[blocks, block_size, kv_heads, head_dim]`) is one the kernel
        handles."""
        return (
            cache.device.type == "cpu"
            and cache.dtype in self._functions
            and cache.is_contiguous()
            and cache.shape[-1] <= MAX_HEAD_DIM
        )

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """q `[batch, heads, head_dim]`; caches `[blocks, block_size, kv_heads, head_dim]`; returns
        q's shape and dtype."""
        batch, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        q32 = q.float().contiguous()
        out = torch.empty_like(q32)
        tables = block_tables.contiguous()
        lens = context_lens.contiguous()
        fn = self._functions[k_cache.dtype]
        pointers = [
            ctypes.c_void_p(t.data_ptr()) for t in (q32, k_cache, v_cache, tables, lens, out)
        ]
        shape = (batch, num_heads, num_kv_heads, head_dim, block_size, tables.shape[1])
        if kernels.is_disabled("decode_attention"):
            raise KernelFailed("decode_attention")
        code = fn(*pointers, *shape, scale, torch.get_num_threads())
        if code:
            kernels.disable("decode_attention", f"code {code}")
            raise KernelFailed(f"paged attention kernel failed (code {code})")
        return out.to(q.dtype)


@lru_cache(maxsize=1)
def load_kernel() -> Optional[PagedDecodeAttention]:
    """The kernel for this process (engine/kernels.py's chain: the AVX-512 path, the AVX2 path,
    plain loops), or None (torch path) where none is usable."""
    return kernels.select("decode_attention", lambda library, _: PagedDecodeAttention(library))


@lru_cache(maxsize=1)
def load_triton_kernel():
    """The Triton kernel (CUDA), or None (torch path) when disabled or Triton is not installed."""
    if os.environ.get(DISABLE_ENV) == "1":
        return None
    try:
        from engine.triton_paged_attention import TritonPagedDecodeAttention
    except ImportError as exc:
        log.warning(
            "Triton paged decode-attention kernel unavailable, using the torch path: %s", exc
        )
        return None
    return TritonPagedDecodeAttention()


def decode_kernel_for(device: str | torch.device):
    """The paged decode kernel for a device: the C kernel on CPU, the Triton kernel on CUDA; None
    (gather + SDPA) where neither applies or can be had."""
    kind = torch.device(device).type
    if kind == "cpu":
        return load_kernel()
    if kind == "cuda":
        return load_triton_kernel()
    return None
