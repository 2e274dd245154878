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
import hashlib
import logging
import os
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch

from engine.disk_cache import cache_root, write_atomically

log = logging.getLogger(__name__)

DISABLE_ENV = "PDSERVE_DISABLE_KERNELS"
SOURCE = Path(__file__).parent / "csrc" / "paged_attention.c"
# Reassociation lets the compiler vectorize the dot products and sums (3x here); unlike -ffast-math
# it keeps infinities and NaNs meaningful.
CFLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=fast",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-shared",
    "-fPIC",
)
# OpenMP threads a batch over torch's own OpenMP runtime; a compiler without OpenMP still gets the
# `omp simd` vectorization, single-threaded.
OPENMP_FLAGS = (("-fopenmp",), ("-fopenmp-simd",))
MAX_HEAD_DIM = 256  # as in the C source
# The suffix of a C kernel's function for each dtype it serves (e.g. `silu_mul_bf16`)
DTYPE_SUFFIXES = {torch.bfloat16: "bf16", torch.float32: "f32"}
_FUNCTIONS = {
    torch.bfloat16: "paged_decode_attention_bf16",
    torch.float32: "paged_decode_attention_f32",
}
_ARGTYPES = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int64]


class KernelBuildError(RuntimeError):
    pass


def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def build(
    compiler: Optional[str] = None, source: Path = SOURCE, extra_flags: tuple[str, ...] = ()
) -> Path:
    """Compiles `source` (a C file of engine/csrc, with CFLAGS and `extra_flags`) unless a build of
    it for this compiler and CPU is cached; returns the .so."""
    compiler = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise KernelBuildError("no C compiler found (set CC)")
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"{compiler} --version failed: {exc}") from exc
    flags = (*CFLAGS, *extra_flags)
    # what it may include
    headers = [header.read_text() for header in sorted(source.parent.glob("*.h"))]
    key = hashlib.sha256(
        "\0".join(
            [
                source.read_text(),
                *headers,
                " ".join(flags),
                str(OPENMP_FLAGS),
                version,
                _cpu_features(),
            ]
        ).encode()
    ).hexdigest()[:16]
    target = cache_root() / "kernels" / f"{source.stem}-{key}.so"
    if target.exists():
        return target

    def compile_to(path: str) -> None:
        for openmp in OPENMP_FLAGS:
            result = subprocess.run(
                [compiler, *flags, *openmp, "-o", path, str(source), "-lm"],
                capture_output=True,
                text=True,
                timeout=120,
            )
            if result.returncode == 0:
                return
        raise KernelBuildError(
            f"{compiler} failed ({result.returncode}): {result.stderr.strip()[-2000:]}"
        )

    write_atomically(target, compile_to)
    return target


class PagedDecodeAttention:
    """`__call__` computes one decode step's attention for a batch, reading K/V blocks in place."""

    def __init__(self, library_path: Path):
        lib = ctypes.CDLL(str(library_path))
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
        code = fn(*pointers, *shape, scale, torch.get_num_threads())
        if code:
            raise RuntimeError(f"paged attention kernel failed (code {code})")
        return out.to(q.dtype)


@lru_cache(maxsize=1)
def load_kernel() -> Optional[PagedDecodeAttention]:
    """The kernel for this process, or None (torch path) when disabled or it cannot be built."""
    if os.environ.get(DISABLE_ENV) == "1":
        return None
    try:
        return PagedDecodeAttention(build())
    except (KernelBuildError, OSError) as exc:
        log.warning("paged decode-attention kernel unavailable, using the torch path: %s", exc)
        return None


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
