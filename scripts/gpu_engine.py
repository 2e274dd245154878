"""The device check's engine sections: greedy tokens against HF transformers (`correctness`) and the
engine's speed beside HF's `generate` on the same weights (`engine_speed`)."""

from __future__ import annotations

import dataclasses
import math
import statistics
import traceback
from pathlib import Path

import torch

from gpu_common import Clock, Sizes

CHAT_PROMPTS = [  # tests/test_model_vs_hf.py
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a hash table is in one paragraph.",
    "Translate 'good morning' into Spanish and German.",
    "def fibonacci(n):\n    # complete this Python function",
]


# -- correctness ---------------------------------------------------------------------------------


def _hf_from_gguf(path: Path, dtype: torch.dtype, device: str):
    from tests.hf_reference import hf_model

    return hf_model(path, dtype).to(device)  # transformers' own reading of the file, converted once


def _hf_greedy(
    model, prompt_ids: list[int], max_new_tokens: int, eos_ids, device: str
) -> list[int]:
    ids = torch.tensor([prompt_ids], device=device)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=list(eos_ids),
            pad_token_id=list(eos_ids)[0],
        )
    return out[0, len(prompt_ids) :].tolist()


def _agreement(ours: list[int], reference: list[int]) -> float:
    """The share of the reference's tokens matched before the first difference."""
    same = next(
        (i for i, (a, b) in enumerate(zip(ours, reference)) if a != b),
        min(len(ours), len(reference)),
    )
    return same / max(1, len(reference))


def check_correctness(device: str, sizes: Sizes) -> dict:
    from engine.default_model import default_model_path
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=sizes.chat_tokens, temperature=0)
    hf = _hf_from_gguf(default_model_path(), torch.float32, device)
    result = {"prompts": sizes.chat_prompts, "max_tokens": sizes.chat_tokens}
    for dtype in sizes.chat_dtypes:
        engine = LLMEngine(EngineConfig(dtype=dtype, device=device, kv_cache_bytes=256 << 20))
        tokenizer = engine.tokenizer
        prompts = [
            tokenizer.encode_chat([{"role": "user", "content": text}])
            for text in CHAT_PROMPTS[: sizes.chat_prompts]
        ]
        ours = [r.token_ids for r in engine.generate(prompts, params)]
        graphs = engine.runner.graphs is not None
        if graphs and dtype == "float32":  # the same engine without CUDA graphs: the same tokens?
            eager = LLMEngine(
                EngineConfig(
                    dtype=dtype, device=device, kv_cache_bytes=256 << 20, cuda_graphs=False
                )
            )
            result["fp32_graphs_identical_to_eager"] = [
                r.token_ids for r in eager.generate(prompts, params)
            ] == ours
            del eager
        if dtype == "bfloat16":
            hf = hf.to(torch.bfloat16)
        theirs = [
            _hf_greedy(hf, p, sizes.chat_tokens, tokenizer.special.eos_token_ids, device)
            for p in prompts
        ]
        result[dtype] = {
            "token_identical": sum(a == b for a, b in zip(ours, theirs)),
            "agreement": statistics.fmean(_agreement(a, b) for a, b in zip(ours, theirs)),
            "first_answer": tokenizer.decode(ours[0])[:80],
            "cuda_graphs": graphs,
        }
        del engine
    result["fp32_identical_to_hf"] = result["float32"]["token_identical"] == sizes.chat_prompts
    return result


# -- engine speed, beside HF transformers ----------------------------------------------------------


def _random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab - 1, (count, length), generator=generator).tolist()


def _hf_twin(loaded, dtype: torch.dtype, device: str):
    """HF's LlamaForCausalLM holding the same weights as an engine model (ours fuses q/k/v and
    gate/up)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = loaded.config
    hf_config = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_context_tokens,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_word_embeddings,
        attention_bias=c.attention_bias,
    )
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(hf_config)
    finally:
        torch.set_default_dtype(default_dtype)
    state = {}
    for name, tensor in loaded.model.state_dict().items():
        if name.endswith(".weight_t"):  # an fp32 CPU model's TransposedLinear (engine.cpu_packing)
            name, tensor = name.removesuffix("_t"), tensor.t()
        if ".qkv_proj." in name:
            for part, piece in zip("qkv", tensor.split((c.q_size, c.kv_size, c.kv_size))):
                state["model." + name.replace("qkv_proj", f"{part}_proj")] = piece
        elif ".gate_up_proj." in name:
            for part, piece in zip(("gate", "up"), tensor.chunk(2)):
                state["model." + name.replace("gate_up_proj", f"{part}_proj")] = piece
        elif name.startswith("lm_head"):
            state[name] = tensor
        elif "rotary" not in name:
            state["model." + name] = tensor
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [
        m
        for m in missing
        if "rotary" not in m and not (c.tie_word_embeddings and m.startswith("lm_head"))
    ]:
        raise RuntimeError(f"HF twin: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return model.eval()


def _engine_speed(engine, sizes: Sizes, vocab: int, clock: Clock) -> dict:
    from engine.sampling import SamplingParams

    def ttft(length: int, seed: int) -> float:
        engine.add_request(
            f"ttft-{length}-{seed}",
            _random_prompts(1, length, vocab, seed)[0],
            SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
        )
        started = clock()
        list(engine.run_until_done())
        return clock() - started

    # decode's first steps compile kernels
    engine.add_request(
        "warm-up",
        _random_prompts(1, 64, vocab, 0)[0],
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
    )
    list(engine.run_until_done())
    result = {"ttft_ms": {}, "cuda_graphs": engine.runner.graphs is not None}
    for length in sizes.ttft_prompt_tokens:
        # warm-up of this shape (kernels, allocator); distinct prompts: no prefix-cache hits
        ttft(length, seed=1)
        result["ttft_ms"][length] = (
            statistics.median(ttft(length, seed=2 + r) for r in range(sizes.repeats)) * 1e3
        )
    engine.add_request(
        "stream",
        _random_prompts(1, sizes.stream_prompt_tokens, vocab, 100)[0],
        SamplingParams(max_tokens=sizes.stream_output_tokens, temperature=0, ignore_eos=True),
    )
    stamps = []
    for _ in engine.run_until_done():
        stamps.append(clock())
    result["tpot_ms"] = (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3
    prompts = _random_prompts(sizes.batch_requests, sizes.batch_prompt_tokens, vocab, 200)
    params = SamplingParams(max_tokens=sizes.batch_output_tokens, temperature=0, ignore_eos=True)
    started = clock()
    done = engine.generate(prompts, params)
    elapsed = clock() - started
    result["batch_output_tok_s"] = sum(len(r.token_ids) for r in done) / elapsed
    result["batch_s"] = elapsed
    return result


def _hf_speed(model, sizes: Sizes, vocab: int, device: str, clock: Clock) -> dict:
    def generate(prompts: list[list[int]], new_tokens: int) -> float:
        ids = torch.tensor(prompts, device=device)
        started = clock()
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        return clock() - started

    result = {"ttft_ms": {}}
    for length in sizes.ttft_prompt_tokens:
        generate(_random_prompts(1, length, vocab, 1), 1)
        result["ttft_ms"][length] = (
            statistics.median(
                generate(_random_prompts(1, length, vocab, 2 + r), 1) for r in range(sizes.repeats)
            )
            * 1e3
        )
    stream = _random_prompts(1, sizes.stream_prompt_tokens, vocab, 100)
    first = generate(stream, 1)
    whole = generate(stream, sizes.stream_output_tokens)
    result["tpot_ms"] = (whole - first) / (sizes.stream_output_tokens - 1) * 1e3
    elapsed = generate(
        _random_prompts(sizes.batch_requests, sizes.batch_prompt_tokens, vocab, 200),
        sizes.batch_output_tokens,
    )
    result["batch_output_tok_s"] = sizes.batch_requests * sizes.batch_output_tokens / elapsed
    result["batch_s"] = elapsed
    return result


def check_engine_speed(device: str, sizes: Sizes, dtype_name: str) -> dict:
    from engine.dtypes import parse_dtype
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.weights import load_model

    dtype = parse_dtype(dtype_name, device)
    clock = Clock(device)
    started = clock()
    loaded = load_model("dummy:" + sizes.speed_model, dtype, device)
    config = EngineConfig(
        model="dummy:" + sizes.speed_model,
        dtype=dtype_name,
        device=device,
        kv_cache_bytes=sizes.kv_cache_bytes,
        max_num_seqs=max(64, sizes.batch_requests),
        max_num_batched_tokens=sizes.max_num_batched_tokens,
    )
    kernel = loaded.model.layers[0].self_attn.decode_kernel
    result = {
        "model": config.model,
        "dtype": str(dtype).removeprefix("torch."),
        "load_s": clock() - started,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "decode_attention": type(kernel).__name__ if kernel is not None else "gather + SDPA",
    }
    vocab = loaded.config.vocab_size
    # On CUDA the engine runs twice: with CUDA graphs (the default) and without (--enforce-eager).
    runs = (
        (("pdserve", True), ("pdserve_eager", False))
        if device.startswith("cuda")
        else (("pdserve", True),)
    )
    for label, graphs in runs:
        try:
            started = clock()
            engine = LLMEngine(dataclasses.replace(config, cuda_graphs=graphs), loaded=loaded)
            start_s = clock() - started
            result[label] = {
                "engine_start_s": start_s,
                **_engine_speed(engine, sizes, vocab, clock),
            }
            del engine
        except Exception as error:  # the other run's figures still stand
            result[label] = {
                "error": f"{type(error).__name__}: {error}",
                "traceback": traceback.format_exc()[-2000:],
            }
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    eager = result.get("pdserve_eager")
    # graphs failed: report eager
    if "error" in result["pdserve"] and eager is not None and "error" not in eager:
        result["pdserve_graphs_failed"], result["pdserve"] = (
            result["pdserve"],
            result.pop("pdserve_eager"),
        )
    try:
        hf = _hf_twin(loaded, dtype, device)
        result["hf_transformers"] = _hf_speed(hf, sizes, vocab, device, clock)
        ours, theirs = result["pdserve"], result["hf_transformers"]
        result["ratio_vs_hf"] = {
            "ttft_at_max_prompt": theirs["ttft_ms"][sizes.ttft_prompt_tokens[-1]]
            / ours["ttft_ms"][sizes.ttft_prompt_tokens[-1]],
            "tpot": theirs["tpot_ms"] / ours["tpot_ms"],
            "batch_output_tok_s": ours["batch_output_tok_s"] / theirs["batch_output_tok_s"],
        }
    except Exception as error:  # the engine's figures stand without the comparison
        result["hf_transformers"] = {"error": f"{type(error).__name__}: {error}"}
    if device.startswith("cuda"):
        result["targets"] = {
            "ttft_1k_under_500_ms": result["pdserve"]["ttft_ms"].get(1024, math.inf) < 500,
            "tpot_under_50_ms": result["pdserve"]["tpot_ms"] < 50,
            "at_least_1000_output_tok_s": result["pdserve"]["batch_output_tok_s"] >= 1000,
        }
    return result
