"""The service-level objective a system serves to (`pdserve serve --slo ttft:MS,tpot:MS`), and
whether a finished request met it.

Counted as vLLM's benchmark client counts goodput (`vllm bench serve --goodput ttft:1000 tpot:50`):
only requests that completed count, each against every target, a value equal to its target meeting
it; TPOT is measured over the tokens after the first, so a one-token request is judged by its TTFT
alone. Goodput is the rate of completed requests that met both targets. Torch-free: the router
imports it.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Optional

# FAST_SLO where the workers serve bf16 (CUDA, CPUs with native bf16), else FP32_CPU_SLO
DEFAULT_SLO = "auto"
FAST_SLO = "ttft:1000,tpot:50"  # milliseconds: the interactive targets commonly quoted
# fp32 on a CPU without native bf16: twice what vLLM-CPU takes idle on such a machine, as issue #29
# scales the SLO (AVX2-only AMD EPYC, 2026-12-03: a 512-token prompt's TTFT 1.96 s, TPOT 51 ms;
# docs/benchmarks.md). Prefill is ~4x slower than in bf16 there, decode (memory-bound) ~1.2x.
FP32_CPU_SLO = "ttft:4000,tpot:100"
_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# Finish reasons of requests that completed (vLLM's client: the request succeeded); a request
# aborted by its client or a worker, or ended by an error, never reached a complete answer and is
# not counted.
COUNTED_FINISH_REASONS = ("stop", "length")
RESULTS = ("met", "ttft_missed", "tpot_missed", "both_missed")  # a counted request's outcome
_KEYS = ("ttft", "tpot")


@dataclass(frozen=True)
class SLO:
    ttft_s: float  # time to first token, request received to first token sent
    tpot_s: float  # mean time per output token after the first

    def __post_init__(self) -> None:
        for name, value in (("ttft", self.ttft_s), ("tpot", self.tpot_s)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(
                    f"SLO {name} must be a positive number of milliseconds, got {value * 1e3:g} ms"
                )

    @classmethod
    def resolve(cls, text: str, dtype: str = "auto", device: str = "auto") -> "SLO":
        """`text` parsed, "auto" first resolved for the dtype and device the workers are told
        (`auto_slo`)."""
        return cls.parse(auto_slo(dtype, device) if text == "auto" else text)

    @classmethod
    def parse(cls, text: str) -> "SLO":
        """`ttft:MS,tpot:MS` (comma or space between the two; milliseconds, as vLLM's `--goodput`
        takes them). ValueError naming the part that is wrong."""
        ms: dict[str, float] = {}
        for part in (p for p in re.split(r"[,\s]+", text.strip()) if p):
            key, sep, value = part.partition(":")
            key = key.strip().lower()
            if not sep or key not in _KEYS:
                raise ValueError(
                    f"SLO part {part!r}: expected ttft:MS or tpot:MS (e.g. {DEFAULT_SLO})"
                )
            if key in ms:
                raise ValueError(f"SLO part {part!r}: {key} given twice")
            try:
                number = float(value)
            except ValueError:
                raise ValueError(
                    f"SLO part {part!r}: {value!r} is not a number of milliseconds"
                ) from None
            if not (math.isfinite(number) and number > 0):
                raise ValueError(
                    f"SLO part {part!r}: {key} must be a positive number of milliseconds"
                )
            ms[key] = number
        missing = [key for key in _KEYS if key not in ms]
        if missing:
            raise ValueError(
                f"SLO {text!r} lacks {' and '.join(missing)} (format ttft:MS,tpot:MS, e.g. "
                f"{DEFAULT_SLO})"
            )
        return cls(ttft_s=ms["ttft"] / 1e3, tpot_s=ms["tpot"] / 1e3)

    def __str__(self) -> str:
        return f"ttft:{self.ttft_s * 1e3:.12g},tpot:{self.tpot_s * 1e3:.12g}"

    def result(self, ttft_s: float, tpot_s: Optional[float]) -> str:
        """One of RESULTS for a completed request; `tpot_s` None or 0 (one token: no TPOT) meets its
        target."""
        ttft_met = ttft_s <= self.ttft_s
        tpot_met = not tpot_s or tpot_s <= self.tpot_s
        return RESULTS[(not ttft_met) + 2 * (not tpot_met)]

    def met(self, ttft_s: float, tpot_s: Optional[float]) -> bool:
        """Both targets met (see `result`)."""
        return self.result(ttft_s, tpot_s) == "met"


def auto_slo(dtype: str, device: str, cpu_flags: Optional[set[str]] = None) -> str:
    """The default SLO for a system serving `dtype` on `device` (their flags' values): FAST_SLO for
    bf16 or CUDA, FP32_CPU_SLO for fp32 on a CPU. dtype "auto" is decided as the workers decide it
    (engine.dtypes.auto_dtype), from this machine's CPU flags (`/proc/cpuinfo`) and
    $PDSERVE_AUTO_DTYPE: on a cluster, the head node's CPU stands for the workers'."""
    import os

    from engine.dtypes import AUTO_DTYPE_ENV  # torch-free

    if device == "cuda" or dtype == "bfloat16":
        return FAST_SLO
    if dtype == "auto":
        forced = os.environ.get(AUTO_DTYPE_ENV)
        if forced:
            return FAST_SLO if forced == "bfloat16" else FP32_CPU_SLO
        flags = _cpu_flags() if cpu_flags is None else cpu_flags
        if any(flag in flags for flag in _NATIVE_BF16_FLAGS):
            return FAST_SLO
    return FP32_CPU_SLO


@functools.cache
# read once per process: ServeConfig.slo_target resolves it often
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()
