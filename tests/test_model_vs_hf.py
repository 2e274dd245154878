"""The engine against HF transformers on the same fp32 weights (the reference implementation)."""

import pytest
import torch

from engine.kv_cache import KVLayout, PagedKVCache
from engine.llm_engine import EngineConfig, LLMEngine
from engine.model import ForwardBatch, PrefillSlice
from engine.sampling import SamplingParams

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a hash table is in one paragraph.",
    "Translate 'good morning' into Spanish and German.",
    "def fibonacci(n):\n    # complete this Python function",
]
LONG_TEXT = (
    "The history of computing is longer than the history of computing hardware and modern "
    "computing technology and includes the history of methods intended for pen and paper or for "
    "chalk and slate, with or without the aid of tables. Digital computing is intimately tied to "
    "the representation of numbers. But long before abstractions like the number arose, there "
    "were mathematical concepts to serve the purposes of civilization. These concepts are "
    "implicit in concrete practices such as one-to-one correspondence, the basis of counting, and "
    "comparison to a standard, used for measurement. "
) * 3


def _full_prefill_logits(loaded, token_ids, block_size=16):
    n = len(token_ids)
    layout = KVLayout.for_model(loaded.config, block_size, torch.float32)
    cache = PagedKVCache(layout, -(-n // block_size) + 1)
    # Scatter the sequence over non-consecutive blocks, the way a busy cache hands them out.
    blocks = torch.randperm(cache.num_blocks)[: -(-n // block_size)]
    positions = torch.arange(n)
    slots = blocks[positions // block_size] * block_size + positions % block_size
    batch = ForwardBatch(
        positions=positions, slot_mapping=slots, prefill_slices=[PrefillSlice(0, n, n, blocks)]
    )
    return loaded.model(torch.tensor(token_ids), batch, cache.k_caches, cache.v_caches)


def test_logits_match_hf_over_hundreds_of_positions(smollm_fp32, hf_smollm_fp32):
    ids = smollm_fp32.tokenizer.encode(LONG_TEXT)
    assert len(ids) >= 300
    ours = _full_prefill_logits(smollm_fp32, ids)
    with torch.no_grad():
        reference = hf_smollm_fp32(torch.tensor([ids])).logits[0].float()
    assert ours.shape == reference.shape
    assert (ours - reference).abs().max().item() <= 1e-3


@pytest.fixture(scope="module")
def engine_fp32(smollm_fp32):
    return LLMEngine(EngineConfig(dtype="float32", kv_cache_bytes=256 * 2**20), loaded=smollm_fp32)


def _hf_greedy(hf_model, prompt_ids, max_new_tokens, eos_ids):
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=list(eos_ids),
            pad_token_id=list(eos_ids)[0],
        )
    return out[0, len(prompt_ids) :].tolist()


def test_greedy_chat_outputs_are_token_identical_to_hf(engine_fp32, hf_smollm_fp32):
    tokenizer = engine_fp32.tokenizer
    prompts = [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in CHAT_PROMPTS]
    results = engine_fp32.generate(prompts, SamplingParams(max_tokens=48, temperature=0))
    for prompt_ids, result in zip(prompts, results):
        expected = _hf_greedy(hf_smollm_fp32, prompt_ids, 48, tokenizer.special.eos_token_ids)
        assert result.token_ids == expected, tokenizer.decode(prompt_ids)
    assert results[0].text.strip().startswith("The capital of France is Paris")
    assert engine_fp32.allocator.num_free_blocks == engine_fp32.allocator.num_blocks


def test_chunked_prefill_and_prefix_cache_give_the_same_tokens(smollm_fp32):
    ids = smollm_fp32.tokenizer.encode(LONG_TEXT)[:200]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    whole = LLMEngine(
        EngineConfig(max_num_batched_tokens=4096, enable_prefix_caching=False), loaded=smollm_fp32
    )
    expected = whole.generate([ids], params)[0].token_ids
    chunked = LLMEngine(EngineConfig(max_num_batched_tokens=48), loaded=smollm_fp32)
    assert chunked.generate([ids], params)[0].token_ids == expected
    # The second run of a prompt sharing a 192-token prefix reuses those blocks, and still agrees.
    longer = ids + smollm_fp32.tokenizer.encode(" And so it goes.")
    expected_longer = whole.generate([longer], params)[0].token_ids
    chunked.add_request("again", longer, params)
    outputs = list(chunked.run_until_done())
    assert outputs[0].num_cached_prompt_tokens == 192
    assert [o.new_token_ids[0] for o in outputs] == expected_longer
    assert chunked.allocator.num_free_blocks == chunked.allocator.num_blocks
