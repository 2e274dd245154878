"""The single-process engine: batching, preemption, finishing, sampling and bad input."""

import time

import pytest
import torch

from engine.llm_engine import EngineConfig, LLMEngine, RequestError
from engine.sampling import SamplingParams
from engine.weights import load_model


@pytest.fixture(scope="module")
def tiny():
    return load_model("dummy:tiny", torch.float32)


def _random_prompts(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=generator).tolist() for n in lengths]


def test_a_batch_of_different_lengths_matches_each_sequence_alone(smollm_fp32):
    tokenizer = smollm_fp32.tokenizer
    texts = [
        "Hi",
        "Name a colour.",
        "Why is the sky blue? Answer briefly.",
        "Count from one to five.",
        "Tell me a very short story about a cat who learns to fly over the mountains.",
    ]
    prompts = [tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]
    params = SamplingParams(max_tokens=24, temperature=0)
    engine = LLMEngine(EngineConfig(kv_cache_bytes=64 * 2**20), loaded=smollm_fp32)
    batched = engine.generate(prompts, params)
    assert len({len(r.token_ids) for r in batched}) > 1  # some finish early while others still run
    for prompt, result in zip(prompts, batched):
        assert engine.generate([prompt], params)[0].token_ids == result.token_ids
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks


def test_preemption_under_a_small_cache_keeps_outputs_identical(tiny):
    prompts = _random_prompts([40, 33, 57, 21, 64, 12])
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    roomy = LLMEngine(EngineConfig(model="dummy:tiny", block_size_tokens=8), loaded=tiny)
    expected = [r.token_ids for r in roomy.generate(prompts, params)]
    layout_bytes = roomy.layout.bytes_per_block
    cramped = LLMEngine(
        EngineConfig(block_size_tokens=8, kv_cache_bytes=30 * layout_bytes), loaded=tiny
    )
    assert [r.token_ids for r in cramped.generate(prompts, params)] == expected
    assert cramped.scheduler.num_preemptions > 0 and roomy.scheduler.num_preemptions == 0
    assert cramped.allocator.num_free_blocks == cramped.allocator.num_blocks == 30


def test_continuous_batching_admits_new_requests_into_a_running_batch(tiny):
    engine = LLMEngine(EngineConfig(block_size_tokens=8), loaded=tiny)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine.add_request("first", _random_prompts([10])[0], params)
    for _ in range(5):
        engine.step()
    engine.add_request("second", _random_prompts([10], seed=1)[0], params)
    engine.step()  # the newcomer's prefill
    assert [s.request_id for s in engine.scheduler.running] == ["first", "second"]
    decode_batch = engine.scheduler.schedule()
    assert not decode_batch.is_prefill and len(decode_batch.seqs) == 2


def test_prompts_with_ttft_deadlines_prefill_by_them_with_unchanged_outputs(tiny):
    prompts = _random_prompts([40, 40, 40], seed=3)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    config = EngineConfig(block_size_tokens=8, cpu_prefill_batch_tokens=16)  # one prompt a step
    expected = LLMEngine(config, loaded=tiny).generate(prompts, params)
    engine = LLMEngine(config, loaded=tiny)
    engine.scheduler.prefill_token_s = 1.0  # as if measured: a prompt takes 40 s
    now = time.monotonic()
    # "late" cannot make its deadline: it waits for the two that can still make theirs
    for request_id, prompt, deadline_s in zip(
        ("late", "later", "sooner"), prompts, (now + 10.0, now + 200.0, now + 100.0)
    ):
        engine.add_request(request_id, prompt, params, ttft_deadline_s=deadline_s)
    first_tokens, tokens = [], {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id not in tokens:
                first_tokens.append(output.request_id)
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert first_tokens == ["sooner", "later", "late"]
    assert [tokens[name] for name in ("late", "later", "sooner")] == [
        result.token_ids for result in expected
    ]


def test_finish_reasons_and_abort_free_every_block(tiny):
    engine = LLMEngine(EngineConfig(block_size_tokens=8), loaded=tiny)
    prompt = _random_prompts([16])[0]
    greedy = engine.generate([prompt], SamplingParams(max_tokens=5, temperature=0))[0]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 5
    stop_on = greedy.token_ids[2]
    stopped = engine.generate(
        [prompt], SamplingParams(max_tokens=5, temperature=0, stop_token_ids=(stop_on,))
    )[0]
    assert (
        stopped.finish_reason == "stop"
        and stopped.token_ids == greedy.token_ids[: greedy.token_ids.index(stop_on) + 1]
    )
    engine.add_request("gone", prompt, SamplingParams(max_tokens=50, temperature=0))
    engine.step()
    assert engine.abort("gone") and not engine.abort("gone")
    assert not engine.has_unfinished()
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks


def test_stop_strings_cut_the_text(smollm_fp32):
    engine = LLMEngine(EngineConfig(kv_cache_bytes=32 * 2**20), loaded=smollm_fp32)
    prompt = engine.tokenizer.encode_chat(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    full = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0]
    assert "Paris" in full.text
    cut = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0, stop=("Paris",)))[
        0
    ]
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index("Paris")]
    # A worker's engine (no output text) still stops at the same token.
    quiet = LLMEngine(EngineConfig(kv_cache_bytes=32 * 2**20, detokenize=False), loaded=smollm_fp32)
    silent_cut = quiet.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0, stop=("Paris",))
    )[0]
    assert silent_cut.finish_reason == "stop" and silent_cut.token_ids == cut.token_ids
    plain = quiet.generate([prompt], SamplingParams(max_tokens=4, temperature=0))[0]
    # no stop strings: no decoding at all
    assert plain.token_ids == full.token_ids[:4] and plain.text == ""


def test_seeded_sampling_is_reproducible_and_seed_dependent(tiny):
    engine = LLMEngine(EngineConfig(block_size_tokens=8), loaded=tiny)
    prompt = _random_prompts([12])[0]

    def run(**kw):
        return engine.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True, **kw))[
            0
        ].token_ids

    assert run(temperature=1.0, seed=7) == run(temperature=1.0, seed=7)
    assert run(temperature=1.0, seed=7) != run(temperature=1.0, seed=8)
    assert run(temperature=0.8, top_k=1, seed=3) == run(temperature=0)
    assert run(temperature=0.8, top_p=1e-6, seed=3) == run(temperature=0)
    # The same seeded request gives the same tokens alone and inside a batch.
    batch = engine.generate(
        [prompt, _random_prompts([30], seed=5)[0]],
        SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True),
    )
    assert batch[0].token_ids == run(temperature=1.0, seed=7)


def test_sampled_tokens_follow_the_filtered_softmax():
    from engine.sampling import sample

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, float("-inf")]])
    draws = 4000

    def frequencies(params):
        counts = torch.zeros(5)
        for position in range(draws):
            counts[sample(logits, [params], [position])[0]] += 1
        return counts / draws

    plain = frequencies(SamplingParams(temperature=1.0, seed=11))
    assert plain[4] == 0  # probability 0 is never drawn
    # 4000 draws: sd of each share <= 0.008
    assert (plain - logits[0].softmax(-1)).abs().max() < 0.03
    hot = frequencies(SamplingParams(temperature=2.0, seed=11))
    assert (hot - (logits[0] / 2).softmax(-1)).abs().max() < 0.03
    top2 = frequencies(SamplingParams(temperature=1.0, top_k=2, seed=11))
    assert top2[2:].sum() == 0 and abs(top2[0] - logits[0, :2].softmax(-1)[0]) < 0.03


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([], "prompt is empty"),
        ([1, 2, 10**6], "outside the vocabulary"),
        (list(range(3, 500)) * 3, "serves 1024 tokens of context \\(the model's 1024"),
    ],
)
def test_bad_prompts_are_clear_errors_and_disturb_nothing(tiny, prompt, message):
    engine = LLMEngine(EngineConfig(block_size_tokens=8), loaded=tiny)
    engine.add_request("ok", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0))
    with pytest.raises(RequestError, match=message):
        engine.add_request("bad", prompt, SamplingParams(max_tokens=3))
    outputs = list(engine.run_until_done())
    assert [o.request_id for o in outputs] == ["ok"] * 3 and outputs[-1].finished


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"stop": ("",)}, "stop"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_a_kv_cache_smaller_than_the_context_bounds_what_is_served(tiny):
    from engine.kv_cache import KVLayout

    layout = KVLayout.for_model(tiny.config, 8, torch.float32)
    engine = LLMEngine(
        EngineConfig(block_size_tokens=8, kv_cache_bytes=6 * layout.bytes_per_block), loaded=tiny
    )
    assert engine.max_model_len == 48 < tiny.config.max_context_tokens
    with pytest.raises(RequestError, match="serves 48 tokens of context"):
        engine.add_request("long", list(range(3, 51)), SamplingParams(max_tokens=3))
    # Alone in the cache, a sequence that would outgrow it ends at the served context, not
    # preempting itself.
    engine.add_request(
        "grows", list(range(3, 13)), SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
    )
    outputs = list(engine.run_until_done())
    assert outputs[-1].finish_reason == "length" and len(outputs) == 48 - 10
    assert engine.scheduler.num_preemptions == 0 and engine.allocator.num_free_blocks == 6


def test_auto_dtype_is_bf16_only_where_the_cpu_has_it_natively(tiny, monkeypatch):
    from engine.dtypes import AUTO_DTYPE_ENV, auto_dtype, parse_dtype

    # the CPU's own choice (tests/test_start_line.py: the override)
    monkeypatch.delenv(AUTO_DTYPE_ENV, raising=False)

    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert auto_dtype("cpu") == (torch.bfloat16 if native else torch.float32)
    assert auto_dtype("cuda") == torch.bfloat16
    assert parse_dtype("auto") == auto_dtype("cpu")
    with pytest.raises(ValueError, match="auto, float32"):
        parse_dtype("float8")


def test_device_auto_is_cuda_only_where_torch_sees_a_gpu_and_cuda_without_one_is_a_clear_error(
    monkeypatch, capsys
):
    from engine.dtypes import resolve_device
    from pdserve.cli import main

    assert resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        resolve_device("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    assert (
        EngineConfig(dtype="auto", device="auto").torch_dtype
        == EngineConfig(dtype="auto").torch_dtype
    )
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        resolve_device("cuda:0")
    assert main(["generate", "hi", "--model", "dummy:tiny", "--device", "cuda"]) == 2
    assert "device 'cuda' asked for, but torch sees no CUDA device" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda" and resolve_device("cuda") == "cuda"
    assert EngineConfig(dtype="auto", device="auto").torch_dtype == torch.bfloat16


def test_the_decode_kernel_is_chosen_by_device():
    from engine import paged_attention
    from engine.triton_paged_attention import TritonPagedDecodeAttention

    assert isinstance(
        paged_attention.decode_kernel_for("cpu"), paged_attention.PagedDecodeAttention
    )
    triton_kernel = paged_attention.decode_kernel_for("cuda:0")
    assert isinstance(triton_kernel, TritonPagedDecodeAttention)
    # a CPU cache stays on the C kernel or SDPA
    assert not triton_kernel.supports(torch.zeros(2, 16, 2, 64))
    assert paged_attention.decode_kernel_for("meta") is None


def test_an_unset_kv_cache_is_sized_from_available_memory(tiny):
    from engine.kv_cache import (
        AUTO_KV_MAX_BYTES,
        AUTO_KV_MIN_BYTES,
        _available_memory_bytes,
        auto_kv_cache_bytes,
    )

    size = auto_kv_cache_bytes()
    assert AUTO_KV_MIN_BYTES <= size <= AUTO_KV_MAX_BYTES
    # a tenth of what is available, read again here: other processes may have moved it a little
    expected = min(AUTO_KV_MAX_BYTES, max(AUTO_KV_MIN_BYTES, int(_available_memory_bytes() * 0.1)))
    assert abs(size - expected) <= 16 << 20
