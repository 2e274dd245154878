"""`pdserve profile`: the costs the simulator needs, measured with the engine and transports
themselves.

- prefill: one engine step prefilling one fresh prompt (random tokens, nothing cached), per prompt
  length and torch thread count;
- decode: one engine decode step over a batch of sequences of a given context, per batch size,
  context and thread count (the sequences are admitted with `start_decode` onto allocated blocks, as
  a decode worker admits transferred KV, so no prompt is prefilled to build them);
- KV handoff: per transport, between two Ray actors (handoff_probe.py); `--quick`: in this process;
- the router's Python work per streamed token: unpacking the decode worker's chunk and detokenizing.
Medians of `repeats` after a warm-up; the prefill points of a thread count are timed in rounds over
all of them, so that a slow spell of the machine does not shift one point alone.
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, TypeVar

from pdserve.planner.profile import ContextPrefillPoint, DecodePoint, PrefillPoint, Profile

T = TypeVar("T")


@dataclass(frozen=True)
class ProfileGrid:
    prompt_tokens: tuple[int, ...] = (128, 256, 512, 1024, 2048)
    threads: tuple[int, ...] = (1, 2)
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    context_tokens: tuple[int, ...] = (256, 1024, 2048)
    # prompt tokens after a cached context (a conversation's later turn, a chunk after chunks)
    context_tokens_prefill: tuple[int, ...] = (256, 512, 1024)
    new_tokens_prefill: tuple[int, ...] = (64, 128, 256)
    handoff_prompt_tokens: tuple[int, ...] = (256, 1024, 4096)
    transports: tuple[str, ...] = ("ray",)
    repeats: int = 3

    @classmethod
    def quick(cls) -> "ProfileGrid":
        """A few points in seconds (tests): no Ray, the handoff's in-process floor."""
        return cls(
            prompt_tokens=(64, 128, 256),
            threads=(1,),
            batch_sizes=(1, 4),
            context_tokens=(128, 512),
            context_tokens_prefill=(128,),
            new_tokens_prefill=(64,),
            handoff_prompt_tokens=(256, 1024),
            transports=("inproc",),
            repeats=1,
        )


def measure(
    grid: ProfileGrid, dtype: str = "auto", log: Callable[[str], None] = lambda line: None
) -> Profile:
    import torch

    max_decode_tokens = max(grid.batch_sizes) * (max(grid.context_tokens) + 64)
    max_handoff_tokens = 2 * max(grid.handoff_prompt_tokens)
    engine, random_prompt = timing_engine(
        dtype,
        max(max_decode_tokens, max_handoff_tokens),
        threads=min(grid.threads),
        max_num_batched_tokens=max(2048, max(grid.prompt_tokens)),
    )
    prefill = []
    for threads in grid.threads:
        torch.set_num_threads(threads)
        medians = _interleaved_medians(
            grid.prompt_tokens,
            grid.repeats,
            lambda tokens: prefill_once(engine, random_prompt(tokens)),
        )
        for tokens, seconds in medians.items():
            prefill.append(PrefillPoint(tokens, threads, seconds))
            log(f"prefill {tokens:5d} tokens, {threads} thread(s): {seconds * 1e3:8.1f} ms")
    context_prefill = []
    for threads in grid.threads:
        torch.set_num_threads(threads)
        medians = _interleaved_medians(
            [(c, n) for c in grid.context_tokens_prefill for n in grid.new_tokens_prefill],
            grid.repeats,
            lambda point: _prefill_after_context_once(
                engine, random_prompt(point[0]), random_prompt(point[1])
            ),
        )
        for (context, new), seconds in medians.items():
            context_prefill.append(ContextPrefillPoint(context, new, threads, seconds))
            log(
                f"prefill {new:4d} tokens after {context:5d} cached, {threads} thread(s): "
                f"{seconds * 1e3:8.1f} ms"
            )
    decode = []
    for threads in grid.threads:
        torch.set_num_threads(threads)
        for context in grid.context_tokens:
            for batch, seconds in _decode_steps(
                engine, context, grid.batch_sizes, grid.repeats, random_prompt
            ):
                decode.append(DecodePoint(batch, context, threads, seconds))
                log(
                    f"decode batch {batch:3d} x {context:5d} context, {threads} thread(s): "
                    f"{seconds * 1e3:7.1f} ms"
                )
    torch.set_num_threads(min(grid.threads))
    handoff = []
    for transport in grid.transports:
        if transport == "inproc":
            from pdserve.planner.handoff_probe import measure_inproc

            def two_lists(n: int) -> tuple[list[int], list[int]]:
                return engine.allocator.allocate(n), engine.allocator.allocate(n)

            points = measure_inproc(
                engine.kv_cache, two_lists, grid.handoff_prompt_tokens, max(grid.repeats, 3)
            )
        else:
            from pdserve.planner.handoff_probe import measure_handoff

            points = measure_handoff(
                engine.layout, transport, grid.handoff_prompt_tokens, max(grid.repeats, 3)
            )
        handoff += points
        for point in points:
            log(
                f"KV handoff over {transport}: {point.kv_bytes / 1e6:6.1f} MB "
                f"in {point.seconds * 1e3:7.1f} ms"
            )
    router_s = _router_s_per_token(engine.tokenizer, random_prompt)
    log(f"router work per streamed token: {router_s * 1e6:.1f} us")
    from engine.kv_cache import auto_kv_cache_bytes

    kv_bytes_per_token = engine.layout.bytes_per_block // engine.layout.block_size_tokens
    return Profile(
        machine=machine_facts(str(engine.layout.torch_dtype).removeprefix("torch.")),
        kv_bytes_per_token=kv_bytes_per_token,
        # what `pdserve serve` gives each worker by default, on this node now
        kv_capacity_tokens=auto_kv_cache_bytes("cpu") // kv_bytes_per_token,
        router_cpu_s_per_token=router_s,
        prefill=tuple(prefill),
        decode=tuple(decode),
        handoff=tuple(handoff),
        context_prefill=tuple(context_prefill),
        notes=(
            "router_cpu_s_per_token: chunk unpacking and incremental detokenization only; the "
            "gRPC send to the client (~0.05 ms per message, benchmarks/grpc_stream_floor.py) is "
            "not in it",
        ),
    )


def machine_facts(dtype: str) -> dict:
    import torch

    from runtime.cpus import usable_cpus

    return {
        "cpu_model": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": usable_cpus(),
        "torch": torch.__version__,
        "model": "default",
        "dtype": dtype,
        "platform": platform.platform(),
    }


def timing_engine(
    dtype: str,
    kv_tokens: int,
    threads: int = 1,
    max_num_batched_tokens: int = 2048,
    seed: int = 0,
) -> tuple[Any, Callable[[int], list[int]]]:
    """An engine of the default model to time steps with (no detokenizer, KV room for `kv_tokens`),
    and a seeded source of random prompts of its vocabulary (`random_prompt(tokens)`)."""
    import torch

    from engine.llm_engine import EngineConfig, LLMEngine

    engine = LLMEngine(
        EngineConfig(
            model="default",
            dtype=dtype,
            num_threads=threads,
            detokenize=False,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_cache_bytes=_kv_bytes(kv_tokens),
        )
    )
    generator = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size

    def random_prompt(tokens: int) -> list[int]:
        return torch.randint(100, vocab - 1, (tokens,), generator=generator).tolist()

    return engine, random_prompt


def _kv_bytes(tokens: int) -> int:
    from engine.config import NAMED_SHAPES

    shape = NAMED_SHAPES["smollm2-135m"]
    # fp32 is the larger
    return (tokens + 1024) * shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * 4


def _interleaved_medians(points: Sequence[T], repeats: int, run: Callable[[T], float]) -> dict:
    """The median of `repeats` timings of each point, taken in rounds over all the points after a
    warm-up round: a slow spell of the machine (this project's VMs vary 20-40 % within minutes)
    lands on every point a little instead of on one point's whole median."""
    for point in points:
        run(point)
    samples: dict = {point: [] for point in points}
    for _ in range(repeats):
        for point in points:
            samples[point].append(run(point))
    return {point: statistics.median(timings) for point, timings in samples.items()}


def prefill_once(engine, prompt: list[int]) -> float:
    """One engine step prefilling `prompt` alone (nothing cached), in seconds."""
    from engine.sampling_params import SamplingParams

    engine.add_request(
        f"p{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=1, temperature=0)
    )
    began = time.perf_counter()
    outputs = engine.step()
    seconds = time.perf_counter() - began
    if not (outputs and outputs[0].finished):
        raise RuntimeError(f"a {len(prompt)}-token prompt did not prefill in one engine step")
    return seconds


def _prefill_after_context_once(engine, context: list[int], new: list[int]) -> float:
    """The step prefilling `new` after `context`, which an earlier request left in the prefix
    cache."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0)
    engine.add_request(f"c{time.monotonic_ns()}", context, params)
    list(engine.run_until_done())
    engine.add_request(f"t{time.monotonic_ns()}", context + new, params)
    began = time.perf_counter()
    outputs = engine.step()
    seconds = time.perf_counter() - began
    block = engine.config.block_size_tokens
    if not (outputs and outputs[0].finished):
        raise RuntimeError("a prompt after a cached context did not prefill in one engine step")
    if outputs[0].num_cached_prompt_tokens < len(context) - block:
        raise RuntimeError(
            f"the context was not found in the prefix cache ({outputs[0].num_cached_prompt_tokens} "
            f"of {len(context)} tokens)"
        )
    return seconds


def _decode_steps(engine, context: int, batch_sizes, repeats: int, random_prompt):
    """Grows one running batch of `context`-token sequences through `batch_sizes`; the median step
    at each."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
    request_ids = []
    try:
        for batch in sorted(batch_sizes):
            while len(request_ids) < batch:
                request_id = f"d{context}-{len(request_ids)}"
                prompt = random_prompt(context)
                blocks = engine.allocator.allocate(engine.allocator.blocks_needed(context))
                engine.start_decode(request_id, prompt, prompt[-1], params, blocks)
                request_ids.append(request_id)
            # warm-up at this batch: a few steps, as the first ones after a change of thread count
            # run slow (seen: 44 ms at batch 1 against 27 ms at batch 2)
            for _ in range(max(repeats, 3)):
                engine.step()
            samples = []
            for _ in range(max(repeats, 3)):
                began = time.perf_counter()
                engine.step()
                samples.append(time.perf_counter() - began)
            yield batch, statistics.median(samples)
    finally:
        for request_id in request_ids:
            engine.abort(request_id)


def _router_s_per_token(tokenizer, random_prompt, tokens: int = 2000) -> float:
    """The router's own per-token work: unpack a one-token chunk from the decode worker's stream and
    detokenize it incrementally (router/router.py does both per token at stream interval 1)."""
    from engine.detokenizer import IncrementalDetokenizer
    from protocol.token_stream import TokenChunk, decode_chunks, encode_chunks

    output = random_prompt(tokens)
    messages = [encode_chunks([TokenChunk("r", (token,))]) for token in output]
    detok = IncrementalDetokenizer(tokenizer, random_prompt(64))
    began = time.process_time()
    for message in messages:
        chunks, _, _ = decode_chunks(message)
        detok.add_token(chunks[0].token_ids[0])
    return (time.process_time() - began) / tokens


def _cpu_model() -> Optional[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None
