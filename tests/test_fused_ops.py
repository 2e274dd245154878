"""The fused bf16 elementwise kernels (engine/fused_ops.py) against torch's ops: the same to bf16
rounding (they round once where torch rounds after each op), and a bf16 model that uses them gives
the same greedy tokens as one that does not, for a short answer."""

import pytest
import torch
import torch.nn.functional as F

from engine.fused_ops import load_fused_ops
from engine.model import apply_rope


@pytest.fixture(scope="module")
def ops():
    fused = load_fused_ops()
    assert fused is not None, (
        "the fused kernels did not build (a C compiler is part of the test setup)"
    )
    return fused


def _close(a, b, rel=2**-7):
    """Within about one bf16 rounding of each other (relative to the row's scale)."""
    scale = b.float().abs().amax(-1, keepdim=True).clamp_min(1e-3)
    assert ((a.float() - b.float()).abs() / scale).max().item() <= 2 * rel


def test_rms_norm_with_and_without_the_residual_add(ops):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 576, generator=g).bfloat16()
    r = torch.randn(37, 576, generator=g).bfloat16()
    w = (torch.rand(576, generator=g) + 0.5).bfloat16()
    _close(ops.rms_norm(x.clone(), w, 1e-5), F.rms_norm(x, (576,), w, 1e-5))
    summed = x.clone()
    out = ops.rms_norm(summed, w, 1e-5, residual=r)
    assert torch.equal(summed, x + r)  # the add in place, rounded as torch rounds it
    _close(out, F.rms_norm(x + r, (576,), w, 1e-5))
    y = x.clone()
    assert torch.equal(ops.add_(y, r), x + r) and torch.equal(y, x + r)


def test_silu_mul_and_rope(ops):
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(513, 2 * 1536, generator=g) * 4).bfloat16()
    gate, up = gate_up.split(1536, -1)
    _close(ops.silu_mul(gate_up), F.silu(gate) * up)
    heads, kv_heads, head_dim = 9, 3, 64
    qkv = torch.randn(40, (heads + 2 * kv_heads) * head_dim, generator=g).bfloat16()
    cos = torch.randn(40, 1, head_dim, generator=g).bfloat16()
    sin = torch.randn(40, 1, head_dim, generator=g).bfloat16()
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(40, heads + kv_heads, head_dim)
    _close(ops.rope(qkv, heads + kv_heads, head_dim, cos, sin), apply_rope(qk, cos, sin))


def test_a_bf16_model_answers_the_same_with_and_without_them(monkeypatch):
    from engine import model as model_module
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineConfig(model="default", dtype="bfloat16", num_threads=1, kv_cache_bytes=16 << 20)
    )
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Name a colour."}])
    params = SamplingParams(max_tokens=6, temperature=0)
    fused = engine.generate([prompt], params)[0].token_ids
    monkeypatch.setattr(model_module, "fused_ops_for", lambda x: None)
    assert engine.generate([prompt], params)[0].token_ids == fused
