"""The paged decode-attention kernel against a float64 reference and the torch (gather + SDPA)
path."""

import logging
import os
import shutil

import pytest
import torch

from engine import disk_cache, paged_attention
from engine.llm_engine import EngineConfig, LLMEngine
from engine.model import ForwardBatch
from engine.sampling import SamplingParams
from tests.attention_shapes import attention_layer


@pytest.fixture(scope="module")
def kernel():
    # The engine falls back to torch without a compiler; the tests do not: CI's machine has one.
    assert shutil.which("cc") or shutil.which("gcc"), (
        "no C compiler (cc or gcc) on PATH: the kernel cannot be tested"
    )
    loaded = paged_attention.load_kernel()
    assert loaded is not None, "the kernel must build wherever a C compiler exists"
    return loaded


@pytest.fixture(scope="module", params=["built", "avx2"])
def each_path(request, kernel):
    """The kernel as built for this CPU, and built without its AVX-512 path (which serves head sizes
    that are multiples of 16 where the compiler targets AVX-512), so both SIMD paths are held to the
    reference on an AVX-512 machine."""
    if request.param == "built":
        return kernel
    return paged_attention.PagedDecodeAttention(
        paged_attention.build(extra_flags=("-DPDSERVE_NO_AVX512",))
    )


def _paged_case(num_heads, num_kv_heads, head_dim, block_size, context_lens, dtype, seed=0):
    """Random q and a paged cache whose sequences own shuffled, non-adjacent blocks."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = 2 * sum(blocks_per_seq) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(blocks_per_seq)
    # padding points at block 0
    tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.long)
    for row, n in enumerate(blocks_per_seq):
        tables[row, :n] = torch.tensor([order.pop() for _ in range(n)])
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(context_lens, dtype=torch.long)


def _reference(q, k_cache, v_cache, tables, lens, scale):
    """Plain float64 attention over exactly each sequence's own rows."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, n in enumerate(lens.tolist()):
        keys = (
            k_cache[tables[b]]
            .flatten(0, 1)[:n]
            .double()
            .repeat_interleave(num_heads // num_kv_heads, dim=1)
        )
        values = (
            v_cache[tables[b]]
            .flatten(0, 1)[:n]
            .double()
            .repeat_interleave(num_heads // num_kv_heads, dim=1)
        )
        probs = (torch.einsum("hd,thd->ht", q[b].double(), keys) * scale).softmax(-1)
        out[b] = torch.einsum("ht,thd->hd", probs, values)
    return out


def _torch_path(q, k_cache, v_cache, tables, lens, scale):
    batch, num_heads, head_dim = q.shape
    attention = attention_layer(num_heads, k_cache.shape[2], head_dim)
    batch_info = ForwardBatch(
        positions=lens - 1, slot_mapping=lens, decode_block_tables=tables, decode_context_lens=lens
    )
    return attention._decode_attention(q, k_cache, v_cache, batch_info).view(
        batch, num_heads, head_dim
    )


SHAPES = [  # num_heads, num_kv_heads, head_dim, block_size
    (9, 3, 64, 16),  # SmolLM2-135M
    (4, 4, 32, 4),  # no grouping, small blocks
    (8, 2, 128, 16),  # Llama-3-8B's grouping and head size
    (10, 2, 40, 5),  # groups of 5 (3 + 2 heads at a time), a 40-lane head (16 + 16 + 8), odd blocks
    (6, 2, 48, 8),  # a 48-lane head: AVX-512 in 16-lane spans alone
    (2, 1, 12, 16),  # a head size that is not a multiple of 8: the plain loops
]
LENS = [1, 15, 16, 17, 300, 33]  # one token, both sides of a block boundary, a long one


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-5), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}kv{}d{}bs{}".format(*s))
def test_kernel_matches_a_float64_reference_and_the_torch_path(each_path, dtype, atol, shape):
    num_heads, num_kv_heads, head_dim, block_size = shape
    q, k_cache, v_cache, tables, lens = _paged_case(
        num_heads, num_kv_heads, head_dim, block_size, LENS, dtype
    )
    assert each_path.supports(k_cache)
    scale = head_dim**-0.5
    expected = _reference(q, k_cache, v_cache, tables, lens, scale)
    got = each_path(q, k_cache, v_cache, tables, lens, scale)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.double(), expected, atol=atol, rtol=0)
    # The path it replaces agrees with the same reference to the same tolerance.
    torch.testing.assert_close(
        _torch_path(q, k_cache, v_cache, tables, lens, scale).double(), expected, atol=atol, rtol=0
    )


def test_rows_outside_a_sequence_never_leak_into_it(kernel):
    q, k_cache, v_cache, tables, lens = _paged_case(9, 3, 64, 16, [5, 20], torch.float32, seed=1)
    before = kernel(q, k_cache, v_cache, tables, lens, 0.125)
    # Poison every row that is not one of the sequences' first `len` tokens.
    owned = torch.zeros(k_cache.shape[0] * k_cache.shape[1], dtype=torch.bool)
    for b, n in enumerate(lens.tolist()):
        slots = tables[b].repeat_interleave(16) * 16 + torch.arange(16).repeat(tables.shape[1])
        owned[slots[:n]] = True
    k_cache.view(-1, 3, 64)[~owned] = 1e4
    v_cache.view(-1, 3, 64)[~owned] = float("nan")
    assert torch.equal(kernel(q, k_cache, v_cache, tables, lens, 0.125), before)


def test_a_batch_split_over_threads_gives_the_same_bits(kernel):
    q, k_cache, v_cache, tables, lens = _paged_case(9, 3, 64, 16, LENS, torch.bfloat16, seed=2)
    one = kernel(q, k_cache, v_cache, tables, lens, 0.125)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = kernel(q, k_cache, v_cache, tables, lens, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_the_build_is_cached_and_a_missing_compiler_falls_back_to_torch(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv(disk_cache.CACHE_ENV, str(tmp_path))
    built = paged_attention.build()
    assert built.parent == tmp_path / "kernels"
    stamp = built.stat().st_mtime_ns
    assert paged_attention.build() == built and built.stat().st_mtime_ns == stamp  # not rebuilt
    # no partial files left behind: the library and what it was built with
    assert sorted(p.name for p in built.parent.iterdir()) == [built.name, built.name + ".flags"]

    monkeypatch.setenv(disk_cache.CACHE_ENV, str(tmp_path / "other"))
    with pytest.raises(paged_attention.KernelBuildError, match="failed"):
        paged_attention.build(compiler="false")
    monkeypatch.setenv("CC", "false")
    paged_attention.load_kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="engine.kernels"):
            assert paged_attention.load_kernel() is None
        assert "torch (gather + SDPA) runs instead" in caplog.text
        monkeypatch.delenv("CC")
        monkeypatch.setenv(paged_attention.DISABLE_ENV, "1")
        paged_attention.load_kernel.cache_clear()
        assert paged_attention.load_kernel() is None
    finally:
        paged_attention.load_kernel.cache_clear()


def test_engine_uses_the_kernel_and_greedy_output_equals_the_torch_path(kernel, smollm_fp32):
    model = smollm_fp32.model
    attached = model.layers[0].self_attn.decode_kernel
    assert all(
        isinstance(layer.self_attn.decode_kernel, paged_attention.PagedDecodeAttention)
        for layer in model.layers
    )
    tokenizer = smollm_fp32.tokenizer
    prompts = [
        tokenizer.encode_chat([{"role": "user", "content": t}])
        for t in ("Name three rivers.", "What is 12 times 7?")
    ]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    engine = LLMEngine(EngineConfig(kv_cache_bytes=64 * 2**20), loaded=smollm_fp32)
    with_kernel = [r.token_ids for r in engine.generate(prompts, params)]
    model.use_decode_kernel(None)
    try:
        without = [r.token_ids for r in engine.generate(prompts, params)]
    finally:
        model.use_decode_kernel(attached)
    assert with_kernel == without


_PREFILL_CASES = [(1, 0), (127, 0), (128, 0), (300, 0), (1, 16), (300, 16), (128, 128), (77, 200)]


@pytest.mark.parametrize(
    "kernel,num_tokens,num_cached",
    [("blocked", n, c) for n, c in _PREFILL_CASES]
    # taken only after context: SDPA's own causal kernel otherwise
    + [("flash_after_context", n, c) for n, c in _PREFILL_CASES if c],
)
@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: "h{}kv{}d{}".format(*s[:3]))
def test_bf16_prefill_attention_matches_causal_sdpa(kernel, num_tokens, num_cached, shape):
    """New tokens after `num_cached` context tokens (a cached prefix, an earlier chunk) see all of
    the context and, among themselves, those before them: each bf16 CPU kernel, whichever this CPU
    picks."""
    num_heads, num_kv_heads, head_dim, _ = shape
    g = torch.Generator().manual_seed(num_tokens + num_cached)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g).bfloat16()
    k = torch.randn(num_cached + num_tokens, num_kv_heads, head_dim, generator=g).bfloat16()
    v = torch.randn(num_cached + num_tokens, num_kv_heads, head_dim, generator=g).bfloat16()
    got = getattr(attention_layer(num_heads, num_kv_heads, head_dim), f"_{kernel}_attention")(
        q, k, v
    )
    visible = torch.arange(num_cached + num_tokens).unsqueeze(0) <= torch.arange(
        num_cached, num_cached + num_tokens
    ).unsqueeze(1)
    expected = (
        torch.nn.functional.scaled_dot_product_attention(
            q.double().transpose(0, 1),
            k.double().transpose(0, 1),
            v.double().transpose(0, 1),
            attn_mask=visible,
            enable_gqa=True,
            scale=head_dim**-0.5,
        )
        .transpose(0, 1)
        .reshape(num_tokens, -1)
    )
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), expected, atol=3e-2, rtol=0)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc")
def test_the_kernel_shares_torchs_openmp_runtime(kernel):
    loaded = {line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line}
    assert len(loaded) <= 1, f"two OpenMP runtimes in one process oversubscribe the cores: {loaded}"
