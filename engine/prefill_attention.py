"""Causal bf16 prefill attention on CPUs with AMX tiles: a flash-attention C kernel
(engine/csrc/prefill_attention_amx.c) for head_dim 64, 2-6x as fast as SDPA's CPU flash kernel
(engine/model.py, above `_PREFILL_BLOCK`, has the figures).

Built and loaded like the paged decode-attention kernel (engine/paged_attention.py), with the AMX
flags for its own translation unit only, and the same switch (`PDSERVE_DISABLE_KERNELS=1`).
`load_amx_prefill` answers None, and the model keeps its torch path, where the CPU lacks AMX
(torch's own check), the compiler cannot build it, or Linux refuses the process the AMX state.
"""

from __future__ import annotations

import ctypes
import logging
import os
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch

from engine.paged_attention import DISABLE_ENV, KernelBuildError, build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "prefill_attention_amx.c"
EXTRA_FLAGS = ("-mamx-tile", "-mamx-bf16", "-mavx512f", "-mavx512bf16")
HEAD_DIM = 64  # as in the C source
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P] * 4 + [_I] * 8 + [ctypes.c_float, _I]


class AmxPrefillAttention:
    def __init__(self, library_path: Path):
        lib = ctypes.CDLL(str(library_path))
        init = lib.amx_prefill_init
        init.argtypes, init.restype = [], ctypes.c_int
        if init() != 0:
            raise OSError("Linux refused this process the AMX tile state (arch_prctl)")
        self._fn = lib.amx_prefill_attention_bf16
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
            raise RuntimeError(f"AMX prefill attention kernel failed (code {code})")
        return out


@lru_cache(maxsize=1)
def load_amx_prefill() -> Optional[AmxPrefillAttention]:
    """The kernel for this process, or None (torch path)."""
    if os.environ.get(DISABLE_ENV) == "1" or not torch.cpu._is_amx_tile_supported():
        return None
    try:
        return AmxPrefillAttention(build(source=SOURCE, extra_flags=EXTRA_FLAGS))
    except (KernelBuildError, OSError, AttributeError) as exc:
        log.warning("AMX prefill attention kernel unavailable, using the torch path: %s", exc)
        return None
