"""What this process may run on this CPU beyond what the CPU reports: AMX tiles need the OS's
support and Linux's per-process permission as well (`amx_unavailable_reason`). The prefill
attention and bf16 linear kernels choose by it (engine/prefill_attention.py, engine/cpu_packing.py),
and so does the kernel chain (engine/kernels.py)."""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger(__name__)

# Linux (x86_64) grants a process AMX's tile data only on request: arch_prctl(ARCH_REQ_XCOMP_PERM,
# XFEATURE_XTILEDATA), a syscall glibc has no wrapper for
_SYS_ARCH_PRCTL = 158
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def cpuinfo_flags_line() -> str:
    """/proc/cpuinfo's `flags` line (the machine's name where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.machine()


def _cpuinfo_flags() -> frozenset[str]:
    line = cpuinfo_flags_line()
    return frozenset(line.partition(":")[2].split()) if line.startswith("flags") else frozenset()


def _request_tile_permission() -> int:
    """Asks Linux for AMX's tile data state for this process: 0 (granted, now or before) or the
    errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    args = (_SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    if libc.syscall(*(ctypes.c_long(arg) for arg in args)) == 0:
        return 0
    return ctypes.get_errno()


@lru_cache(maxsize=1)
def amx_unavailable_reason() -> Optional[str]:
    """Why this process cannot use AMX tiles, or None: it can, and Linux has granted it their state.

    Torch's check reads only CPUID, so a VM or a kernel before 5.16 that leaves the tile state out
    of XCR0 passes it; Linux lists `amx_tile` in /proc/cpuinfo only where XCR0 has that state, and a
    process must still ask for it. Where the CPU has tiles that this process cannot use, one warning
    says why (once: the answer is kept)."""
    if not torch.cpu._is_amx_tile_supported():
        return "the CPU has no AMX tiles (torch)"
    if sys.platform != "linux" or platform.machine() != "x86_64":
        reason = f"AMX is used only on x86_64 Linux, not {sys.platform} {platform.machine()}"
    elif "amx_tile" not in _cpuinfo_flags():
        reason = "/proc/cpuinfo lists no amx_tile: the OS has not enabled the tile state (XCR0)"
    elif errno := _request_tile_permission():
        reason = (
            f"Linux refused the tile state: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) "
            f"failed with errno {errno} ({os.strerror(errno)})"
        )
    else:
        return None
    log.warning("the CPU has AMX tiles, but this process cannot use them: %s", reason)
    return reason
