"""Disaggregation at the engine level: prefill in one engine, move the KV, decode in another."""

import pytest
import torch

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams


def _disaggregated(prefill, decode, prompt_ids, params, layer_groups=1):
    prefill.add_request("r", prompt_ids, params, hand_off_after_prefill=True)
    [first] = prefill.step()
    if first.finished:
        return first.new_token_ids
    assert first.handed_off and prefill.held_request_ids == ["r"]
    reserved = decode.allocator.allocate(decode.allocator.blocks_needed(len(prompt_ids)))
    layers = prefill.model_config.num_layers
    bounds = torch.linspace(0, layers, layer_groups + 1).long().tolist()
    for begin, end in zip(bounds, bounds[1:]):  # layer-wise, as a streaming transport would
        decode.kv_cache.import_blocks(
            reserved, prefill.export_kv("r", slice(begin, end)), slice(begin, end)
        )
    assert prefill.release_kv("r")  # the receiver acknowledged
    decode.start_decode("r", prompt_ids, first.new_token_ids[0], params, reserved)
    tokens = list(first.new_token_ids)
    for output in decode.run_until_done():
        tokens += output.new_token_ids
    return tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_here_decode_there_equals_one_engine(smollm_fp32, dtype):
    from engine.weights import load_model

    loaded = smollm_fp32 if dtype == "float32" else load_model("default", torch.bfloat16)
    config = EngineConfig(dtype=dtype, kv_cache_bytes=32 * 2**20)
    single, prefill, decode = (LLMEngine(config, loaded=loaded) for _ in range(3))
    tokenizer = single.tokenizer
    prompt = tokenizer.encode_chat(
        [{"role": "user", "content": "Give me two facts about octopuses."}]
    )
    for params in (
        SamplingParams(max_tokens=32, temperature=0),
        SamplingParams(max_tokens=32, temperature=0.9, seed=11),
    ):
        expected = single.generate([prompt], params)[0].token_ids
        assert _disaggregated(prefill, decode, prompt, params, layer_groups=3) == expected
    for engine in (single, prefill, decode):
        assert engine.allocator.num_free_blocks == engine.allocator.num_blocks


def test_held_kv_is_freed_by_abort_or_handed_over_by_detach():
    from engine.weights import load_model

    loaded = load_model("dummy:tiny", torch.float32)
    prefill = LLMEngine(EngineConfig(block_size_tokens=8), loaded=loaded)
    for request_id in ("a", "b"):
        prefill.add_request(
            request_id,
            list(range(3, 40)),
            SamplingParams(max_tokens=4, temperature=0),
            hand_off_after_prefill=True,
        )
    prefill.step()
    assert sorted(prefill.held_request_ids) == ["a", "b"]
    assert prefill.abort("a") and not prefill.abort("a")
    blocks = prefill.detach_kv("b")
    assert len(blocks) == 5 and prefill.held_request_ids == []
    assert prefill.allocator.num_free_blocks == prefill.allocator.num_blocks - 5
    prefill.allocator.free(blocks)  # what the sender does once the receiver acknowledged
    assert prefill.allocator.num_free_blocks == prefill.allocator.num_blocks
