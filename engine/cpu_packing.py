"""Linear layers laid out once at load time for the CPU's matmul kernels.

- bf16: pre-packed for oneDNN (its blocked weight layout). `F.linear` re-lays out a bf16 weight for
  oneDNN on every call; packing once makes the small-batch matmuls of decode about 2x faster here
  (lm_head at batch 1: 3.2 -> 1.8 ms) and is bit-identical to `F.linear` in bf16.
- fp32: the weight transposed (`[in, out]`, contiguous) and multiplied as `x @ weight_t`. For 3-15
  rows (decode steps) MKL takes a kernel for that layout that reads a model's weights 1.4-1.7x as
  fast as `F.linear`'s on an AVX-512 core (docs/benchmarks.md); from 16 rows on (prefill) both
  layouts run the same kernel, bit-identical. Below 16 rows the sums' order differs from
  `F.linear`'s in the last bits, which greedy decoding does not see (the HF comparisons in tests/
  hold).
- fp32 on an AVX2-only core (no AVX-512): there MKL gains nothing from the transposed layout at 2-48
  rows, while oneDNN's own blocked fp32 layout is 1.2-1.8x as fast (a model's linears at 8 rows: 70
  against 125 ms; at 32: 146 against 181). Decode batches of 2 to `DECODE_PACKED_MAX_ROWS` - 1 rows
  run on a second copy of the weight in that layout; one row (MKL's gemv is the faster there) and
  prefill chunks of 64 rows or more keep the transposed weight, bit-identical to `F.linear`. The
  cost is the second copy (+540 MB for SmolLM2-135M in fp32).

`PDSERVE_DISABLE_PACKING=1` keeps plain `nn.Linear` for both.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch
from torch import nn

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


# from 64 rows on MKL on the transposed weight is as fast (measured to 256)
DECODE_PACKED_MAX_ROWS = 64


def decode_packing_supported() -> bool:
    """Whether fp32 decode batches get oneDNN-packed weights beside the transposed ones: on x86
    cores whose best ISA is AVX2 (measured there; on AVX-512 the transposed layout alone was the
    faster)."""
    return (
        torch.backends.cpu.get_cpu_capability() == "AVX2"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]):
        super().__init__()
        self.out_features = weight.shape[0]
        # The batch-size hint 1 favours decode; larger batches run as fast as with F.linear.
        self.register_buffer(
            "packed_weight",
            torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1),
            persistent=False,
        )
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


class TransposedLinear(nn.Module):
    def __init__(
        self, weight: torch.Tensor, bias: Optional[torch.Tensor], pack_for_decode: bool = False
    ):
        """`pack_for_decode`: also hold the oneDNN-packed copy for decode batches
        (`decode_packing_supported()`)."""
        super().__init__()
        self._hold(
            weight.detach().t().contiguous(),
            bias,
            _packed_for_decode(weight) if pack_for_decode else None,
        )

    @classmethod
    def over(cls, weight_t: torch.Tensor, bias: Optional[torch.Tensor]) -> "TransposedLinear":
        """The layer over a weight already transposed, used in place: e.g. memory-mapped from the
        disk cache, so that the workers of a node read one copy from the page cache instead of each
        making its own. Without its packed decode copy: `pack_for_decode` gives it that."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._hold(weight_t, bias, None)
        return layer

    def _hold(
        self, weight_t: torch.Tensor, bias: Optional[torch.Tensor], packed: Optional[torch.Tensor]
    ) -> None:
        self.out_features = weight_t.shape[1]
        self.register_buffer("weight_t", weight_t)  # in state_dict(), as `weight` was
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)
        self.register_buffer("packed_weight", packed, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None and 1 < x.shape[0] < DECODE_PACKED_MAX_ROWS:
            return torch.ops.mkldnn._linear_pointwise(
                x, self.packed_weight, self.bias, "none", [], ""
            )
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)


def _packed_for_decode(weight: torch.Tensor) -> Optional[torch.Tensor]:
    # The batch-size hint 32: at 2-48 rows its layout was the fastest here (hint 1 was slower at >1
    # row).
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32)
    except RuntimeError as exc:
        # a oneDNN build without this layout: the transposed weight serves alone
        log.warning(
            "fp32 decode weights stay unpacked: oneDNN could not pack a %s weight: %s",
            tuple(weight.shape),
            exc,
        )
        return None


def pack_for_decode(layers: list[TransposedLinear]) -> None:
    """Gives each layer its oneDNN-packed copy for decode batches, packed from its weight laid out
    `[out, in]` again in one scratch buffer: oneDNN packing a transposed view copies it to fresh
    memory first, and on a VM that pages memory in slowly that doubled the page faults of a worker's
    start."""
    if not layers:
        return
    scratch = torch.empty(
        max(layer.weight_t.numel() for layer in layers), dtype=layers[0].weight_t.dtype
    )
    for layer in layers:
        weight = scratch[: layer.weight_t.numel()].view(layer.out_features, -1)
        weight.copy_(layer.weight_t.t())
        layer.packed_weight = _packed_for_decode(weight)


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
