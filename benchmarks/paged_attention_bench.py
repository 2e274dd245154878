"""The CPU paged decode-attention kernel (engine/csrc/paged_attention.c) as built for this CPU
against its plain loops alone (built with -DPDSERVE_PLAIN_LOOPS), bf16 cache, SmolLM2-135M's heads
(9 query heads over 3 kv heads of 64), times 30 layers.

    python -m benchmarks.paged_attention_bench

With `--against OLD.c` (say `git show REV:engine/csrc/paged_attention.c > /tmp/old.c`), this tree's
kernel against that source's instead, as a decode step meets it: each of the 30 layers has its own
caches (3000 blocks of each, so nothing stays in the CPU's caches between layers), fp32 and bf16,
block tables shuffled or in order, one and two threads, the two kernels alternating.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

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


def against(old_source: Path) -> None:
    kernels = {
        "this tree": paged_attention.PagedDecodeAttention(paged_attention.build()),
        "against": paged_attention.PagedDecodeAttention(paged_attention.build(source=old_source)),
    }
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}; ms per 30 layers, median")
    generator = torch.Generator().manual_seed(0)
    total_blocks, block_size, context = 3000, 16, 540
    blocks = -(-context // block_size)  # per sequence
    for dtype in (torch.float32, torch.bfloat16):
        caches = [
            tuple(
                torch.randn(total_blocks, block_size, 3, 64, generator=generator).to(dtype)
                for _ in range(2)
            )
            for _ in range(LAYERS)
        ]
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for batch in (1, 4, 8):
                for order in ("shuffled", "in order"):
                    ids = (
                        torch.randperm(total_blocks, generator=generator)
                        if order == "shuffled"
                        else torch.arange(total_blocks)
                    )
                    q = torch.randn(batch, 9, 64, generator=generator)
                    tables = ids[: batch * blocks].view(batch, blocks).contiguous()
                    lens = torch.full((batch,), context, dtype=torch.long)
                    times = {name: [] for name in kernels}
                    for _ in range(12):
                        for name, kernel in kernels.items():
                            start = time.perf_counter()
                            for k_cache, v_cache in caches:
                                kernel(q, k_cache, v_cache, tables, lens, 0.125)
                            times[name].append(time.perf_counter() - start)
                    ms = {name: statistics.median(t[2:]) * 1000 for name, t in times.items()}
                    print(
                        f"{str(dtype)[6:]}, {threads} thread(s), batch {batch}, blocks {order}: "
                        + ", ".join(f"{name} {value:.2f}" for name, value in ms.items())
                        + f" ({ms['against'] / ms['this tree']:.2f}x)"
                    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--against", type=Path, help="another paged_attention.c to time against")
    args = parser.parse_args()
    if args.against:
        against(args.against)
        return
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
