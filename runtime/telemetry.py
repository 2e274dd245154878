"""GPU telemetry through NVML (pynvml, from the nvidia-ml-py package): memory and utilisation of the
GPUs this process may use. On a machine without a GPU or driver it reports none, with the reason,
and never raises. No torch: the router may import it. And the load report both workers answer
with."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable

from engine import kernels
from protocol.messages import GpuStats, WorkerLoad


@functools.cache
def _nvml() -> tuple[Any, str]:
    """The initialised pynvml module, or None and why not (looked up once per process)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml, ""
    except Exception as error:  # no library, no driver, no device: all mean "no GPU" here
        return None, f"no GPU ({type(error).__name__}: {error})"


def rss_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 where that is unavailable)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _visible_indices(count: int) -> list[int]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(count))
    return [int(v) for v in visible.split(",") if v.strip().isdigit() and int(v) < count]


def gpu_stats() -> tuple[tuple[GpuStats, ...], str]:
    """(stats of each visible GPU, "") or ((), the reason there are none)."""
    nvml, reason = _nvml()
    if nvml is None:
        return (), reason
    try:
        stats = []
        for index in _visible_indices(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            utilization = nvml.nvmlDeviceGetUtilizationRates(handle)
            name = nvml.nvmlDeviceGetName(handle)
            stats.append(
                GpuStats(
                    index,
                    name.decode() if isinstance(name, bytes) else name,
                    int(memory.used),
                    int(memory.total),
                    utilization.gpu / 100.0,
                )
            )
    except Exception as error:
        return (), f"GPU telemetry failed ({type(error).__name__}: {error})"
    return tuple(stats), "" if stats else "no GPU visible to this worker"


async def load_report(
    worker_id: str,
    loop,
    served: Callable[[], int],
    waiting_outside_engine: Callable[[], int] = lambda: 0,
) -> WorkerLoad:
    """A worker's `load()`: its engine's queues and KV taken on the engine thread (`loop`: an
    `EngineLoop`), NVML and RSS read here (NVML calls take a while)."""

    def snapshot() -> WorkerLoad:
        scheduler, allocator = loop.engine.scheduler, loop.engine.allocator
        return WorkerLoad(
            worker_id,
            len(scheduler.running),
            len(scheduler.waiting) + waiting_outside_engine(),
            allocator.num_free_blocks,
            allocator.num_blocks,
            served(),
            loop.max_batch_size_seen,
            loop.decode_steps,
            loop.decode_steps_s,
            loop.cores.borrowed_steps if loop.cores else 0,
            loop.cores.owner_waits_s if loop.cores else 0.0,
            loop.cores.lent_pauses if loop.cores else 0,
            loop.cores.lent_pauses_s if loop.cores else 0.0,
        )

    gpus, gpu_note = gpu_stats()
    return dataclasses.replace(
        await loop.call(snapshot),
        gpus=gpus,
        gpu_note=gpu_note,
        rss_bytes=rss_bytes(),
        kernels=kernels.summary(),
    )
