"""The elementwise parts of a bf16 or fp32 layer on CPU as fused C kernels
(engine/csrc/elementwise.c): RMSNorm with the residual add before it, SiLU(gate) * up, and the
rotary embedding of q and k. torch's bf16 CPU kernels for these take 2.1 ms of every layer of a
512-token prompt on one core, its fp32 ones ~2.5 ms (5 % of the prefill on an AVX2 core; the fused
ones save 2-4 % of a fp32 prefill or decode step there: docs/benchmarks-archive.md).

Built and loaded like the paged decode-attention kernel (engine/paged_attention.py), with the same
switch (`PDSERVE_DISABLE_KERNELS=1`) and the same fallback: where it is unavailable, or for any
other dtype or device, `fused_ops_for` answers None and the model runs torch's ops. A bf16 result is
rounded to bf16 once, where torch rounds after every op: the two agree to bf16 rounding, not bit for
bit; fp32 ones to fp32 rounding (another order of the RMSNorm's sum, SiLU's exp within about 1 ulp,
multiply-adds fused by the compiler).
"""

from __future__ import annotations

import ctypes
import logging
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from engine import kernels
from engine.kernels import open_library
from engine.paged_attention import DTYPE_SUFFIXES

log = logging.getLogger(__name__)

SOURCE = kernels.candidate("fused_ops", "kernel").source
EXTRA_FLAGS = kernels.candidate("fused_ops", "kernel").extra_flags  # finite math: engine/kernels.py
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "add_rms_norm": [_P, _P, _P, _P, _I, _I, _F, _I],
    "add": [_P, _P, _I, _I],
    "silu_mul": [_P, _P, _I, _I, _I],
    "rope": [_P, _I, _P, _P, _P, _I, _I, _I, _I],
}


def _ptr(t: Optional[torch.Tensor]) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() if t is not None else None)


class FusedOps:
    op = "fused_ops"  # engine/kernels.py's name

    def __init__(self, library_path: Path):
        lib = open_library(library_path)
        self._kernels = {}
        for name, argtypes in _SIGNATURES.items():
            for dtype, suffix in DTYPE_SUFFIXES.items():
                fn = getattr(lib, f"{name}_{suffix}")
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
                self._kernels[name, dtype] = fn

    def _run(self, name: str, dtype: torch.dtype, *args) -> bool:
        """Calls kernel `name` for `dtype`: True where it ran. A nonzero code (the C side's -1: a
        shape it does not take, nothing written) turns the fused ops off in this process: False,
        and the caller computes the op with torch (as from then on every call does)."""
        if kernels.is_disabled(self.op):
            return False
        code = self._kernels[name, dtype](*args)
        if code:
            kernel = f"{name}_{DTYPE_SUFFIXES[dtype]}"
            kernels.disable(self.op, f"fused {kernel} kernel failed (code {code})")
            return False
        return True

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """RMSNorm of x's rows times `weight`; with `residual`, x += residual first, in place."""
        out = torch.empty_like(x)
        ran = self._run(
            "add_rms_norm",
            x.dtype,
            _ptr(x),
            _ptr(residual),
            _ptr(weight),
            _ptr(out),
            x.shape[0],
            x.shape[1],
            eps,
            torch.get_num_threads(),
        )
        if ran:
            return out
        if residual is not None:
            x.add_(residual)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def add_(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not self._run("add", x.dtype, _ptr(x), _ptr(y), x.numel(), torch.get_num_threads()):
            x.add_(y)
        return x

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU of the first half of each row times its second half."""
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, inter, dtype=gate_up.dtype)
        args = (_ptr(gate_up), _ptr(out), rows, inter, torch.get_num_threads())
        if self._run("silu_mul", gate_up.dtype, *args):
            return out
        gate, up = gate_up.split(inter, dim=-1)
        return F.silu(gate) * up

    def rope(
        self,
        rows: torch.Tensor,
        heads: int,
        head_dim: int,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
    ) -> torch.Tensor:
        """The rotary embedding of the first `heads` heads of each row (`rows` [tokens, >= heads *
        head_dim], its last dim contiguous); cos and signed_sin [tokens, 1, head_dim]
        (RotaryEmbedding.cos_sin). Returns a contiguous [tokens, heads, head_dim]."""
        tokens = rows.shape[0]
        out = torch.empty(tokens, heads, head_dim, dtype=rows.dtype)
        # held here: a copy made inside the call's arguments would be freed before the kernel runs
        cos, signed_sin = cos.contiguous(), signed_sin.contiguous()
        ran = self._run(
            "rope",
            rows.dtype,
            _ptr(rows),
            rows.stride(0),
            _ptr(cos),
            _ptr(signed_sin),
            _ptr(out),
            tokens,
            heads,
            head_dim,
            torch.get_num_threads(),
        )
        if ran:
            return out
        x = rows[:, : heads * head_dim].view(tokens, heads, head_dim)
        half = head_dim // 2
        return x * cos + torch.cat([x[..., half:], x[..., :half]], -1) * signed_sin


def fused_ops_for(x: torch.Tensor) -> Optional[FusedOps]:
    """The fused kernels for a contiguous bf16 or fp32 CPU activation, else None (torch's ops)."""
    if x.dtype not in DTYPE_SUFFIXES or x.device.type != "cpu" or kernels.is_disabled("fused_ops"):
        return None
    return load_fused_ops()


@lru_cache(maxsize=1)
def load_fused_ops() -> Optional[FusedOps]:
    """The kernels for this process (engine/kernels.py), or None (torch's ops)."""
    return kernels.select("fused_ops", lambda library, _: FusedOps(library))
