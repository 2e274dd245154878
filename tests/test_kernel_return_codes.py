"""The fused elementwise kernels' return codes (engine/csrc/elementwise_kernels.h): a shape they do
not take is refused with -1 before anything is written, and engine/fused_ops.py raises on it
and engine/fused_ops.py computes that call with torch
instead of returning an unwritten `torch.empty`."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import pytest
import torch

from engine import fused_ops, kernels
from engine.paged_attention import build

_P = ctypes.c_void_p


@pytest.fixture(scope="module")
def ops() -> fused_ops.FusedOps:
    return fused_ops.FusedOps(build(source=fused_ops.SOURCE, extra_flags=fused_ops.EXTRA_FLAGS))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_shapes_the_kernels_do_not_take_return_minus_one(ops, dtype):
    x = torch.ones(4, 8, dtype=dtype)
    out = torch.full_like(x, 7)
    ptr, threads = _P(x.data_ptr()), 1
    kernel = {name: ops._kernels[name, dtype] for name in fused_ops._SIGNATURES}
    # rms_norm: no columns; add: a negative count; silu_mul: negative rows
    assert kernel["add_rms_norm"](ptr, None, ptr, _P(out.data_ptr()), 4, 0, 1e-6, threads) == -1
    assert kernel["add"](ptr, ptr, -1, threads) == -1
    assert kernel["silu_mul"](ptr, _P(out.data_ptr()), -1, 4, threads) == -1
    # rope: an odd head_dim (halves swap), rows shorter than their heads
    rope_args = (ptr, _P(out.data_ptr()), _P(out.data_ptr()), _P(out.data_ptr()))
    assert kernel["rope"](ptr, 8, *rope_args[1:], 4, 1, 7, threads) == -1
    assert kernel["rope"](ptr, 4, *rope_args[1:], 4, 1, 8, threads) == -1
    assert torch.equal(out, torch.full_like(x, 7))  # nothing written
    # and the shapes they do take
    assert kernel["add_rms_norm"](ptr, None, ptr, _P(out.data_ptr()), 4, 8, 1e-6, threads) == 0
    assert kernel["rope"](ptr, 8, *rope_args[1:], 4, 1, 8, threads) == 0
    assert kernel["add"](ptr, ptr, 0, threads) == 0


def test_a_refused_call_is_computed_with_torch_and_turns_the_kernels_off(ops, caplog):
    """A -1 disables the fused ops in this process (one log line naming the kernel) and that call,
    like every later one, is computed with torch: never an unwritten tensor."""
    saved = dict(kernels._chosen)
    kernels._chosen["fused_ops"] = kernels.Chosen("fused_ops", "kernel", Path("fused.so"))
    try:
        rows = torch.randn(3, 16, dtype=torch.bfloat16)
        cos, sin = (
            torch.randn(3, 1, 7, dtype=torch.bfloat16),
            torch.randn(3, 1, 7, dtype=torch.bfloat16),
        )
        with caplog.at_level(logging.ERROR, logger="engine.kernels"):
            got = ops.rope(rows, 2, 7, cos, sin)  # an odd head_dim: refused
        x = rows[:, :14].view(3, 2, 7)
        torch.testing.assert_close(got, x * cos + torch.cat([x[..., 3:], x[..., :3]], -1) * sin)
        assert "fused rope_bf16 kernel failed (code -1)" in caplog.text
        assert kernels.is_disabled("fused_ops") and fused_ops.fused_ops_for(rows) is None
        # disabled: an op it would take is computed with torch too
        x, r = torch.randn(4, 64), torch.randn(4, 64)
        w = torch.rand(64) + 0.5
        want = torch.nn.functional.rms_norm(x + r, (64,), w, 1e-6)
        torch.testing.assert_close(ops.rms_norm(x, w, 1e-6, residual=r), want)
    finally:
        kernels._chosen.clear()
        kernels._chosen.update(saved)
