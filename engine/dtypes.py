"""Dtype and device policy: the names users give (`--dtype`, `--device`), what "auto" resolves to
where an engine runs, and why, for the ready line.

`--dtype auto` is bf16 on CUDA and on CPUs with native bf16 (AVX512-BF16 or AMX), fp32 elsewhere,
where torch emulates bf16 (a 542-token prefill there takes ~7x as long in bf16 as in fp32,
docs/benchmarks.md). `$PDSERVE_AUTO_DTYPE` (float32 or bfloat16) overrides the CPU's choice, so the
bf16 default is testable on any CPU; workers started while it is set in the router's environment get
it too (pdserve/workers.py).

Torch is imported only inside the functions that answer with torch objects: the config
(engine/config.py), the router and the CLI read these names without loading torch.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # torch's names for them
DEVICES = ("auto", "cpu", "cuda")
AUTO_DTYPE_ENV = "PDSERVE_AUTO_DTYPE"


def parse_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """A dtype by name; "auto" is the one that is fast where it runs (`auto_dtype`)."""
    if name == "auto":
        return auto_dtype(device)
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(DTYPE_NAMES)}")
    import torch

    return getattr(torch, name)


def resolve_device(name: str | torch.device) -> str:
    """A device by name: "auto" is cuda where torch sees a GPU, else cpu; "cuda" (or "cuda:N") where
    torch sees none is a ValueError that says why."""
    import torch

    name = str(name)
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = name.split(":", 1)[0]
    if kind not in DEVICES[1:]:
        raise ValueError(f"unknown device {name!r}; choose one of {', '.join(DEVICES)}")
    if kind == "cuda" and not torch.cuda.is_available():
        why = (
            f"this torch ({torch.__version__}) is built without CUDA"
            if torch.version.cuda is None
            else "no GPU is visible (driver, CUDA_VISIBLE_DEVICES)"
        )
        raise ValueError(
            f"device {name!r} asked for, but torch sees no CUDA device: {why}; use --device cpu "
            "or auto"
        )
    return name


def auto_dtype(device: str = "cpu") -> torch.dtype:
    """What "auto" resolves to on `device` (the rule is in the module's docstring)."""
    return _auto_dtype_and_reason(device)[0]


def dtype_reason(name: str, device: str = "cpu") -> str:
    """Why `name` resolves as it does on this device, for the ready line: "asked", or what "auto"
    saw."""
    return "asked" if name != "auto" else "auto: " + _auto_dtype_and_reason(device)[1]


def _auto_dtype_and_reason(device: str) -> tuple[torch.dtype, str]:
    import torch

    if device == "auto":
        device = resolve_device(device)
    if str(device).startswith("cuda"):
        return torch.bfloat16, "CUDA"
    forced = os.environ.get(AUTO_DTYPE_ENV)
    if forced:
        if forced not in ("float32", "bfloat16"):
            raise ValueError(f"${AUTO_DTYPE_ENV} must be float32 or bfloat16, got {forced!r}")
        return getattr(torch, forced), f"${AUTO_DTYPE_ENV}={forced}"
    isa = torch.backends.cpu.get_cpu_capability()
    native = [
        name
        for name, has in (
            ("AVX512_BF16", torch.cpu._is_avx512_bf16_supported()),
            ("AMX", torch.cpu._is_amx_tile_supported()),
        )
        if has
    ]
    if native:
        return torch.bfloat16, f"CPU {isa} with native bf16 ({'+'.join(native)})"
    return torch.float32, f"CPU {isa} without native bf16"
