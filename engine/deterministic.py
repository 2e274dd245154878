"""`--deterministic` (`EngineConfig.deterministic`): kernels whose result for a row does not depend
on the batch it shares, nor on whether its token is computed in a prefill or a decode step.

Greedy output is then token-identical however requests are batched: a stream migrated to another
worker (re-prefilled as prompt + tokens sent), a lone rerun, a prompt prefilled on its decode
worker or on a prefill worker, in chunks or whole. What it takes, on a CPU:
- linears: a C kernel for every batch, each output one chain of multiply-adds in k order
  (engine/csrc/decode_linear_bf16.c on AVX512-BF16 cores, also where AMX would hand prefill
  chunks to oneDNN; engine/csrc/decode_linear.c for fp32 on any x86 core with AVX2 and FMA, also
  where MKL would serve);
- attention: the paged decode kernel (engine/csrc/paged_attention.c) for prefill too, each prompt
  row one "sequence" over the cache up to itself (`Attention._prefill_by_decode_kernel`): the
  flash, SDPA and blocked-matmul paths reduce in other orders. The kernel threads over sequences,
  each computed whole by one thread;
- RMSNorm, SiLU, RoPE and the residual adds: the fused C kernels (engine/csrc/elementwise.c), one
  row per thread; torch's reductions may split a row over threads.
Where one is missing `require` raises `DeterminismUnavailable` naming it, so a worker fails at start
instead of serving batch-dependent tokens. CUDA is not covered (its decode kernel splits a context
into partitions by batch size).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch

from engine import kernels
from engine.cpu_packing import (
    DecodeLinear,
    bf16_decode_linear_supported,
    load_bf16_decode_linear,
    load_decode_linear,
)
from engine.fused_ops import load_fused_ops
from engine.kernels import DISABLE_ENV
from engine.paged_attention import load_kernel


class DeterminismUnavailable(RuntimeError):
    """`--deterministic` asked where a batch-invariant kernel it needs cannot run; the message
    names what is missing."""


def require(dtype: torch.dtype, device: torch.device | str) -> DecodeLinear:
    """The linear kernel that serves every batch of `dtype` on `device`, after checking that the
    attention and elementwise kernels are there too; raises `DeterminismUnavailable`."""
    if torch.device(device).type != "cpu":
        raise DeterminismUnavailable(
            f"--deterministic runs on CPU only, not {device} (the CUDA decode kernel splits a "
            "context into partitions by batch size)"
        )
    capability = torch.backends.cpu.get_cpu_capability()
    if dtype == torch.bfloat16:
        if not torch.cpu._is_avx512_bf16_supported():
            raise DeterminismUnavailable(
                "--deterministic in bfloat16 needs a CPU with AVX512_BF16 (its batch-invariant "
                f"linear kernel); this one has {capability} without it: use --dtype float32"
            )
        linear = load_bf16_decode_linear() if bf16_decode_linear_supported() else None
    elif dtype == torch.float32:
        if capability not in ("AVX2", "AVX512"):
            raise DeterminismUnavailable(
                "--deterministic in float32 needs an x86 CPU with AVX2 and FMA (its "
                f"batch-invariant linear kernel); this one has {capability}"
            )
        linear = load_decode_linear() or _f32_linear_any_avx2()
    else:
        raise DeterminismUnavailable(f"--deterministic serves bfloat16 and float32, not {dtype}")
    missing = [
        name
        for name, kernel in (
            ("the linear kernel", linear),
            ("the paged attention kernel", load_kernel()),
            ("the fused elementwise kernels", load_fused_ops()),
        )
        if kernel is None
    ]
    if missing:
        raise DeterminismUnavailable(
            f"--deterministic needs {', '.join(missing)}, unavailable here (a C compiler is "
            f"needed, and {DISABLE_ENV} unset; the log above says why)"
        )
    return linear


@lru_cache(maxsize=1)
def _f32_linear_any_avx2() -> Optional[DecodeLinear]:
    """engine/csrc/decode_linear.c (self-checked: engine/kernels.py) also on a core whose best ISA
    is above AVX2, where the default path leaves fp32 linears to MKL; None where it cannot run."""
    return kernels.select("linear_f32", lambda library, _: DecodeLinear(library))
