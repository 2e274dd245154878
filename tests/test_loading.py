"""Weight loading: HF directories (safetensors, Llama-3 RoPE scaling, Qwen2 biases), dummies, bad
input."""

import json

import pytest
import torch

from engine.cpu_features import amx_unavailable_reason
from engine.default_model import ModelNotFoundError
from engine.gguf_loader import GGUFError
from engine.kv_cache import KVLayout, PagedKVCache
from engine.model import ForwardBatch, PrefillSlice
from engine.weights import load_model


def _logits(loaded, ids):
    n = len(ids)
    dtype = next(loaded.model.parameters()).dtype
    cache = PagedKVCache(KVLayout.for_model(loaded.config, 8, dtype), -(-n // 8))
    batch = ForwardBatch(
        torch.arange(n),
        torch.arange(n),
        prefill_slices=[PrefillSlice(0, n, n, torch.arange(-(-n // 8)))],
    )
    return loaded.model(torch.tensor(ids), batch, cache.k_caches, cache.v_caches)


@pytest.fixture(scope="module")
def hf_tokenizer_files(tmp_path_factory, default_gguf):
    from tests.hf_reference import hf_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    hf_tokenizer(default_gguf).save_pretrained(path)
    return path


@pytest.mark.parametrize("family", ["llama3-scaled", "qwen2-bias"])
def test_hf_directory_matches_transformers(tmp_path, hf_tokenizer_files, family):
    import transformers

    common = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    if family == "llama3-scaled":
        config = transformers.LlamaConfig(
            **common,
            rope_theta=500000.0,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        reference = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        reference = transformers.Qwen2ForCausalLM(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in reference.parameters():
            param.normal_(0, 0.05)
    reference.eval().save_pretrained(tmp_path)
    for file in hf_tokenizer_files.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    loaded = load_model(str(tmp_path), torch.float32)
    assert loaded.config.attention_bias == (family == "qwen2-bias")
    assert (loaded.config.rope_scaling is not None) == (family == "llama3-scaled")
    ids = loaded.tokenizer.encode("Paged attention keeps the KV cache in fixed-size blocks. " * 12)
    assert len(ids) > 100  # past original_max_position_embeddings, where scaling matters
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    assert (_logits(loaded, ids) - expected).abs().max().item() < 1e-4


def test_dummy_models_of_named_shapes():
    loaded = load_model("dummy:tiny", torch.bfloat16)
    assert loaded.tokenizer is None and loaded.config.num_layers == 2
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    assert torch.isfinite(_logits(loaded, [1, 2, 3])).all()
    with pytest.raises(ModelNotFoundError, match="unknown dummy shape 'llama-99b'"):
        load_model("dummy:llama-99b")


def test_unknown_paths_and_bad_files_are_clear_errors(tmp_path, default_gguf):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "missing.gguf"))
    not_gguf = tmp_path / "noise.gguf"
    not_gguf.write_bytes(b"\x00" * 4096)
    with pytest.raises(GGUFError, match="not a GGUF file"):
        load_model(str(not_gguf))
    truncated = tmp_path / "truncated.gguf"
    with open(default_gguf, "rb") as source:
        truncated.write_bytes(source.read(3_000_000))
    with pytest.raises(GGUFError, match="corrupt or truncated"):
        load_model(str(truncated))
    (tmp_path / "hfdir").mkdir()
    (tmp_path / "hfdir" / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_model(str(tmp_path / "hfdir"))


def test_bf16_cpu_models_use_packed_linears_that_match_f_linear_bit_for_bit(monkeypatch):
    from engine.cpu_packing import DISABLE_ENV, PackedLinear, packing_supported

    monkeypatch.delenv(DISABLE_ENV, raising=False)
    # The pinned torch build (scripts/bootstrap.sh) must have oneDNN and the packing ops: a failure,
    # not a skip.
    assert torch.backends.mkldnn.is_available(), (
        f"torch {torch.__version__} was built without oneDNN"
    )
    assert hasattr(torch.ops.mkldnn, "_reorder_linear_weight"), (
        f"torch {torch.__version__} lacks mkldnn._reorder_linear_weight"
    )
    # a property of the CPU, not of the install
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip(
            "this CPU lacks the ISA oneDNN needs for bf16 (x86: AVX-512 core or AVX2-VNNI-2; ARM: "
            "bf16)"
        )
    assert packing_supported(torch.bfloat16, "cpu")
    loaded = load_model("dummy:tiny", torch.bfloat16)
    packed = [m for m in loaded.model.modules() if isinstance(m, PackedLinear)]
    # qkv, o, gate_up, down per layer + the tied head
    assert len(packed) == 4 * loaded.config.num_layers + 1
    weight = torch.randn(96, 64).bfloat16()
    bias = torch.randn(96).bfloat16()
    for rows in (1, 7, 300):
        x = torch.randn(rows, 64).bfloat16()
        assert torch.equal(
            PackedLinear(weight, bias)(x), torch.nn.functional.linear(x, weight, bias)
        )
    assert not any(
        isinstance(m, PackedLinear) for m in load_model("dummy:tiny", torch.float32).model.modules()
    )  # fp32: transposed


def test_fp32_cpu_models_use_transposed_linears_that_match_f_linear(monkeypatch):
    from engine.cpu_packing import DISABLE_ENV, TransposedLinear

    monkeypatch.delenv(DISABLE_ENV, raising=False)
    loaded = load_model("dummy:tiny", torch.float32)
    layers = [m for m in loaded.model.modules() if isinstance(m, TransposedLinear)]
    # qkv, o, gate_up, down per layer + the tied head
    assert len(layers) == 4 * loaded.config.num_layers + 1
    weight, bias = torch.randn(96, 64), torch.randn(96)
    for rows in (1, 3, 8, 15):  # decode: MKL's kernel for this layout sums in another order
        x = torch.randn(rows, 64)
        torch.testing.assert_close(
            TransposedLinear(weight, bias)(x),
            torch.nn.functional.linear(x, weight, bias),
            rtol=1e-5,
            atol=1e-5,
        )
    for rows in (16, 300):  # prefill: the same kernel as F.linear's, bit for bit
        x = torch.randn(rows, 64)
        assert torch.equal(
            TransposedLinear(weight, bias)(x), torch.nn.functional.linear(x, weight, bias)
        )
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert not any(
        isinstance(m, TransposedLinear)
        for m in load_model("dummy:tiny", torch.float32).model.modules()
    )


def test_fp32_decode_batches_on_avx2_run_the_decode_linear_kernel_on_panels_of_the_weight():
    from engine.cpu_packing import (
        DECODE_KERNEL_MAX_ROWS,
        DECODE_LINEAR_SOURCE,
        DecodeLinear,
        TransposedLinear,
        build,
        decode_linear_supported,
        load_decode_linear,
    )

    # Chosen by the CPU's ISA (measured: faster on AVX2); the kernel itself runs on any AVX2 core,
    # so it is tested here on every kind.
    assert decode_linear_supported() == (torch.backends.cpu.get_cpu_capability() == "AVX2")
    assert (load_decode_linear() is not None) == decode_linear_supported()
    kernel = DecodeLinear(build(source=DECODE_LINEAR_SOURCE))
    weight, bias = torch.randn(96, 200), torch.randn(96)
    layer = TransposedLinear(weight, bias, kernel)
    assert layer.decode is kernel and layer.weight_panels.shape == (96 // 16, 200, 16)
    assert list(layer.state_dict()) == ["weight_t"]
    reference = torch.nn.functional.linear
    x = torch.randn(DECODE_KERNEL_MAX_ROWS, 200)
    # decode batches, one row included: the kernel's sums, to fp32 rounding, each row the same bits
    # whatever the rows beside it (batch-invariant)
    alone = [layer(x[i : i + 1]) for i in range(DECODE_KERNEL_MAX_ROWS - 1)]
    for rows in (1, 2, 5, 6, 7, 8, 12, 13, DECODE_KERNEL_MAX_ROWS - 1):
        out = layer(x[:rows])
        torch.testing.assert_close(out, reference(x[:rows], weight, bias), rtol=1e-5, atol=1e-5)
        assert torch.equal(out, torch.cat(alone[:rows]))
    # rows that are a view with a row stride (a slice of a wider activation)
    wide = torch.randn(3, 400)
    torch.testing.assert_close(layer(wide[:, :200]), reference(wide[:, :200], weight, bias))
    # prefill chunks: MKL on the transposed weight, F.linear's bits
    for rows in (DECODE_KERNEL_MAX_ROWS, 300):
        x = torch.randn(rows, 200)
        assert torch.equal(layer(x), reference(x, weight, bias))
    # outputs not a multiple of the kernel's tile, or no kernel: no panels, MKL serves every batch
    unfit = TransposedLinear(torch.randn(40, 64), None, kernel)
    for plain in (unfit, TransposedLinear(weight, bias)):
        assert plain.decode is None and plain.weight_panels is None


def test_bf16_linears_on_avx512_bf16_run_the_kernel_on_panels():
    from engine.cpu_packing import (
        AMX_KERNEL_MAX_ROWS,
        BF16_DECODE_LINEAR_SOURCE,
        DecodeLinear,
        PackedLinear,
        bf16_decode_linear_supported,
        bf16_kernel_max_rows,
        build,
        load_bf16_decode_linear,
        packing_supported,
    )

    # Chosen by the CPU's ISA; the kernel needs AVX512_BF16 to run at all
    supported = torch.cpu._is_avx512_bf16_supported()
    assert bf16_decode_linear_supported() == supported
    assert (load_bf16_decode_linear() is not None) == supported
    if not supported:
        pytest.skip("not run on this CPU: the bf16 linear kernel needs AVX512_BF16")
    assert packing_supported(torch.bfloat16, "cpu")  # oneDNN's bf16 runs wherever AVX512_BF16 does
    amx = amx_unavailable_reason() is None  # the CPU has tiles and Linux grants them
    assert bf16_kernel_max_rows() == (AMX_KERNEL_MAX_ROWS if amx else None)
    kernel = DecodeLinear(build(source=BF16_DECODE_LINEAR_SOURCE), torch.bfloat16)
    weight, bias = torch.randn(96, 200).bfloat16(), torch.randn(96).bfloat16()
    layer = PackedLinear(weight, bias, kernel)
    assert layer.kernel is kernel and layer.weight_panels.shape == (96 // 16, 100, 16, 2)
    # no AMX: the kernel serves every batch and oneDNN's copy is not made
    assert (layer.packed_weight is None) == (not amx)
    kernel_rows = AMX_KERNEL_MAX_ROWS - 1 if amx else 300
    x = torch.randn(kernel_rows, 200).bfloat16()
    exact = (x.double() @ weight.double().t() + bias.double()).bfloat16()
    # one row, the narrow tiles (1-4 rows), the wide ones, a prefill chunk: fp32 sums rounded once
    # to bf16 (at most one bf16 step from the exact result), each row the same bits whatever the
    # rows beside it (batch-invariant)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(kernel_rows)])
    for rows in sorted(r for r in {1, 2, 4, 5, 7, 8, 13, 25, kernel_rows} if r <= kernel_rows):
        out = layer(x[:rows])
        torch.testing.assert_close(out.float(), exact[:rows].float(), rtol=8e-3, atol=1e-2)
        assert torch.equal(out, alone[:rows])
    # rows that are a view with a row stride (a slice of a wider activation)
    wide = torch.randn(3, 400).bfloat16()
    torch.testing.assert_close(layer(wide[:, :200]), layer(wide[:, :200].contiguous()))
    if amx:  # prefill chunks: oneDNN's packed weight, F.linear's bits
        for rows in (AMX_KERNEL_MAX_ROWS, 300):
            x = torch.randn(rows, 200).bfloat16()
            assert torch.equal(layer(x), torch.nn.functional.linear(x, weight, bias))
    # outputs not a multiple of the kernel's tile: no panels, oneDNN serves every batch
    unfit_weight = torch.randn(40, 64).bfloat16()
    unfit = PackedLinear(unfit_weight, None, kernel)
    assert unfit.kernel is None and unfit.weight_panels is None
    x = torch.randn(5, 64).bfloat16()
    assert torch.equal(unfit(x), torch.nn.functional.linear(x, unfit_weight))
    loaded = load_model("dummy:tiny", torch.bfloat16)
    assert all(m.kernel is not None for m in loaded.model.modules() if isinstance(m, PackedLinear))


def test_loading_the_default_model_does_not_import_torch_dynamo():
    # Initialising parameters on the meta device imports torch._dynamo (a second of every worker's
    # start); the model is built without doing so, and nothing else on the load path needs it.
    import subprocess
    import sys

    script = (
        "import sys; from engine.weights import load_model; load_model(); "
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
