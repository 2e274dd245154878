"""Disaggregation at the engine level: prefill in one engine, move the KV, decode in another."""

import pytest
import torch

from engine.block_manager import OutOfBlocksError
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams


def _disaggregated(prefill, decode, prompt_ids, params, layer_groups=1):
    prefill.add_request("r", prompt_ids, params, hand_off_after_prefill=True)
    [first] = prefill.step()
    if first.finished:
        return first.new_token_ids
    assert first.handed_off and prefill.held_request_ids == ["r"]
    decode.reserve_kv("r", len(prompt_ids))
    layers = prefill.model_config.num_layers
    bounds = torch.linspace(0, layers, layer_groups + 1).long().tolist()
    for begin, end in zip(bounds, bounds[1:]):  # layer-wise, as a streaming transport would
        decode.import_kv("r", prefill.export_kv("r", slice(begin, end)), slice(begin, end))
    assert prefill.release_kv("r")  # the receiver acknowledged
    decode.start_decode("r", prompt_ids, first.new_token_ids[0], params)
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
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Give me two facts about octopuses."}])
    for params in (SamplingParams(max_tokens=32, temperature=0), SamplingParams(max_tokens=32, temperature=0.9, seed=11)):
        expected = single.generate([prompt], params)[0].token_ids
        assert _disaggregated(prefill, decode, prompt, params, layer_groups=3) == expected
    for engine in (single, prefill, decode):
        assert engine.allocator.num_free_blocks == engine.allocator.num_blocks


def test_reservations_and_held_kv_are_freed_by_abort_and_cancel():
    from engine.weights import load_model

    loaded = load_model("dummy:tiny", torch.float32)
    prefill = LLMEngine(EngineConfig(block_size_tokens=8), loaded=loaded)
    decode = LLMEngine(EngineConfig(block_size_tokens=8, kv_cache_bytes=4 * prefill.layout.bytes_per_block), loaded=loaded)
    prefill.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=4, temperature=0), hand_off_after_prefill=True)
    prefill.step()
    assert prefill.allocator.num_free_blocks < prefill.allocator.num_blocks
    assert prefill.abort("a") and prefill.allocator.num_free_blocks == prefill.allocator.num_blocks
    with pytest.raises(OutOfBlocksError):
        decode.reserve_kv("too-big", 40)  # 6 blocks of 8 needed, 4 exist
    decode.reserve_kv("b", 20)
    assert decode.allocator.num_free_blocks == 1
    assert decode.cancel_reservation("b") and not decode.cancel_reservation("b")
    assert decode.allocator.num_free_blocks == decode.allocator.num_blocks
