"""The whole system with `--transport rdt` (Ray Direct Transport over gloo): real prefill and decode
actors in one collective group, the prefill worker handing KV deliveries to the decode worker
directly; greedy output equals the single-process engine."""

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from pdserve.system import ServeConfig

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three rivers in Europe.",
]


@pytest.fixture(scope="module")
def expected(smollm_fp32):
    engine = LLMEngine(EngineConfig(kv_cache_bytes=32 << 20), loaded=smollm_fp32)
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    results = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0))
    return {q: r for q, r in zip(QUESTIONS, results)}


def _chat_all(system, questions, **sampling):
    with ThreadPoolExecutor(len(questions)) as pool:
        return list(pool.map(lambda q: system.client().chat(q, **sampling), questions))


def test_rdt_two_by_two_serves_concurrent_streams_identically(harness, expected):
    system = harness.start(transport="rdt", num_prefill=2, num_decode=2)
    try:
        questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(12)]
        completions = _chat_all(system, questions, max_tokens=12, temperature=0)
        for question, completion in zip(questions, completions):
            assert completion.token_ids == expected[question].token_ids[:12]
        stats = system.wait_idle()
        served = {w.worker_id: w.requests_served for w in stats.workers}
        # both prefill workers shipped KV, both decode workers pulled it
        assert all(served.values()), served
        assert all(w.kv_blocks_free == w.kv_blocks_total for w in stats.workers)
    finally:
        system.stop()


@pytest.fixture(scope="module")
def system(harness):
    running = harness.start(transport="rdt")
    yield running
    running.stop()


def test_rdt_greedy_outputs_equal_the_engine(system, expected):
    completions = _chat_all(system, QUESTIONS, max_tokens=32, temperature=0)
    for question, completion in zip(QUESTIONS, completions):
        assert completion.token_ids == expected[question].token_ids
        assert completion.text == expected[question].text
        assert completion.prefill_worker == "prefill-0" and completion.decode_worker == "decode-0"
        assert completion.timings.kv_bytes > 0
    stats = system.wait_idle()
    assert stats.transport == "rdt"
    assert all(w.kv_blocks_free == w.kv_blocks_total for w in stats.workers)


def test_rdt_a_later_turn_ships_only_the_blocks_after_the_reused_history(system, smollm_fp32):
    tokenizer = smollm_fp32.tokenizer
    block_bytes = system.system.router.decode_pool.workers[0].info.kv_block_bytes
    prompt = tokenizer.encode(
        "You are a patient tutor of river history. " * 6 + "Why did towns grow at fords?"
    )
    first = _turn(system, prompt)
    assert first.timings.kv_bytes == -(-len(prompt) // 16) * block_bytes
    new = list(first.token_ids) + tokenizer.encode(" And at river mouths?")
    prompt = prompt + new
    turn = _turn(system, prompt)
    assert turn.prefill_worker and turn.decode_worker == first.decode_worker
    # the reused blocks stay where they are
    assert turn.timings.kv_bytes <= (-(-len(new) // 16) + 1) * block_bytes
    engine = LLMEngine(EngineConfig(dtype="float32", kv_cache_bytes=32 << 20), loaded=smollm_fp32)
    cold = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[
        0
    ]
    assert list(turn.token_ids) == list(cold.token_ids)
    assert all(w.kv_blocks_free == w.kv_blocks_total for w in system.wait_idle().workers)


def test_rdt_refuses_to_add_workers_to_its_group(system):
    with system.client() as client, pytest.raises(grpc.RpcError) as refused:
        client.scale(decode=2)
    assert (
        refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        and "rdt" in refused.value.details()
    )


def _turn(system, prompt_ids, max_tokens: int = 10):
    with system.client() as client:
        return client.generate(
            client.request(
                token_ids=prompt_ids, max_tokens=max_tokens, temperature=0, ignore_eos=True
            )
        )


def test_rdt_refuses_autoscaling_at_configuration():
    from router.pools import AutoscaleConfig

    with pytest.raises(ValueError, match="rdt transport's workers are fixed"):
        ServeConfig(transport="rdt", autoscale=AutoscaleConfig())
