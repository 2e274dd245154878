"""Causal bf16 prefill attention on CPUs with AMX tiles or AVX512-BF16: a flash-attention C kernel
for head_dim 64, one of two that share their packing, softmax and driver
(engine/csrc/prefill_attention.h):

- with AMX (Intel Xeon, Sapphire Rapids on): engine/csrc/prefill_attention_amx.c, 2-6x as fast as
  SDPA's CPU flash kernel;
- with AVX512-BF16 and no AMX (AMD EPYC Zen 4 on): engine/csrc/prefill_attention_avx512.c, by
  vdpbf16ps, against the blocked matmuls that path ran before (engine/model.py, above
  `_PREFILL_BLOCK`, has the figures for both).

Built and loaded like the paged decode-attention kernel (engine/paged_attention.py), with its ISA's
flags for its own translation unit only, and the same switch (`PDSERVE_DISABLE_KERNELS=1`).
The AMX kernel runs only where the OS lets this process use the tiles (`amx_unavailable_reason`:
the CPU's flag, the OS's tile state, Linux's per-process permission); elsewhere the AVX512-BF16
kernel does, on any CPU that has it.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch

from engine import kernels
from engine.cpu_features import amx_unavailable_reason
from engine.kernels import KernelFailed, open_library
from engine.paged_attention import DISABLE_ENV, KernelBuildError, build  # noqa: F401

log = logging.getLogger(__name__)

HEAD_DIM = 64  # as in the C sources
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P] * 4 + [_I] * 8 + [ctypes.c_float, _I]


@dataclass(frozen=True)
class KernelKind:
    name: str  # as logs and benchmarks name it: the kernel chain's variant (engine/kernels.py)
    source: Path
    extra_flags: tuple[str, ...]
    function: str

    @classmethod
    def of(cls, variant: str, function: str) -> "KernelKind":
        """The chain's candidate of that name (its source and flags), calling `function`."""
        built = kernels.candidate("prefill_attention", variant)
        return cls(variant, built.source, built.extra_flags, function)


AMX = KernelKind.of("amx", "amx_prefill_attention_bf16")
AVX512_BF16 = KernelKind.of("avx512-bf16", "avx512_prefill_attention_bf16")
KINDS = {kind.name: kind for kind in (AMX, AVX512_BF16)}  # by the chain's variant name


def kernel_kind() -> Optional[KernelKind]:
    """The kernel this process can run (None: neither): AMX where `amx_unavailable_reason` allows,
    else AVX512-BF16 where the CPU has it (torch's check)."""
    if amx_unavailable_reason() is None:
        return AMX
    if torch.cpu._is_avx512_bf16_supported():
        return AVX512_BF16
    return None


class PrefillAttention:
    def __init__(self, kind: KernelKind, library_path: Path):
        self.kind = kind
        # the tiles fault without the process's tile state: asked for here, in whatever process
        # loads the kernel
        if kind.source == AMX.source and (reason := amx_unavailable_reason()) is not None:
            raise OSError(f"the AMX kernel cannot run in this process: {reason}")
        lib = open_library(library_path)
        self._fn = getattr(lib, kind.function)
        self._fn.argtypes, self._fn.restype = _ARGTYPES, ctypes.c_int

    @staticmethod
    def supports(q: torch.Tensor) -> bool:
        return q.dtype == torch.bfloat16 and q.device.type == "cpu" and q.shape[-1] == HEAD_DIM

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q [n, heads, head_dim] after k/v's first `len(k) - n` (context) rows; k, v
        [context + n, kv_heads, head_dim]. Returns [n, heads * head_dim]: causal among the new
        tokens, all of the context visible."""
        n, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        # rows may lie apart (views of the fused qkv projection); heads and dims must be packed
        q, k, v = (
            t if t.stride(2) == 1 and t.stride(1) == head_dim else t.contiguous() for t in (q, k, v)
        )
        out = torch.empty(n, num_heads * head_dim, dtype=q.dtype)
        if kernels.is_disabled("prefill_attention"):
            raise KernelFailed("prefill_attention")
        code = self._fn(
            *(ctypes.c_void_p(t.data_ptr()) for t in (q, k, v, out)),
            q.stride(0),
            k.stride(0),
            v.stride(0),
            n,
            k.shape[0] - n,
            num_heads,
            num_kv_heads,
            head_dim,
            scale,
            torch.get_num_threads(),
        )
        if code:
            kernels.disable("prefill_attention", f"code {code}")
            raise KernelFailed(f"{self.kind.name} prefill attention kernel failed (code {code})")
        return out


@lru_cache(maxsize=1)
def load_prefill_kernel() -> Optional[PrefillAttention]:
    """The kernel for this process (engine/kernels.py's chain: AMX, then AVX512-BF16), or None
    (the torch path)."""
    return kernels.select(
        "prefill_attention", lambda library, variant: PrefillAttention(KINDS[variant], library)
    )
