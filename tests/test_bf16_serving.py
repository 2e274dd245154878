"""bf16 end to end (the dtype the benchmarks serve): a disaggregated system (1 prefill + 1 decode,
ray transport) gives the single-process bf16 engine's greedy tokens for the same prompt token
ids."""

import time

import pytest
import torch

from engine.kv_cache import KVLayout
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams

QUESTIONS = ["What is the capital of France?", "Name a colour.", "Count to five."]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def expected():
    """Each prompt alone through the engine (batch of one, as the system below serves them), one
    thread."""
    engine = LLMEngine(
        EngineConfig(model="default", dtype="bfloat16", num_threads=1, kv_cache_bytes=16 << 20)
    )
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    layout = KVLayout.for_model(
        engine.model_config, engine.config.block_size_tokens, torch.bfloat16
    )
    return layout, [(prompt, engine.generate([prompt], params)[0]) for prompt in prompts]


@pytest.fixture(scope="module")
def bf16_system(harness):
    system = harness.start(dtype="bfloat16", transport="ray", num_prefill=1, num_decode=1)
    yield system
    system.stop()


def test_bf16_system_equals_the_bf16_engine(bf16_system, expected):
    layout, references = expected
    with bf16_system.client() as client:
        for prompt, reference in references:
            served = client.generate(
                client.request(token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0)
            )
            # tokens from the decode worker too, not only the prefill's first
            assert len(reference.token_ids) > 1
            assert served.token_ids == reference.token_ids, prompt
            assert served.text == reference.text and served.finish_reason == reference.finish_reason
            assert served.prefill_worker == "prefill-0" and served.decode_worker == "decode-0"
            # The prompt's KV went across in bf16: all of it the first time; later, only the blocks
            # after the chat template's system prompt, which the decode worker holds by then (prefix
            # routing).
            blocks = -(-len(prompt) // layout.block_size_tokens)
            shipped, whole = served.timings.kv_bytes, blocks * layout.bytes_per_block
            assert shipped == whole if prompt is references[0][0] else 0 < shipped < whole
            assert shipped % layout.bytes_per_block == 0
    stats = bf16_system.wait_idle()
    assert all(w.kv_blocks_free == w.kv_blocks_total for w in stats.workers)


@pytest.fixture(scope="module")
def bf16_pair(harness):
    """1 prefill + 2 decode workers in bf16 over grpc: a decode worker dies, the other takes the
    stream."""
    system = harness.start(dtype="bfloat16", transport="grpc", num_prefill=1, num_decode=2)
    yield system
    system.stop()


def test_a_bf16_stream_whose_decode_worker_dies_continues_from_exactly_the_tokens_sent(bf16_pair):
    """bf16's guarantee (docs/reliability.md): greedy tokens depend on the batch a request shares,
    so a migrated stream need not equal an unfaulted run's. What holds: the client gets every token
    once, in order, with none repeated or missing, and what follows the cut is the greedy
    continuation of the prompt plus the tokens already sent (what the single-process bf16 engine
    gives for that, alone)."""
    import ray

    from tests.test_faults import MAX_TOKENS as FAULT_MAX_TOKENS, PROMPT, _Stream, _wait_healed

    router = bf16_pair.system.router
    migrations_before = router.stats().migrations
    stream = _Stream(bf16_pair, "bf16-decode-killed")
    deadline = time.monotonic() + 60
    while len(stream.tokens) < 5:
        assert time.monotonic() < deadline and stream.ended_s is None, (
            "the request never reached decode"
        )
        time.sleep(0.005)
    victim = router.route_of("bf16-decode-killed").decode
    sent_before_kill = len(stream.tokens)
    ray.kill(victim.actor, no_restart=True)
    stream.join()
    assert stream.error is None, stream.error
    assert router.stats().migrations == migrations_before + 1
    # ignore_eos: every token once, none missing or repeated
    assert len(stream.tokens) == FAULT_MAX_TOKENS
    assert stream.final.decode_worker != victim.worker_id

    config = EngineConfig(model="default", dtype="bfloat16", num_threads=1, kv_cache_bytes=16 << 20)
    loaded = LLMEngine(config).loaded
    prompt = loaded.tokenizer.encode(PROMPT)
    # The router cut the stream at the tokens it had received when the worker died: at least those
    # the client had seen, at most a few more that were on their way. It re-prefilled prompt + those
    # tokens on the prefill worker, which held the prompt's blocks from the first prefill (bf16
    # rounds a prefix read from the cache otherwise than one computed in the same pass): the
    # reference does the same.
    continuations = []
    for cut in range(sent_before_kill, min(sent_before_kill + 8, FAULT_MAX_TOKENS)):
        engine = LLMEngine(config, loaded=loaded)
        engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
        rest = engine.generate(
            [prompt + stream.tokens[:cut]],
            SamplingParams(max_tokens=FAULT_MAX_TOKENS - cut, temperature=0, ignore_eos=True),
        )[0].token_ids
        continuations.append(cut)
        if list(rest) == stream.tokens[cut:]:
            break
    else:
        raise AssertionError(
            f"no cut in {continuations} continues greedily into what the client got"
        )
    _wait_healed(bf16_pair)
