"""Linear layers laid out once at load time for the CPU's matmul kernels.

- bf16 where oneDNN multiplies (no AVX512_BF16 kernel; with AMX, prefill chunks): pre-packed for
  oneDNN (its blocked weight layout). `F.linear` re-lays out a bf16 weight for
  oneDNN on every call; packing once makes the small-batch matmuls of decode about 2x faster here
  (lm_head at batch 1: 3.2 -> 1.8 ms) and is bit-identical to `F.linear` in bf16.
- fp32: the weight transposed (`[in, out]`, contiguous) and multiplied as `x @ weight_t`. For 3-15
  rows (decode steps) MKL takes a kernel for that layout that reads a model's weights 1.4-1.7x as
  fast as `F.linear`'s on an AVX-512 core (docs/benchmarks-archive.md); from 16 rows on (prefill)
  both layouts run the same kernel, bit-identical. Below 16 rows the sums' order differs from
  `F.linear`'s in the last bits, which greedy decoding does not see (the HF comparisons in tests/
  hold).
- bf16 on AVX512-BF16 cores: engine/csrc/decode_linear_bf16.c (`vdpbf16ps`) on the weight laid
  out in panels of 16 outputs (`bf16_decode_panels`). On one thread of an AMD EPYC AVX512-BF16 core
  a model's linears take 10.5 against oneDNN's 20.4 ms at 1 row, 16.8 against 23.2 at 8, 45.5
  against 52.1 at 32 and 486 against 515 at 512 (a prefill chunk), so where the core has no AMX
  tiles the kernel serves every batch and no oneDNN copy is kept (`benchmarks/
  decode_linear_bench.py --dtype bfloat16`, docs/benchmarks-archive.md). Where AMX is (not
  measured), oneDNN's packed weight serves batches from `AMX_KERNEL_MAX_ROWS` rows, prefill chunks
  among them, and the kernel the decode batches under it. Either way the kernel's rows are
  batch-invariant.
- fp32 on an AVX2-only core (no AVX-512): MKL's and oneDNN's kernels for 2-16 rows ran at a third to
  two thirds of the core's memory speed there. Decode batches of 1 to `DECODE_KERNEL_MAX_ROWS` - 1
  rows run engine/csrc/decode_linear.c on a second copy of each weight laid out in panels of 16
  outputs (`decode_panels`): a model's linears at 4 rows take 37 against 47 ms (oneDNN) and 78 ms
  (MKL) on one thread, at 1 row they read at memory speed as MKL's gemv does
  (`benchmarks/decode_linear_bench.py`, docs/benchmarks-archive.md).
  Each output is one chain of fused multiply-adds in k order whatever the batch, so a row's result
  does not depend on the rows beside it. Prefill chunks of 64 rows or more keep MKL on the
  transposed weight, bit-identical to `F.linear`. The panels are plain tensors: the disk cache keeps
  them with the transposed weights, and workers map both. Built and loaded like the paged
  decode-attention kernel (engine/paged_attention.py; `PDSERVE_DISABLE_KERNELS=1` turns it off);
  where it is unavailable MKL serves every batch and no panels are made.

`PDSERVE_DISABLE_PACKING=1` keeps plain `nn.Linear` for both.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from engine import kernels
from engine.cpu_features import amx_unavailable_reason
from engine.kernels import DISABLE_ENV as KERNELS_DISABLE_ENV, KernelFailed, open_library
from engine.paged_attention import DTYPE_SUFFIXES, build  # noqa: F401 (tests and benchmarks build through it)

DISABLE_ENV = "PDSERVE_DISABLE_PACKING"
log = logging.getLogger(__name__)


def packing_supported(dtype: torch.dtype, device: torch.device | str) -> bool:
    return (
        dtype == torch.bfloat16
        and torch.device(device).type == "cpu"
        and os.environ.get(DISABLE_ENV) != "1"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def transposing_supported(dtype: torch.dtype, device: torch.device | str) -> bool:
    return (
        dtype == torch.float32
        and torch.device(device).type == "cpu"
        and os.environ.get(DISABLE_ENV) != "1"
    )


# from 64 rows on (prefill chunks) MKL on the transposed weight serves
DECODE_KERNEL_MAX_ROWS = 64
# the most rows one call of decode_linear_f32 takes (its MAX_ROWS): a bigger batch (--deterministic
# prefill chunks) goes in slices of it, each row's sums the same
_F32_KERNEL_CALL_ROWS = 64
DECODE_LINEAR_SOURCE = kernels.candidate("linear_f32", "kernel").source
_TILE_OUTPUTS = 16  # the kernels' tile width: a layer's outputs must be a multiple of it
BF16_DECODE_LINEAR_SOURCE = kernels.candidate("linear_bf16", "kernel").source
# where the CPU has AMX tiles, oneDNN's packed weight serves batches from this many rows on
AMX_KERNEL_MAX_ROWS = 9


def decode_linear_supported() -> bool:
    """Whether fp32 decode batches take engine/csrc/decode_linear.c: on x86 cores whose best ISA is
    AVX2 (measured there; on AVX-512 MKL's kernel for the transposed layout was already fast)."""
    return (
        torch.backends.cpu.get_cpu_capability() == "AVX2"
        and os.environ.get(KERNELS_DISABLE_ENV) != "1"
    )


def decode_panels_shape(weight_t: torch.Tensor) -> tuple[int, int, int]:
    """`[out / 16, in, 16]` for a transposed weight `[in, out]`."""
    inner, outer = weight_t.shape
    return (outer // _TILE_OUTPUTS, inner, _TILE_OUTPUTS)


def decode_panels(weight_t: torch.Tensor) -> torch.Tensor:
    """A transposed weight laid out for the kernel (`decode_panels_shape`), each panel of 16
    outputs contiguous."""
    tiles, inner, width = decode_panels_shape(weight_t)
    return weight_t.view(inner, tiles, width).transpose(0, 1).contiguous()


def panels_fit(weight_t: torch.Tensor) -> bool:
    return weight_t.dtype == torch.float32 and weight_t.shape[1] % _TILE_OUTPUTS == 0


class DecodeLinear:
    """`__call__(x, panels, bias)`: `x @ weight.T + bias` through a C kernel: `decode_linear_f32` on
    fp32 `decode_panels` (decode batches), `decode_linear_bf16` on bf16 `bf16_decode_panels` (every
    batch where the CPU has no AMX, prefill chunks included)."""

    def __init__(self, library_path: Path, dtype: torch.dtype = torch.float32):
        fn = getattr(open_library(library_path), f"decode_linear_{DTYPE_SUFFIXES[dtype]}")
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 6
        fn.restype = ctypes.c_int
        self._fn = fn
        self.dtype = dtype
        self.op = f"linear_{DTYPE_SUFFIXES[dtype]}"  # engine/kernels.py's name

    def __call__(
        self, x: torch.Tensor, panels: torch.Tensor, bias: Optional[torch.Tensor]
    ) -> torch.Tensor:
        x = x if x.stride(1) == 1 else x.contiguous()
        outputs = panels.shape[0] * _TILE_OUTPUTS
        out = torch.empty(x.shape[0], outputs, dtype=self.dtype)
        if kernels.is_disabled(self.op):
            raise KernelFailed(self.op)
        call_rows = _F32_KERNEL_CALL_ROWS if self.dtype == torch.float32 else max(1, x.shape[0])
        for first in range(0, x.shape[0], call_rows):
            rows = min(call_rows, x.shape[0] - first)
            code = self._fn(
                x[first:].data_ptr(),
                panels.data_ptr(),
                None if bias is None else bias.data_ptr(),
                out[first:].data_ptr(),
                rows,
                x.shape[1],
                outputs,
                x.stride(0),
                out.stride(0),
                torch.get_num_threads(),
            )
            if code:
                kernels.disable(self.op, f"code {code}")
                raise KernelFailed(f"{self.op} kernel failed (code {code})")
        return out


@lru_cache(maxsize=1)
def load_decode_linear() -> Optional[DecodeLinear]:
    """The kernel for this process, or None (MKL serves every batch) where it is not wanted or
    cannot be built."""
    if not decode_linear_supported():
        return None
    return kernels.select("linear_f32", lambda library, _: DecodeLinear(library))


def bf16_decode_linear_supported() -> bool:
    """Whether bf16 linears take engine/csrc/decode_linear_bf16.c (`bf16_kernel_max_rows` says
    which batches): on CPUs with AVX512_BF16."""
    return torch.cpu._is_avx512_bf16_supported() and os.environ.get(KERNELS_DISABLE_ENV) != "1"


def bf16_kernel_max_rows() -> Optional[int]:
    """The rows from which oneDNN's packed weight serves a bf16 batch instead of the kernel; None:
    the kernel serves every batch (no AMX this process can use)."""
    return AMX_KERNEL_MAX_ROWS if amx_unavailable_reason() is None else None


def bf16_decode_panels(weight: torch.Tensor) -> torch.Tensor:
    """A weight `[out, in]` laid out for the bf16 kernel, `[out / 16, in / 2, 16, 2]`: per panel of
    16 outputs, each pair of inputs' 16 x 2 weights side by side."""
    outer, inner = weight.shape
    return (
        weight.view(outer // _TILE_OUTPUTS, _TILE_OUTPUTS, inner // 2, 2)
        .transpose(1, 2)
        .contiguous()
    )


@lru_cache(maxsize=1)
def load_bf16_decode_linear() -> Optional[DecodeLinear]:
    """The bf16 kernel for this process, or None (oneDNN serves every batch) where it is not wanted
    or cannot be built."""
    if not bf16_decode_linear_supported():
        return None
    return kernels.select("linear_bf16", lambda library, _: DecodeLinear(library, torch.bfloat16))


class PackedLinear(nn.Module):
    def __init__(
        self,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        kernel: Optional[DecodeLinear] = None,
        every_batch: bool = False,
    ):
        """`kernel`: the bf16 kernel, on panels made here (where the weight fits them), for the
        batches `bf16_kernel_max_rows` gives it (`every_batch`: all of them, batch-invariant:
        engine/deterministic.py); oneDNN's packed weight, made only where some batches need it,
        for the rest."""
        super().__init__()
        self.out_features = weight.shape[0]
        fits = weight.shape[0] % _TILE_OUTPUTS == 0 and weight.shape[1] % 2 == 0
        self.kernel = kernel if fits else None
        if every_batch and self.kernel is None:
            raise ValueError(f"a weight of {tuple(weight.shape)} does not fit the bf16 kernel")
        self.every_batch = every_batch
        panels = bf16_decode_panels(weight.detach()) if self.kernel is not None else None
        self.register_buffer("weight_panels", panels, persistent=False)
        # batches of fewer rows take the kernel (none without one), the rest oneDNN's packed weight
        max_rows = 0 if self.kernel is None else None if every_batch else bf16_kernel_max_rows()
        self.kernel_max_rows = math.inf if max_rows is None else max_rows
        # The batch-size hint 1 favours decode; larger batches run as fast as with F.linear.
        packed = (
            torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
            if self.kernel_max_rows != math.inf
            else None
        )
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < self.kernel_max_rows:
            try:
                return self.kernel(x, self.weight_panels, self.bias)
            except KernelFailed:  # it returned an error: torch from now on (engine/kernels.py)
                if self.every_batch:
                    raise  # --deterministic: oneDNN is not batch-invariant
                self._drop_kernel()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def _drop_kernel(self) -> None:
        """oneDNN serves every batch: its packed weight made from the kernel's panels."""
        tiles, pairs, width, _ = self.weight_panels.shape
        weight = self.weight_panels.transpose(1, 2).reshape(tiles * width, pairs * 2)
        if self.packed_weight is None:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        self.kernel, self.kernel_max_rows, self.weight_panels = None, 0, None


class TransposedLinear(nn.Module):
    def __init__(
        self,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        decode: Optional[DecodeLinear] = None,
        every_batch: bool = False,
    ):
        """`decode`: decode batches through the kernel, on panels made here (where the weight fits
        them); `every_batch`: every batch, prefill chunks too (batch-invariant:
        engine/deterministic.py)."""
        super().__init__()
        weight_t = weight.detach().t().contiguous()
        panels = decode_panels(weight_t) if decode is not None and panels_fit(weight_t) else None
        self._hold(weight_t, bias, panels, decode, every_batch)

    @classmethod
    def over(
        cls,
        weight_t: torch.Tensor,
        bias: Optional[torch.Tensor],
        panels: Optional[torch.Tensor] = None,
        decode: Optional[DecodeLinear] = None,
        every_batch: bool = False,
    ) -> "TransposedLinear":
        """The layer over a weight already transposed (and its panels), used in place: e.g.
        memory-mapped from the disk cache, so that the workers of a node read one copy from the
        page cache instead of each making its own."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._hold(weight_t, bias, panels, decode, every_batch)
        return layer

    def _hold(
        self,
        weight_t: torch.Tensor,
        bias: Optional[torch.Tensor],
        panels: Optional[torch.Tensor],
        decode: Optional[DecodeLinear],
        every_batch: bool = False,
    ) -> None:
        if every_batch and (decode is None or panels is None):
            raise ValueError(
                f"a weight of {tuple(weight_t.shape)} (transposed) does not fit the fp32 kernel"
            )
        self.out_features = weight_t.shape[1]
        self.register_buffer("weight_t", weight_t)  # in state_dict(), as `weight` was
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)
        # serving tensors (engine/weights.py caches them), not the model's state
        self.register_buffer("weight_panels", panels, persistent=False)
        self.decode = decode if panels is not None else None
        self.decode_max_rows = math.inf if every_batch else DECODE_KERNEL_MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.decode is not None and x.shape[0] < self.decode_max_rows:
            try:
                return self.decode(x, self.weight_panels, self.bias)
            except KernelFailed:  # it returned an error: MKL from now on (engine/kernels.py)
                if self.decode_max_rows == math.inf:
                    raise  # --deterministic: MKL is not batch-invariant
                self.decode = None
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)


def linear_slots(model: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """(parent, attribute, qualified name) of every `nn.Linear` of `model`, and of its LM head where
    it is tied (`lm_head` None: the head reads the embedding table)."""
    slots = [
        (parent, name, f"{prefix}.{name}" if prefix else name)
        for prefix, parent in model.named_modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    if getattr(model, "lm_head", "absent") is None:
        slots.append((model, "lm_head", "lm_head"))
    return slots


def pack_linears(model: nn.Module, layer=PackedLinear) -> int:
    """Replaces every `nn.Linear` of `model` (and its tied LM head, which then holds its own copy of
    the embedding table) with `layer(weight, bias)` (e.g. `PackedLinear`, `TransposedLinear`);
    returns how many."""
    slots = linear_slots(model)
    for parent, name, _ in slots:
        child = getattr(parent, name)
        weight, bias = (
            (model.embed_tokens.weight, None) if child is None else (child.weight, child.bias)
        )
        setattr(parent, name, layer(weight, bias))
    return len(slots)
