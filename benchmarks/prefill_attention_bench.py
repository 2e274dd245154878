"""A bf16 prompt's attention on CPU, by kernel, over a model's layers: the blocked matmuls, SDPA's
causal flash kernel (nothing cached), the flash kernel merged with a cached context, and with AMX
tiles or AVX512-BF16 the C flash-attention kernel (engine/model.py, engine/prefill_attention.py).
`--engine` times instead the whole prefill of one prompt through LLMEngine with the C kernel off
(the torch path) and on.

    python -m benchmarks.prefill_attention_bench [--tokens 512 1024 2048] [--cached 16]
    python -m benchmarks.prefill_attention_bench --engine [--tokens 526] [--cached 16]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F

import engine.model
from engine import prefill_attention
from engine.model import Attention
from engine.prefill_attention import load_prefill_kernel


class _Shape:  # SmolLM2-135M's attention
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    q_size = num_heads * head_dim


def _attention() -> Attention:
    attention = Attention.__new__(Attention)
    torch.nn.Module.__init__(attention)
    attention.config, attention.scale = _Shape, _Shape.head_dim**-0.5
    return attention


def _median_s(fn, repeats: int = 30, warmups: int = 3) -> float:
    for _ in range(warmups):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def attention_alone(tokens: list[int], cached: int, layers: int) -> None:
    attention, s = _attention(), _Shape
    kernel = load_prefill_kernel()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for n in tokens:
            for num_cached in sorted({0, cached}):
                q = torch.randn(n, s.num_heads, s.head_dim).bfloat16()
                k = torch.randn(num_cached + n, s.num_kv_heads, s.head_dim).bfloat16()
                v = torch.randn(num_cached + n, s.num_kv_heads, s.head_dim).bfloat16()
                kernels = {"blocked": lambda: attention._blocked_attention(q, k, v)}
                if num_cached:
                    kernels["flash after context"] = lambda: (
                        attention._flash_after_context_attention(q, k, v)
                    )
                else:
                    kernels["sdpa flash"] = lambda: F.scaled_dot_product_attention(
                        *(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
                        is_causal=True,
                        enable_gqa=True,
                    )
                if kernel is not None:
                    kernels[f"{kernel.kind.name} flash"] = lambda: (
                        attention._kernel_flash_attention(q, k, v)
                    )
                times = {
                    name: f"{_median_s(fn) * layers * 1000:.1f} ms" for name, fn in kernels.items()
                }
                print(
                    f"{threads} thread(s), {n} tokens after {num_cached}, {layers} layers: {times}"
                )


def whole_prefill(new_tokens: int, cached: int) -> None:
    """One prompt of `cached + new_tokens` tokens whose first `cached` (a shared prefix) hit the
    prefix cache: the prefill step's median of 6 after 3 warm-ups, the C kernel off and on."""
    from engine.config import EngineConfig
    from engine.dtypes import parse_dtype
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from engine.weights import load_model

    loaded = load_model("default", parse_dtype("bfloat16"))
    vocab = loaded.config.vocab_size
    rng = random.Random(0)
    prefix = [rng.randrange(100, vocab) for _ in range(cached)]
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    c_kernel = load_prefill_kernel()
    for threads in (1, 2):
        llm = LLMEngine(
            EngineConfig(
                model="default",
                dtype="bfloat16",
                num_threads=threads,
                enable_prefix_caching=True,
                block_size_tokens=16,
                kv_cache_bytes=256 << 20,
                max_num_seqs=16,
            ),
            loaded,
        )
        counter = iter(range(10**6))

        def prefill() -> None:
            request_id = str(next(counter))
            prompt = prefix + [rng.randrange(100, vocab) for _ in range(new_tokens)]
            llm.add_request(request_id, prompt, params)
            while not llm.step():
                pass

        for name, kernel in (("torch path", None), ("C kernel", c_kernel)):
            engine.model.load_prefill_kernel = lambda kernel=kernel: kernel
            try:
                ms = _median_s(prefill, repeats=6) * 1000
            finally:
                engine.model.load_prefill_kernel = load_prefill_kernel
            shape = f"prefill of {cached} cached + {new_tokens} new tokens"
            print(f"{threads} thread(s), {shape}, {name}: {ms:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512])
    parser.add_argument("--cached", type=int, default=16)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--engine", action="store_true", help="time the whole prefill instead")
    args = parser.parse_args()
    capability = torch.backends.cpu.get_cpu_capability()
    kind = prefill_attention.kernel_kind()
    print(f"cpu capability {capability}, C kernel {kind.name if kind else None}")
    if args.engine:
        for n in args.tokens:
            whole_prefill(n, args.cached)
    else:
        attention_alone(args.tokens, args.cached, args.layers)


if __name__ == "__main__":
    main()
