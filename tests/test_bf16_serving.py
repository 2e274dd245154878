"""bf16 end to end (the dtype the benchmarks serve): a disaggregated system (1 prefill + 1 decode, ray
transport) gives the single-process bf16 engine's greedy tokens for the same prompt token ids."""

import pytest
import torch

from engine.kv_cache import KVLayout
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams

QUESTIONS = ["What is the capital of France?", "Name a colour.", "Count to five."]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def expected():
    """Each prompt alone through the engine (batch of one, as the system below serves them), one thread."""
    engine = LLMEngine(EngineConfig(model="default", dtype="bfloat16", num_threads=1, kv_cache_bytes=16 << 20))
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    layout = KVLayout.for_model(engine.model_config, engine.config.block_size_tokens, torch.bfloat16)
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
            served = client.generate(client.request(token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0))
            assert len(reference.token_ids) > 1  # tokens from the decode worker too, not only the prefill's first
            assert served.token_ids == reference.token_ids, prompt
            assert served.text == reference.text and served.finish_reason == reference.finish_reason
            assert served.prefill_worker == "prefill-0" and served.decode_worker == "decode-0"
            # The prompt's KV went across in bf16: all of it the first time; later, only the blocks after the
            # chat template's system prompt, which the decode worker holds by then (prefix routing).
            blocks = -(-len(prompt) // layout.block_size_tokens)
            shipped, whole = served.timings.kv_bytes, blocks * layout.bytes_per_block
            assert shipped == whole if prompt is references[0][0] else 0 < shipped < whole
            assert shipped % layout.bytes_per_block == 0
    stats = bf16_system.wait_idle()
    assert all(w.kv_blocks_free == w.kv_blocks_total for w in stats.workers)
