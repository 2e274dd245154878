"""A bf16 prompt's attention on CPU, by kernel, over a model's layers: the blocked matmuls, SDPA's causal
flash kernel (nothing cached) and the flash kernel merged with a cached context (engine/model.py).

    python -m benchmarks.prefill_attention_bench [--tokens 512] [--cached 16] [--layers 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from engine.model import Attention


class _Shape:  # SmolLM2-135M's attention
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    q_size = num_heads * head_dim


def _attention() -> Attention:
    attention = Attention.__new__(Attention)
    torch.nn.Module.__init__(attention)
    attention.config, attention.scale = _Shape, _Shape.head_dim**-0.5
    return attention


def _median_s(fn, repeats: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--cached", type=int, default=16)
    parser.add_argument("--layers", type=int, default=30)
    args = parser.parse_args()
    attention, s = _attention(), _Shape
    print(
        f"cpu capability {torch.backends.cpu.get_cpu_capability()}, AMX {torch.cpu._is_amx_tile_supported()}"
    )
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for cached in sorted({0, args.cached}):
            q = torch.randn(args.tokens, s.num_heads, s.head_dim).bfloat16()
            k = torch.randn(cached + args.tokens, s.num_kv_heads, s.head_dim).bfloat16()
            v = torch.randn(cached + args.tokens, s.num_kv_heads, s.head_dim).bfloat16()
            kernels = {"blocked": lambda: attention._blocked_attention(q, k, v)}
            if cached:
                kernels["flash after context"] = lambda: attention._flash_after_context_attention(
                    q, k, v
                )
            else:
                kernels["sdpa flash"] = lambda: F.scaled_dot_product_attention(
                    *(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
                    is_causal=True,
                    enable_gqa=True,
                )
            times = {
                name: f"{_median_s(fn) * args.layers * 1000:.1f} ms" for name, fn in kernels.items()
            }
            print(
                f"{threads} thread(s), {args.tokens} tokens after {cached}, {args.layers} layers: {times}"
            )


if __name__ == "__main__":
    main()
