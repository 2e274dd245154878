"""The flash-attention prefill kernels (engine/csrc/prefill_attention_amx.c with AMX tiles,
prefill_attention_avx512.c with AVX512-BF16) against a float64 reference, and the choice of prefill
attention on CPUs with and without them."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import cpu_features, disk_cache, model, prefill_attention
from engine.model import Attention, _prefill_kernel
from engine.paged_attention import build
from tests.attention_shapes import attention_layer

AMX = cpu_features.amx_unavailable_reason() is None  # the CPU has tiles and Linux grants them
KIND = prefill_attention.kernel_kind()  # what this CPU takes (None: the torch path)
# every kernel this CPU can run (an AMX CPU has AVX512-BF16 too)
RUNNABLE = [
    kind
    for kind, supported in (
        (prefill_attention.AMX, AMX),
        (prefill_attention.AVX512_BF16, torch.cpu._is_avx512_bf16_supported()),
    )
    if supported
]


def _visible(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[new tokens, keys]: the keys each new token attends to (the cached context, itself and the
    new tokens before it)."""
    n, num_cached = q.shape[0], k.shape[0] - q.shape[0]
    return torch.arange(num_cached + n).unsqueeze(0) <= torch.arange(
        num_cached, num_cached + n
    ).unsqueeze(1)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return (
        torch.nn.functional.scaled_dot_product_attention(
            *(t.double().transpose(0, 1) for t in (q, k, v)),
            attn_mask=_visible(q, k),
            enable_gqa=True,
            scale=q.shape[-1] ** -0.5,
        )
        .transpose(0, 1)
        .reshape(q.shape[0], -1)
    )


# new tokens, cached context: one row, a partial 16-row query block, whole 64-key blocks and not
# (the last key block part padding), a context longer than the prompt
_CASES = [(1, 0), (15, 0), (64, 0), (100, 0), (128, 0), (300, 0), (542, 16), (1, 16), (77, 200)]
_CASES += [(128, 512), (257, 31)]


@pytest.mark.parametrize("num_tokens,num_cached", _CASES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_bf16_prefill_attention_matches_float64(num_tokens, num_cached, num_heads, num_kv_heads):
    """Whichever kernel this CPU picks for a bf16 prompt (AMX, else AVX512-BF16, else the blocked
    matmuls), with q, k and v as the model hands them over: views of the fused qkv projection, rows
    apart."""
    head_dim = 64
    g = torch.Generator().manual_seed(num_tokens * 1000 + num_cached)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_cached + num_tokens, width, generator=g).bfloat16()
    heads = qkv.view(num_cached + num_tokens, num_heads + 2 * num_kv_heads, head_dim)
    q = heads[num_cached:, :num_heads]
    k = heads[:, num_heads : num_heads + num_kv_heads]
    v = heads[:, num_heads + num_kv_heads :]
    kernel = _prefill_kernel(q, num_cached)
    if KIND is not None:
        assert kernel is Attention._kernel_flash_attention
    else:
        assert kernel is Attention._blocked_attention
    got = kernel(attention_layer(num_heads, num_kv_heads, head_dim), q, k, v)
    assert got.dtype == torch.bfloat16 and got.shape == (num_tokens, num_heads * head_dim)
    torch.testing.assert_close(got.double(), _reference(q, k, v), atol=2e-2, rtol=0)


@pytest.mark.parametrize("num_cached", [0, 40])
def test_scores_that_keep_growing_along_the_keys(num_cached):
    """Later keys score ever higher (the last query's scores span ~30 in log2): the running maximum
    moves block after block, and the kernel rescales what it has summed so far."""
    g = torch.Generator().manual_seed(3)
    n = 200
    q = torch.randn(n, 9, 64, generator=g).abs().bfloat16()
    growth = torch.linspace(0.2, 3.0, num_cached + n).view(-1, 1, 1)
    k = (torch.randn(num_cached + n, 3, 64, generator=g).abs() * growth).bfloat16()
    v = torch.randn(num_cached + n, 3, 64, generator=g).bfloat16()
    got = _prefill_kernel(q, num_cached)(attention_layer(9, 3, 64), q, k, v)
    reference = _reference(q, k, v)
    # The C kernels keep their scores in fp32. The torch path of other CPUs gets them from a bf16
    # matmul, rounded to bf16 (scores near 20 lose ~0.1): it is held to plain bf16 attention's
    # error.
    atol = (
        2e-2
        if KIND is not None
        else max(2e-2, 1.25 * (_bf16_scores_attention(q, k, v) - reference).abs().max())
    )
    torch.testing.assert_close(got.double(), reference, atol=atol, rtol=0)


def _bf16_scores_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Eager causal attention with bf16 matmuls and an fp32 softmax, as a bf16 model without a
    fused kernel computes it."""
    group = q.shape[1] // k.shape[1]
    keys, values = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
    scores = (q.transpose(0, 1) @ keys.transpose(1, 2)).float() * q.shape[-1] ** -0.5
    probs = scores.masked_fill(~_visible(q, k), float("-inf")).softmax(-1).bfloat16()
    return (probs @ values).transpose(0, 1).reshape(q.shape[0], -1).double()


@pytest.mark.skipif(
    not RUNNABLE, reason="the kernels run only on AMX or AVX512-BF16 CPUs (fallbacks tested below)"
)
@pytest.mark.parametrize("kind", RUNNABLE, ids=lambda kind: kind.name)
@pytest.mark.parametrize("num_tokens,num_cached", [(1, 0), (100, 16), (257, 31), (77, 200)])
def test_each_kernel_this_cpu_runs_matches_float64(kind, num_tokens, num_cached):
    """Each kernel, not only the one chosen (an AMX CPU runs both)."""
    g = torch.Generator().manual_seed(num_tokens)
    q = torch.randn(num_tokens, 9, 64, generator=g).bfloat16()
    k = torch.randn(num_cached + num_tokens, 3, 64, generator=g).bfloat16()
    v = torch.randn(num_cached + num_tokens, 3, 64, generator=g).bfloat16()
    kernel = prefill_attention.PrefillAttention(
        kind, build(source=kind.source, extra_flags=kind.extra_flags)
    )
    got = kernel(q, k, v, 64**-0.5).double()
    torch.testing.assert_close(got, _reference(q, k, v), atol=2e-2, rtol=0)


@pytest.mark.skipif(
    KIND is None, reason="the kernels run only on AMX or AVX512-BF16 CPUs (fallbacks tested below)"
)
def test_a_wrong_mask_would_be_caught():
    """The tolerance is tight enough: attention over every key, future ones too, differs well
    beyond it."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(100, 9, 64, generator=g).bfloat16()
    k = torch.randn(116, 3, 64, generator=g).bfloat16()
    v = torch.randn(116, 3, 64, generator=g).bfloat16()
    got = prefill_attention.load_prefill_kernel()(q, k, v, 64**-0.5).double()
    torch.testing.assert_close(got, _reference(q, k, v), atol=2e-2, rtol=0)
    every_key = torch.nn.functional.scaled_dot_product_attention(
        *(t.double().transpose(0, 1) for t in (q, k, v)), enable_gqa=True, scale=64**-0.5
    )
    assert (got - every_key.transpose(0, 1).reshape(100, -1)).abs().max() > 0.1


def test_the_kernel_loads_exactly_where_the_cpu_has_amx_or_avx512_bf16(
    monkeypatch, tmp_path, caplog
):
    monkeypatch.setenv(disk_cache.CACHE_ENV, str(tmp_path))
    prefill_attention.load_prefill_kernel.cache_clear()
    try:
        loaded = prefill_attention.load_prefill_kernel()
        assert (loaded.kind if loaded is not None else None) == KIND
        assert KIND == (prefill_attention.AMX if AMX else RUNNABLE[0] if RUNNABLE else None)
        # a compiler that fails leaves the torch path, with a warning (where there is a kernel)
        monkeypatch.setenv("CC", "false")
        prefill_attention.load_prefill_kernel.cache_clear()
        with caplog.at_level(logging.WARNING, logger="engine.kernels"):
            assert prefill_attention.load_prefill_kernel() is None
        assert ("torch runs instead" in caplog.text) == (KIND is not None)
        monkeypatch.delenv("CC")
        monkeypatch.setenv(prefill_attention.DISABLE_ENV, "1")
        prefill_attention.load_prefill_kernel.cache_clear()
        assert prefill_attention.load_prefill_kernel() is None
    finally:
        prefill_attention.load_prefill_kernel.cache_clear()


@pytest.mark.parametrize("amx_cpu", [True, False])
def test_without_the_kernel_prefill_keeps_the_torch_path(monkeypatch, amx_cpu):
    """No kernel (neither ISA, no compiler, switched off): the choice of before it, on either kind
    of CPU; other dtypes and head sizes never take it."""
    monkeypatch.setattr(model, "_AMX", amx_cpu)
    monkeypatch.setattr(model, "load_prefill_kernel", lambda: None)
    q = torch.zeros(8, 9, 64, dtype=torch.bfloat16)
    if amx_cpu:
        assert _prefill_kernel(q, 0) is None  # SDPA's causal flash kernel
        assert _prefill_kernel(q, 16) is Attention._flash_after_context_attention
    else:
        assert _prefill_kernel(q, 0) is _prefill_kernel(q, 16) is Attention._blocked_attention
    monkeypatch.setattr(model, "load_prefill_kernel", lambda: prefill_attention.PrefillAttention)
    assert _prefill_kernel(q, 16) is Attention._kernel_flash_attention
    assert _prefill_kernel(q.float(), 16) is None
    assert _prefill_kernel(torch.zeros(8, 9, 128, dtype=torch.bfloat16), 16) is not (
        Attention._kernel_flash_attention
    )
