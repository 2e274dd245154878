"""The CPU paged decode-attention kernel (engine/csrc/paged_attention.c) as built for this CPU
against its plain loops alone (built with -DPDSERVE_PLAIN_LOOPS), bf16 cache, SmolLM2-135M's heads
(9 query heads over 3 kv heads of 64), times 30 layers.

    python -m benchmarks.paged_attention_bench
"""

from __future__ import annotations

import statistics
import time

import torch

from engine import paged_attention

CASES = ((1, 600), (3, 600), (8, 600), (16, 300))  # (batch, context tokens)
LAYERS = 30


def _median_s(kernel, args, repeats: int = 60) -> float:
    for _ in range(5):
        kernel(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        kernel(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    built = paged_attention.PagedDecodeAttention(paged_attention.build())
    plain = paged_attention.PagedDecodeAttention(
        paged_attention.build(extra_flags=("-DPDSERVE_PLAIN_LOOPS",))
    )
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}")
    generator = torch.Generator().manual_seed(0)
    for batch, context in CASES:
        block_size, blocks = 16, -(-context // 16)
        k_cache = torch.randn(batch * blocks + 4, block_size, 3, 64, generator=generator).bfloat16()
        v_cache = torch.randn(k_cache.shape, generator=generator).bfloat16()
        tables = torch.randperm(batch * blocks + 4, generator=generator)[: batch * blocks]
        args = (
            torch.randn(batch, 9, 64, generator=generator),
            k_cache,
            v_cache,
            tables.view(batch, blocks).long(),
            torch.full((batch,), context, dtype=torch.long),
            0.125,
        )
        difference = (built(*args) - plain(*args)).abs().max().item()
        for threads in (1, 2):
            torch.set_num_threads(threads)
            times = {
                name: f"{_median_s(kernel, args) * LAYERS * 1000:.2f} ms"
                for name, kernel in (("built", built), ("plain loops", plain))
            }
            print(
                f"batch {batch}, context {context}, {threads} thread(s), {LAYERS} layers: {times} "
                f"(largest difference {difference:.1e})"
            )


if __name__ == "__main__":
    main()
