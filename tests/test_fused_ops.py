"""The fused elementwise kernels (engine/fused_ops.py) against torch's ops: the same to bf16
rounding in bf16 (they round once where torch rounds after each op) and to fp32 rounding in fp32,
and a model that uses them gives the same greedy tokens as one that does not, for a short answer."""

import pytest
import torch
import torch.nn.functional as F

from engine.fused_ops import load_fused_ops
from engine.model import apply_rope

DTYPES = [torch.bfloat16, torch.float32]
# Two tokens whose log-probabilities differ by less than this are a tie to bf16's rounding: two of
# its steps at the logits' size (8-bit mantissas: 0.06 for logits of 8-16, 0.12 for 16-32; the
# default model's answer here diverged at a gap of one step, 0.125, without the fused ops)
NEAR_TIE = 0.25


@pytest.fixture(scope="module")
def ops():
    fused = load_fused_ops()
    assert fused is not None, (
        "the fused kernels did not build (a C compiler is part of the test setup)"
    )
    return fused


def _close(a, b):
    """Within about one rounding of the dtype of each other (relative to the row's scale)."""
    rel = 2**-7 if b.dtype == torch.bfloat16 else 2**-20
    scale = b.float().abs().amax(-1, keepdim=True).clamp_min(1e-3)
    assert ((a.float() - b.float()).abs() / scale).max().item() <= 2 * rel


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_the_residual_add(ops, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 576, generator=g).to(dtype)
    r = torch.randn(37, 576, generator=g).to(dtype)
    w = (torch.rand(576, generator=g) + 0.5).to(dtype)
    _close(ops.rms_norm(x.clone(), w, 1e-5), F.rms_norm(x, (576,), w, 1e-5))
    summed = x.clone()
    out = ops.rms_norm(summed, w, 1e-5, residual=r)
    assert torch.equal(summed, x + r)  # the add in place, rounded as torch rounds it
    _close(out, F.rms_norm(x + r, (576,), w, 1e-5))
    y = x.clone()
    assert torch.equal(ops.add_(y, r), x + r) and torch.equal(y, x + r)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_and_rope(ops, dtype):
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(513, 2 * 1536, generator=g) * 4).to(dtype)
    gate, up = gate_up.split(1536, -1)
    _close(ops.silu_mul(gate_up), F.silu(gate) * up)
    heads, kv_heads, head_dim = 9, 3, 64
    qkv = torch.randn(40, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    cos = torch.randn(40, 1, head_dim, generator=g).to(dtype)
    sin = torch.randn(40, 1, head_dim, generator=g).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(40, heads + kv_heads, head_dim)
    _close(ops.rope(qkv, heads + kv_heads, head_dim, cos, sin), apply_rope(qk, cos, sin))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_model_answers_the_same_with_and_without_them(monkeypatch, dtype):
    from engine import model as model_module
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineConfig(model="default", dtype=dtype, num_threads=1, kv_cache_bytes=16 << 20)
    )
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Name a colour."}])
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=5)

    def answer(request_id):
        engine.add_request(request_id, prompt, params)
        tokens, logprobs = [], []
        for output in engine.run_until_done():
            tokens += output.new_token_ids
            logprobs += output.logprobs
        return tokens, logprobs

    fused, _ = answer("fused")
    monkeypatch.setattr(model_module, "fused_ops_for", lambda x: None)
    plain, plain_logprobs = answer("plain")
    if dtype == "float32":
        assert plain == fused
        return
    # bf16 rounds once in a fused op and after every op without it: the same answer up to the first
    # position where the model's two best tokens are within bf16's rounding of each other
    diverged = next((i for i, (a, b) in enumerate(zip(plain, fused)) if a != b), None)
    if diverged is not None:
        top = dict(plain_logprobs[diverged].top)
        assert fused[diverged] in top, (plain, fused, plain_logprobs[diverged])
        assert top[plain[diverged]] - top[fused[diverged]] < NEAR_TIE, plain_logprobs[diverged]
