"""`pdserve bench`: a serving load generator, measured the way vLLM's `vllm bench serve` measures.

Random prompts (token ids drawn from the model's vocabulary, special tokens excluded) are sent to a
running server at a request rate (Poisson arrivals, or gamma with `burstiness`), optionally under a
concurrency cap, through one of three backends: the pdserve gRPC API (token ids sent as they are),
OpenAI `/v1/completions` or `/v1/chat/completions` (the ids decoded to text). Every request streams;
its record holds TTFT, the gaps between streamed chunks and its end-to-end latency, and
`compute_metrics` (a pure function of the records) turns them into vLLM's figures.

Where vLLM leaves a choice open, ours:
- a chunk is one streamed message that carries new output (gRPC: token ids; HTTP: non-empty text).
  Messages without output (a chat role-only delta, a finish-only or usage-only chunk, text held back
  by the detokenizer) are not chunks; their time falls into the next gap;
- ITL: one gap per chunk after the first, however many tokens the chunk carries (as vLLM appends it),
  so with multi-token chunks ITL is a per-chunk latency and TPOT the per-token one;
- output tokens come from the server's usage when it reports them, else the tokens seen (gRPC) or the
  generated text re-tokenized (HTTP); prompt tokens likewise (HTTP prompts are re-tokenized by the server);
- a sweep keeps the prompt and output lengths (drawn from `seed`) at every rate but draws fresh token
  content per rate (from `seed` and the rate's index), so no rate finds an earlier rate's prompts in
  the prefix cache; `reuse_prompts` sends the very same prompts instead. Arrivals use `seed + index`;
- figures over no data (no completed request, no request with two tokens) are None, not 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from typing import Optional, Sequence

import numpy as np

BACKENDS = ("grpc", "openai", "openai-chat")
METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_PORTS = {"grpc": 50051, "openai": 8000, "openai-chat": 8000}
_METRIC_TITLES = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
                  "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}
_PREFIX_TOKENS = 16  # prompts must differ within their first KV block, or the prefix cache would share it
_MAX_ERRORS_SHOWN = 5


@dataclass(frozen=True)
class BenchConfig:
    backend: str = "grpc"
    host: str = "127.0.0.1"
    port: Optional[int] = None  # None: 50051 for grpc, 8000 for the HTTP backends
    model: Optional[str] = None  # None: the first of GET /v1/models (HTTP), "default" (grpc)
    tokenizer: str = "default"
    api_key: Optional[str] = None
    num_prompts: int = 100
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    seed: int = 0
    request_rates: tuple[float, ...] = (math.inf,)
    burstiness: float = 1.0
    max_concurrency: Optional[int] = None
    timeout_s: float = 300.0
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl")  # the ones printed; JSON holds all
    metric_percentiles: tuple[float, ...] = (99.0,)
    goodput_slos_ms: tuple[tuple[str, float], ...] = ()  # (metric, ms) pairs, e.g. (("ttft", 500.0),)
    reuse_prompts: bool = False
    disable_tqdm: bool = False
    result_file: Optional[str] = None
    plot_file: Optional[str] = None

    def __post_init__(self) -> None:
        checks = [
            (self.backend in BACKENDS, f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}"),
            (self.num_prompts >= 1, f"--num-prompts must be >= 1, got {self.num_prompts}"),
            (self.random_input_len >= 1, f"--random-input-len must be >= 1, got {self.random_input_len}"),
            (self.random_output_len >= 1, f"--random-output-len must be >= 1, got {self.random_output_len}"),
            (0 <= self.random_range_ratio < 1, f"--random-range-ratio must be in [0, 1), got {self.random_range_ratio}"),
            (bool(self.request_rates) and all(r > 0 for r in self.request_rates),
             f"--request-rate must be positive rates or inf, got {self.request_rates}"),
            (self.burstiness > 0, f"--burstiness must be > 0, got {self.burstiness}"),
            (self.max_concurrency is None or self.max_concurrency >= 1,
             f"--max-concurrency must be >= 1, got {self.max_concurrency}"),
            (self.timeout_s > 0, f"--timeout-s must be > 0, got {self.timeout_s}"),
            (set(self.percentile_metrics) <= set(METRICS),
             f"--percentile-metrics must be among {', '.join(METRICS)}, got {self.percentile_metrics}"),
            (all(0 < p < 100 for p in self.metric_percentiles),
             f"--metric-percentiles must be in (0, 100), got {self.metric_percentiles}"),
        ]
        for name, slo_ms in self.goodput_slos_ms:
            checks.append((name in GOODPUT_METRICS and slo_ms >= 0,
                           f"--goodput takes {'/'.join(GOODPUT_METRICS)}:MS with MS >= 0, got {name}:{slo_ms}"))
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def resolved_port(self) -> int:
        return self.port if self.port is not None else DEFAULT_PORTS[self.backend]

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.resolved_port}"

    @property
    def reported_percentiles(self) -> tuple[float, ...]:
        """The selected percentiles plus p50 and p99, which the plot and the summary always show."""
        return tuple(sorted({*self.metric_percentiles, 50.0, 99.0}))


# -- workload --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Prompt:
    token_ids: tuple[int, ...]  # what the gRPC backend sends; for a text prompt, what the server will count
    text: str  # empty for the gRPC backend
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.token_ids)


def _lengths(rng: np.random.Generator, mean_len: int, range_ratio: float, count: int) -> list[int]:
    low, high = max(1, int(mean_len * (1 - range_ratio))), max(1, int(mean_len * (1 + range_ratio)))
    return [int(n) for n in rng.integers(low, high + 1, size=count)]


def random_prompts(tokenizer, config: BenchConfig, content_index: int = 0) -> list[Prompt]:
    """`num_prompts` distinct random prompts. Lengths depend on `seed` only, token content on
    (`seed`, `content_index`), so a sweep can keep the workload's shape and change its content."""
    length_rng = np.random.default_rng(config.seed)
    input_lens = _lengths(length_rng, config.random_input_len, config.random_range_ratio, config.num_prompts)
    output_lens = _lengths(length_rng, config.random_output_len, config.random_range_ratio, config.num_prompts)
    rng = np.random.default_rng([config.seed, content_index])
    special = {i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special}
    special |= {*tokenizer.special.eos_token_ids, tokenizer.special.bos_token_id}  # a None BOS matches no id
    vocab = np.array([i for i in range(tokenizer.vocab_size) if i not in special])
    text_prompts = config.backend != "grpc"
    prompts, seen_prefixes = [], set()
    for input_len, output_len in zip(input_lens, output_lens):
        for _ in range(100):  # bounded: very short prompts may not have num_prompts distinct prefixes
            ids = [int(i) for i in rng.choice(vocab, input_len)]
            text = _text_of_length(tokenizer, ids, input_len, rng, vocab) if text_prompts else ""
            counted = tokenizer.encode(text) if text_prompts else ids
            if tuple(counted[:_PREFIX_TOKENS]) not in seen_prefixes:
                break
        seen_prefixes.add(tuple(counted[:_PREFIX_TOKENS]))
        prompts.append(Prompt(tuple(counted), text, output_len))
    return prompts


def _text_of_length(tokenizer, ids: list[int], target_len: int, rng: np.random.Generator, vocab: np.ndarray) -> str:
    # Random ids do not survive decode -> encode unchanged (merges, broken UTF-8): adjust a few times, as vLLM does.
    text = tokenizer.decode(ids)
    for _ in range(10):
        again = tokenizer.encode(text, add_special_tokens=False)
        if len(again) == target_len:
            break
        if len(again) > target_len:
            ids = again[:target_len]
        else:
            ids = again + [int(i) for i in rng.choice(vocab, target_len - len(again))]
        text = tokenizer.decode(ids)
    return text


def arrival_times_s(num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times from the start: the first at 0, then gamma gaps of mean 1/rate (shape `burstiness`;
    1.0 is a Poisson process). An infinite rate sends everything at once."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps_s = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=max(0, num_requests - 1))
    return [0.0, *np.cumsum(gaps_s).tolist()][:num_requests]


# -- one request -----------------------------------------------------------------------------

@dataclass
class RequestRecord:
    success: bool
    prompt_len: int
    output_len: int
    ttft_s: Optional[float]
    itls_s: list[float]
    e2el_s: float  # for a failed request: the time until it failed
    start_s: float  # from the start of the run
    error: str = ""

    @property
    def tpot_s(self) -> Optional[float]:
        if self.ttft_s is None or self.output_len < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_len - 1)


class _StreamClock:
    """Times one streamed request: TTFT at the first chunk, a gap per later chunk."""

    def __init__(self, run_start_s: float, prompt: Prompt):
        self.prompt = prompt
        self.run_start_s = run_start_s
        self.start_s = time.perf_counter()
        self.ttft_s: Optional[float] = None
        self.itls_s: list[float] = []
        self.tokens_seen = 0
        self._last_s = self.start_s

    def chunk(self, num_tokens: int = 0) -> None:
        now = time.perf_counter()
        if self.ttft_s is None:
            self.ttft_s = now - self.start_s
        else:
            self.itls_s.append(now - self._last_s)
        self._last_s = now
        self.tokens_seen += num_tokens

    def record(self, output_len: int, prompt_len: Optional[int] = None, error: str = "") -> RequestRecord:
        if not error and self.ttft_s is None:
            error = "the stream ended without output"
        return RequestRecord(success=not error, prompt_len=prompt_len or self.prompt.prompt_len, output_len=output_len,
                             ttft_s=self.ttft_s, itls_s=self.itls_s, e2el_s=time.perf_counter() - self.start_s,
                             start_s=self.start_s - self.run_start_s, error=error)


class GrpcBackend:
    """`pdserve.v1.Generation/Generate`, the prompt sent as token ids."""

    def __init__(self, config: BenchConfig):
        import grpc

        from pdserve_proto import pdserve_pb2_grpc as pb_grpc

        self.config = config
        self.model = config.model or "default"
        self.channel = grpc.aio.insecure_channel(f"{config.host}:{config.resolved_port}")
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.metadata = (("authorization", f"Bearer {config.api_key}"),) if config.api_key else ()

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        await self.channel.close()

    async def send(self, prompt: Prompt, clock: _StreamClock) -> RequestRecord:
        import grpc

        from pdserve_proto import pdserve_pb2 as pb

        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt.token_ids), sampling=pb.SamplingParams(
            max_tokens=prompt.output_len, temperature=0, ignore_eos=True))
        final = None
        try:
            async for response in self.stub.Generate(request, metadata=self.metadata):
                if response.token_ids:
                    clock.chunk(len(response.token_ids))
                if response.finish_reason:
                    final = response
        except grpc.aio.AioRpcError as error:
            return clock.record(clock.tokens_seen, error=f"{error.code().name}: {error.details()}")
        if final is None or final.finish_reason == "abort":
            reason = "the stream ended without a finish reason" if final is None else "the server aborted the request"
            return clock.record(clock.tokens_seen, error=reason)
        return clock.record(final.usage.completion_tokens or clock.tokens_seen, final.usage.prompt_tokens)


class OpenAIBackend:
    """`/v1/completions` or `/v1/chat/completions`, streamed as server-sent events."""

    def __init__(self, config: BenchConfig, tokenizer):
        self.config = config
        self.chat = config.backend == "openai-chat"
        self.tokenizer = tokenizer
        self.url = config.base_url + ("/v1/chat/completions" if self.chat else "/v1/completions")
        self.headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self.model = config.model or ""
        self.session = None

    async def open(self) -> None:
        import aiohttp

        # No connection limit: concurrency is the benchmark's to set (request rate, --max-concurrency).
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), trust_env=False,
                                             timeout=aiohttp.ClientTimeout(total=None))
        if not self.model:
            url = self.config.base_url + "/v1/models"
            try:
                async with self.session.get(url, headers=self.headers, timeout=aiohttp.ClientTimeout(total=30)) as response:
                    if response.status != 200:
                        raise ConnectionError(f"GET {url}: HTTP {response.status}: {(await response.text())[:300]}")
                    models = (await response.json()).get("data") or []
            except (aiohttp.ClientError, asyncio.TimeoutError) as error:
                raise ConnectionError(f"GET {url}: {type(error).__name__}: {error}") from error
            if not models:
                raise ConnectionError(f"GET {self.config.base_url}/v1/models lists no model; pass --model")
            self.model = models[0]["id"]

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def body(self, prompt: Prompt) -> dict:
        common = {"model": self.model, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                  "ignore_eos": True}
        if self.chat:
            return {**common, "messages": [{"role": "user", "content": prompt.text}],
                    "max_completion_tokens": prompt.output_len}
        return {**common, "prompt": prompt.text, "max_tokens": prompt.output_len}

    async def send(self, prompt: Prompt, clock: _StreamClock) -> RequestRecord:
        import aiohttp

        texts, usage, done = [], None, False
        try:
            async with self.session.post(self.url, json=self.body(prompt), headers=self.headers) as response:
                if response.status != 200:
                    return clock.record(0, error=f"HTTP {response.status}: {(await response.text())[:300]}")
                async for raw_line in response.content:
                    line = raw_line.decode("utf-8").strip()
                    if not line.startswith("data:"):
                        continue  # blank separators, SSE comments, event names
                    payload = line.removeprefix("data:").strip()
                    if payload == "[DONE]":
                        done = True
                        break
                    data = json.loads(payload)
                    if data.get("error"):
                        return clock.record(0, error=f"error event: {json.dumps(data['error'])[:300]}")
                    for choice in data.get("choices") or []:
                        text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
                        if text:
                            clock.chunk()
                            texts.append(text)
                    usage = data.get("usage") or usage
        except (aiohttp.ClientError, json.JSONDecodeError, UnicodeDecodeError) as error:
            return clock.record(0, error=f"{type(error).__name__}: {error}")
        if not done:
            return clock.record(0, error="the stream ended without data: [DONE]")
        usage = usage or {}
        output_len = usage.get("completion_tokens") or len(self.tokenizer.encode("".join(texts), add_special_tokens=False))
        return clock.record(output_len, usage.get("prompt_tokens"))


# -- metrics ---------------------------------------------------------------------------------

def compute_metrics(records: Sequence[RequestRecord], duration_s: float, percentiles: Sequence[float] = (50.0, 99.0),
                    goodput_slos_ms: Optional[dict[str, float]] = None) -> dict:
    """vLLM's serving figures from per-request records. Failed requests count only in `failed` (and
    in the peak concurrency). TPOT is (e2el - ttft) / (output_len - 1) over requests with two or more
    output tokens; ITL pools every gap of every completed request. Goodput counts the completed
    requests meeting every given SLO (a request of one output token meets any TPOT SLO, as in vLLM)."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    done = [r for r in records if r.success]
    samples_s = {"ttft": [r.ttft_s for r in done], "tpot": [r.tpot_s for r in done if r.tpot_s is not None],
                 "itl": [gap for r in done for gap in r.itls_s], "e2el": [r.e2el_s for r in done]}
    total_input, total_output = sum(r.prompt_len for r in done), sum(r.output_len for r in done)
    result = {
        "completed": len(done), "failed": len(records) - len(done), "duration_s": duration_s,
        "total_input_tokens": total_input, "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "request_goodput": None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_concurrent_requests": _peak_concurrency(records),
    }
    if goodput_slos_ms:
        good = [r for r in done if all(_slo_value_ms(r, name) <= slo_ms for name, slo_ms in goodput_slos_ms.items())]
        result["request_goodput"] = len(good) / duration_s
    for name, values_s in samples_s.items():
        values_ms = np.asarray(values_s, dtype=float) * 1e3
        empty = values_ms.size == 0
        result[f"mean_{name}_ms"] = None if empty else float(values_ms.mean())
        result[f"median_{name}_ms"] = None if empty else float(np.median(values_ms))
        result[f"std_{name}_ms"] = None if empty else float(values_ms.std())
        for p in percentiles:
            result[f"p{_percentile_name(p)}_{name}_ms"] = None if empty else float(np.percentile(values_ms, p))
    return result


def _slo_value_ms(record: RequestRecord, name: str) -> float:
    value_s = {"ttft": record.ttft_s, "tpot": record.tpot_s or 0.0, "e2el": record.e2el_s}[name]
    return value_s * 1e3


def _peak_concurrency(records: Sequence[RequestRecord]) -> int:
    # Ends sort before starts at the same instant: a request that ends as another starts is not overlap.
    events = sorted([(r.start_s, 1) for r in records] + [(r.start_s + r.e2el_s, -1) for r in records])
    peak = running = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def _percentile_name(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


# -- running ---------------------------------------------------------------------------------

async def run_rate(config: BenchConfig, backend, prompts: Sequence[Prompt], request_rate: float,
                   arrival_seed: int = 0) -> dict:
    """Sends `prompts` at `request_rate` and returns the metrics plus the per-request data."""
    from tqdm import tqdm

    arrivals_s = arrival_times_s(len(prompts), request_rate, config.burstiness, arrival_seed)
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    progress = tqdm(total=len(prompts), disable=config.disable_tqdm, desc=f"rate {request_rate:g} req/s")

    async def one(prompt: Prompt, arrival_s: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, run_start_s + arrival_s - time.perf_counter()))
        async with limit or nullcontext():
            clock = _StreamClock(run_start_s, prompt)
            try:
                record = await asyncio.wait_for(backend.send(prompt, clock), config.timeout_s)
            except asyncio.TimeoutError:
                record = clock.record(clock.tokens_seen, error=f"timed out after {config.timeout_s:g} s")
        progress.update(1)
        return record

    run_start_s = time.perf_counter()
    records = await asyncio.gather(*(one(p, t) for p, t in zip(prompts, arrivals_s)))
    duration_s = time.perf_counter() - run_start_s
    progress.close()
    metrics = compute_metrics(records, duration_s, config.reported_percentiles, dict(config.goodput_slos_ms) or None)
    errors = list(dict.fromkeys(r.error for r in records if not r.success))
    return {
        "request_rate": request_rate, "burstiness": config.burstiness, "max_concurrency": config.max_concurrency,
        **metrics,
        "distinct_errors": errors,
        "requests": {
            "input_lens": [r.prompt_len for r in records], "output_lens": [r.output_len for r in records],
            "ttfts_s": [r.ttft_s for r in records], "itls_s": [r.itls_s for r in records],
            "e2els_s": [r.e2el_s for r in records], "start_times_s": [r.start_s for r in records],
            "errors": [r.error for r in records],
        },
    }


async def run_bench(config: BenchConfig, tokenizer=None) -> dict:
    """Every rate of `config.request_rates` in turn against one connection; prints each result table.
    Returns the report: date, model, config and one result per rate. `tokenizer`: one already loaded
    for `config.tokenizer` (loading takes seconds)."""
    if tokenizer is None:
        from engine.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(config.tokenizer)
    backend = GrpcBackend(config) if config.backend == "grpc" else OpenAIBackend(config, tokenizer)
    results = []
    try:
        await backend.open()
        for index, rate in enumerate(config.request_rates):
            prompts = random_prompts(tokenizer, config, 0 if config.reuse_prompts else index)
            result = await run_rate(config, backend, prompts, rate, arrival_seed=config.seed + index)
            print(format_result(result, config), flush=True)
            results.append(result)
    finally:
        await backend.close()
    return {"date": datetime.now().isoformat(timespec="seconds"), "backend": config.backend, "model": backend.model,
            "config": {**asdict(config), "api_key": config.api_key and "<redacted>"}, "results": results}


def sweep(config: BenchConfig, request_rates: Optional[Sequence[float]] = None, tokenizer=None) -> dict:
    """Runs the benchmark (over `request_rates` if given), writes `result_file` and `plot_file` when
    set, and returns the report."""
    if request_rates is not None:
        config = replace(config, request_rates=tuple(request_rates))
    report = asyncio.run(run_bench(config, tokenizer))
    if len(config.request_rates) > 1:
        print(format_sweep(report), flush=True)
    if config.result_file:
        with open(config.result_file, "w") as out:
            json.dump(_jsonable(report), out, indent=1)
    if config.plot_file:
        from pdserve.bench_plot import plot_report

        plot_report(report, config.plot_file)
    return report


def _jsonable(value):
    """Infinite rates as the string "inf" (vLLM's spelling), so the file is strict JSON."""
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


# -- printing --------------------------------------------------------------------------------

def _row(label: str, value) -> str:
    if value is None:
        return f"{label:<40} {'n/a':<10}"
    return f"{label:<40} {value:<10.2f}" if isinstance(value, float) else f"{label:<40} {value!s:<10}"


def format_result(result: dict, config: BenchConfig) -> str:
    """One rate's result as vLLM prints it."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             _row("Backend:", config.backend),
             _row("Successful requests:", result["completed"]),
             _row("Failed requests:", result["failed"]),
             _row("Request rate configured (RPS):", result["request_rate"]),
             _row("Burstiness factor:", result["burstiness"]),
             _row("Maximum request concurrency:", result["max_concurrency"]),
             _row("Benchmark duration (s):", result["duration_s"]),
             _row("Total input tokens:", result["total_input_tokens"]),
             _row("Total generated tokens:", result["total_output_tokens"]),
             _row("Request throughput (req/s):", result["request_throughput"])]
    if result["request_goodput"] is not None:
        lines.append(_row("Request goodput (req/s):", result["request_goodput"]))
    lines += [_row("Output token throughput (tok/s):", result["output_throughput"]),
              _row("Peak concurrent requests:", result["max_concurrent_requests"]),
              _row("Total token throughput (tok/s):", result["total_token_throughput"])]
    for name in config.percentile_metrics:
        title, short = _METRIC_TITLES[name]
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        lines.append(_row(f"Mean {short} (ms):", result[f"mean_{name}_ms"]))
        lines.append(_row(f"Median {short} (ms):", result[f"median_{name}_ms"]))
        for p in config.metric_percentiles:
            lines.append(_row(f"P{_percentile_name(p)} {short} (ms):", result[f"p{_percentile_name(p)}_{name}_ms"]))
    if result["distinct_errors"]:
        lines.append("{s:{c}^{n}}".format(s="Errors (first distinct)", n=50, c="-"))
        lines += [f"  {error}" for error in result["distinct_errors"][:_MAX_ERRORS_SHOWN]]
    lines.append("=" * 50)
    return "\n".join(lines)


def format_sweep(report: dict) -> str:
    def ms(value) -> str:
        return "n/a" if value is None else f"{value:.1f}"

    lines = [f"{'rate':>8} {'done':>5} {'fail':>5} {'req/s':>7} {'good/s':>7} {'out tok/s':>9} "
             f"{'TTFT p50/p99 ms':>17} {'TPOT p50/p99 ms':>17} {'ITL p50/p99 ms':>17}"]
    for r in report["results"]:
        goodput = "n/a" if r["request_goodput"] is None else f"{r['request_goodput']:.2f}"
        lines.append(f"{r['request_rate']:>8g} {r['completed']:>5} {r['failed']:>5} {r['request_throughput']:>7.2f} "
                     f"{goodput:>7} {r['output_throughput']:>9.1f} "
                     + " ".join(f"{ms(r[f'p50_{m}_ms']) + '/' + ms(r[f'p99_{m}_ms']):>17}" for m in ("ttft", "tpot", "itl")))
    return "\n".join(lines)


# -- command line ----------------------------------------------------------------------------

def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from error


def _goodput(pair: str) -> tuple[str, float]:
    name, _, value = pair.partition(":")
    try:
        return name.strip(), float(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected METRIC:MS (e.g. ttft:500), got {pair!r}") from error


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="load-test a running server with random prompts (like `vllm bench serve`)")
    p.add_argument("--backend", default="grpc", choices=BACKENDS)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="default: 50051 (grpc), 8000 (HTTP backends)")
    p.add_argument("--model", default=None,
                   help="model name to send (default: the first of GET /v1/models; grpc: 'default')")
    p.add_argument("--tokenizer", default="default",
                   help="tokenizer for the prompts: 'default', a .gguf file or an HF directory")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (HTTP header or gRPC metadata)")
    p.add_argument("--dataset-name", default="random", choices=["random"])
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-rate", type=_floats, default=(math.inf,),
                   help="requests/s, or a comma-separated sweep (0.5,1,2,inf); inf sends all at once (default)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps; 1.0 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--reuse-prompts", action="store_true",
                   help="send the same prompts at every rate of a sweep (default: same lengths, fresh tokens per rate)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl", help=f"printed, among {','.join(METRICS)}")
    p.add_argument("--metric-percentiles", type=_floats, default=(99.0,), help="e.g. 50,90,99")
    p.add_argument("--goodput", type=_goodput, nargs="+", default=[], metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:2000")
    p.add_argument("--save-result", action="store_true", help="write the JSON report (see --result-file)")
    p.add_argument("--result-file", default=None,
                   help="JSON report path (default with --save-result: pdserve-bench-<backend>-<time>.json)")
    p.add_argument("--plot", default=None, metavar="PATH.png",
                   help="plot latency percentiles and throughput against request rate")
    p.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(handler=run_cli)
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    result_file = args.result_file
    if args.save_result and result_file is None:
        result_file = f"pdserve-bench-{args.backend}-{datetime.now():%Y%m%d-%H%M%S}.json"
    return BenchConfig(
        backend=args.backend, host=args.host, port=args.port, model=args.model, tokenizer=args.tokenizer,
        api_key=args.api_key, num_prompts=args.num_prompts, random_input_len=args.random_input_len,
        random_output_len=args.random_output_len, random_range_ratio=args.random_range_ratio, seed=args.seed,
        request_rates=args.request_rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
        timeout_s=args.timeout_s,
        percentile_metrics=tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip()),
        metric_percentiles=args.metric_percentiles, goodput_slos_ms=tuple(args.goodput), reuse_prompts=args.reuse_prompts,
        disable_tqdm=args.disable_tqdm, result_file=result_file, plot_file=args.plot)


def run_cli(args: argparse.Namespace) -> int:
    """Exit code 1 when some rate completed no request at all, else 0."""
    config = config_from_args(args)
    try:
        report = sweep(config)
    except ConnectionError as error:
        print(f"pdserve bench: {error}", file=sys.stderr)
        return 1
    if config.result_file:
        print(f"pdserve bench: results written to {config.result_file}", file=sys.stderr)
    return 0 if all(r["completed"] for r in report["results"]) else 1
