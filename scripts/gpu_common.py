"""What the device check's sections share: the sizes each runs at, a device-aware clock and
timing."""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


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


FULL = Sizes(
    6,
    48,
    ("float32", "bfloat16"),
    "llama-3-8b",
    (128, 512, 1024, 4096),
    512,
    128,
    64,
    512,
    128,
    16 << 30,
    8192,
    ((64, 640), (1, 4096)),
    (1024, 8192),
    5,
)
QUICK = Sizes(
    1,
    6,
    ("float32",),
    "tiny",
    (16, 64),
    32,
    8,
    4,
    32,
    8,
    16 << 20,
    512,
    ((4, 40), (1, 200)),
    (64,),
    2,
)


class Clock:
    """Wall time that waits for the device first: CUDA work is asynchronous."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def time_call(fn: Callable[[], object], clock: Clock, repeats: int) -> float:
    fn()  # warm-up: compiles the Triton kernel on first use
    times = []
    for _ in range(max(3, repeats)):
        started = clock()
        fn()
        times.append(clock() - started)
    return statistics.median(times)
