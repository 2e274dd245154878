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
- ITL: one gap per chunk after the first, however many tokens the chunk carries (as vLLM appends
  it), so with multi-token chunks ITL is a per-chunk latency and TPOT the per-token one;
- output tokens come from the server's usage when it reports them, else the tokens seen (gRPC) or
  the generated text re-tokenized (HTTP); prompt tokens likewise (HTTP prompts are re-tokenized by
  the server);
- a sweep keeps the prompt and output lengths (drawn from `seed`) at every rate but draws fresh
  token content per rate (from `seed` and the rate's index), so no rate finds an earlier rate's
  prompts in the prefix cache; `reuse_prompts` sends the very same prompts instead. Arrivals use
  `seed + index`;
- figures over no data (no completed request, no request with two tokens) are None, not 0.

The conversation dataset (`--dataset conversation`) runs `users` chats of `turns` turns each instead
of independent prompts, through a chat backend (gRPC `chat` or OpenAI `messages`). Every user shares
one random system prompt; each turn adds a fresh random user message and sends the whole history,
the assistant's replies being the text the server streamed back. Its choices:
- the arrival process starts users, not requests (an infinite rate starts them all at once); a user
  sends its next turn once the previous reply has ended and its think time has passed;
- think times are exponential with mean `think_time_s` (0: none), drawn from `seed` and the user, so
  a sweep keeps them at every rate; texts follow the random dataset's rule (fresh per rate);
- a failed turn ends its conversation (there is no reply to send back): later turns are not sent;
- a chat prompt's token count is the server's (usage), 0 when it reports none;
- per turn index: TTFT, the KV bytes the prefill worker shipped (gRPC only; None over HTTP) and the
  cached prompt tokens the server reports.
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

from pdserve.bench_backends import GrpcBackend, OpenAIBackend, StreamClock
from pdserve.bench_metrics import (
    RequestRecord,
    compute_metrics,
    format_result,
    format_sweep,
    per_turn_metrics,
)

BACKENDS = ("grpc", "openai", "openai-chat")
DATASETS = ("random", "conversation")
CHAT_BACKENDS = ("grpc", "openai-chat")
METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_PORTS = {"grpc": 50051, "openai": 8000, "openai-chat": 8000}
# prompts must differ within their first KV block, or the prefix cache would share it
_PREFIX_TOKENS = 16


@dataclass(frozen=True)
class BenchConfig:
    backend: str = "grpc"
    host: str = "127.0.0.1"
    port: Optional[int] = None  # None: 50051 for grpc, 8000 for the HTTP backends
    model: Optional[str] = None  # None: the first of GET /v1/models (HTTP), "default" (grpc)
    tokenizer: str = "default"
    api_key: Optional[str] = None
    # a PEM root certificate: connect with TLS (https / a secure gRPC channel)
    tls_ca: Optional[str] = None
    num_prompts: int = 100
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    seed: int = 0
    dataset: str = "random"
    users: int = 8  # conversation dataset: concurrent chats
    turns: int = 4  # conversation dataset: user messages per chat
    # conversation dataset: tokens of the system prompt all users share (0: none)
    system_prompt_len: int = 256
    turn_input_len: int = 64  # conversation dataset: tokens of each user message
    # conversation dataset: mean of the exponential pause between a user's turns
    think_time_s: float = 0.0
    # requests/s; the conversation dataset: users started/s
    request_rates: tuple[float, ...] = (math.inf,)
    burstiness: float = 1.0
    max_concurrency: Optional[int] = None
    timeout_s: float = 300.0
    # the ones printed; JSON holds all
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl")
    metric_percentiles: tuple[float, ...] = (99.0,)
    # (metric, ms) pairs, e.g. (("ttft", 500.0),)
    goodput_slos_ms: tuple[tuple[str, float], ...] = ()
    reuse_prompts: bool = False
    disable_tqdm: bool = False
    result_file: Optional[str] = None
    plot_file: Optional[str] = None

    def __post_init__(self) -> None:
        checks = [
            (
                self.backend in BACKENDS,
                f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}",
            ),
            (self.num_prompts >= 1, f"--num-prompts must be >= 1, got {self.num_prompts}"),
            (
                self.random_input_len >= 1,
                f"--random-input-len must be >= 1, got {self.random_input_len}",
            ),
            (
                self.random_output_len >= 1,
                f"--random-output-len must be >= 1, got {self.random_output_len}",
            ),
            (
                0 <= self.random_range_ratio < 1,
                f"--random-range-ratio must be in [0, 1), got {self.random_range_ratio}",
            ),
            (
                self.dataset in DATASETS,
                f"--dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}",
            ),
            (
                self.dataset != "conversation" or self.backend in CHAT_BACKENDS,
                "--dataset conversation sends chat messages: --backend must be one of "
                f"{', '.join(CHAT_BACKENDS)}, got {self.backend!r}",
            ),
            (self.users >= 1, f"--users must be >= 1, got {self.users}"),
            (self.turns >= 1, f"--turns must be >= 1, got {self.turns}"),
            (
                self.system_prompt_len >= 0,
                f"--system-prompt-len must be >= 0, got {self.system_prompt_len}",
            ),
            (self.turn_input_len >= 1, f"--turn-input-len must be >= 1, got {self.turn_input_len}"),
            (self.think_time_s >= 0, f"--think-time-s must be >= 0, got {self.think_time_s}"),
            (
                bool(self.request_rates) and all(r > 0 for r in self.request_rates),
                f"--request-rate must be positive rates or inf, got {self.request_rates}",
            ),
            (self.burstiness > 0, f"--burstiness must be > 0, got {self.burstiness}"),
            (
                self.max_concurrency is None or self.max_concurrency >= 1,
                f"--max-concurrency must be >= 1, got {self.max_concurrency}",
            ),
            (self.timeout_s > 0, f"--timeout-s must be > 0, got {self.timeout_s}"),
            (
                set(self.percentile_metrics) <= set(METRICS),
                f"--percentile-metrics must be among {', '.join(METRICS)}, got "
                f"{self.percentile_metrics}",
            ),
            (
                all(0 < p < 100 for p in self.metric_percentiles),
                f"--metric-percentiles must be in (0, 100), got {self.metric_percentiles}",
            ),
        ]
        for name, slo_ms in self.goodput_slos_ms:
            checks.append(
                (
                    name in GOODPUT_METRICS and slo_ms >= 0,
                    f"--goodput takes {'/'.join(GOODPUT_METRICS)}:MS with MS >= 0, got "
                    f"{name}:{slo_ms}",
                )
            )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def resolved_port(self) -> int:
        return self.port if self.port is not None else DEFAULT_PORTS[self.backend]

    @property
    def base_url(self) -> str:
        return f"{'https' if self.tls_ca else 'http'}://{self.host}:{self.resolved_port}"

    @property
    def reported_percentiles(self) -> tuple[float, ...]:
        """The selected percentiles plus p50 and p99, which the plot and the summary always show."""
        return tuple(sorted({*self.metric_percentiles, 50.0, 99.0}))


# -- workload --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    # what the gRPC backend sends; for a text prompt, what the server will count
    token_ids: tuple[int, ...]
    text: str  # empty for the gRPC backend
    output_len: int
    # (role, content): sent as chat messages instead of the above
    messages: tuple[tuple[str, str], ...] = ()

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
    input_lens = _lengths(
        length_rng, config.random_input_len, config.random_range_ratio, config.num_prompts
    )
    output_lens = _lengths(
        length_rng, config.random_output_len, config.random_range_ratio, config.num_prompts
    )
    rng = np.random.default_rng([config.seed, content_index])
    vocab = _vocab(tokenizer)
    text_prompts = config.backend != "grpc"
    prompts, seen_prefixes = [], set()
    for input_len, output_len in zip(input_lens, output_lens):
        # bounded: very short prompts may not have num_prompts distinct prefixes
        for _ in range(100):
            ids = [int(i) for i in rng.choice(vocab, input_len)]
            text = _text_of_length(tokenizer, ids, input_len, rng, vocab) if text_prompts else ""
            counted = tokenizer.encode(text) if text_prompts else ids
            if tuple(counted[:_PREFIX_TOKENS]) not in seen_prefixes:
                break
        seen_prefixes.add(tuple(counted[:_PREFIX_TOKENS]))
        prompts.append(Prompt(tuple(counted), text, output_len))
    return prompts


def _vocab(tokenizer) -> np.ndarray:
    special = {i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special}
    # a None BOS matches no id
    special |= {*tokenizer.special.eos_token_ids, tokenizer.special.bos_token_id}
    return np.array([i for i in range(tokenizer.vocab_size) if i not in special])


def _text_of_length(
    tokenizer, ids: list[int], target_len: int, rng: np.random.Generator, vocab: np.ndarray
) -> str:
    # Random ids do not survive decode -> encode unchanged (merges, broken UTF-8): adjust a few
    # times, as vLLM does.
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


@dataclass(frozen=True)
class Conversation:
    """One user's side of a chat, written in advance; the assistant's side is what the server
    answers."""

    system_prompt: str  # the same for every user; empty: no system message
    user_messages: tuple[str, ...]  # one per turn
    think_times_s: tuple[float, ...]  # the pause before each turn after the first
    output_len: int  # max_tokens of every turn


def conversations(tokenizer, config: BenchConfig, content_index: int = 0) -> list[Conversation]:
    """`users` conversations of `turns` random messages after one shared random system prompt. Texts
    depend on (`seed`, `content_index`), think times on `seed` alone; each user draws from its own
    generators, so a user's script does not depend on how many users there are."""
    vocab = _vocab(tokenizer)

    def text(rng: np.random.Generator, length: int) -> str:
        return (
            _text_of_length(
                tokenizer, [int(i) for i in rng.choice(vocab, length)], length, rng, vocab
            )
            if length
            else ""
        )

    system_prompt = text(
        np.random.default_rng([config.seed, content_index, 0]), config.system_prompt_len
    )
    result = []
    for user in range(config.users):
        text_rng = np.random.default_rng([config.seed, content_index, 1 + user])
        think_rng = np.random.default_rng([config.seed, user])
        result.append(
            Conversation(
                system_prompt,
                tuple(text(text_rng, config.turn_input_len) for _ in range(config.turns)),
                tuple(think_rng.exponential(config.think_time_s, config.turns - 1).tolist()),
                config.random_output_len,
            )
        )
    return result


def arrival_times_s(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Send times from the start: the first at 0, then gamma gaps of mean 1/rate (shape
    `burstiness`; 1.0 is a Poisson process). An infinite rate sends everything at once."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps_s = rng.gamma(
        shape=burstiness, scale=1.0 / (request_rate * burstiness), size=max(0, num_requests - 1)
    )
    return [0.0, *np.cumsum(gaps_s).tolist()][:num_requests]


# -- running ---------------------------------------------------------------------------------


async def run_rate(
    config: BenchConfig,
    backend,
    prompts: Sequence[Prompt],
    request_rate: float,
    arrival_seed: int = 0,
) -> dict:
    """Sends `prompts` at `request_rate` and returns the metrics plus the per-request data."""
    from tqdm import tqdm

    arrivals_s = arrival_times_s(len(prompts), request_rate, config.burstiness, arrival_seed)
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    progress = tqdm(
        total=len(prompts), disable=config.disable_tqdm, desc=f"rate {request_rate:g} req/s"
    )

    async def one(prompt: Prompt, arrival_s: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, run_start_s + arrival_s - time.perf_counter()))
        record = await _send(config, backend, prompt, limit, run_start_s)
        progress.update(1)
        return record

    run_start_s = time.perf_counter()
    records = await asyncio.gather(*(one(p, t) for p, t in zip(prompts, arrivals_s)))
    duration_s = time.perf_counter() - run_start_s
    progress.close()
    return _rate_result(config, request_rate, records, duration_s)


async def run_conversations(
    config: BenchConfig,
    backend,
    scripts: Sequence[Conversation],
    request_rate: float,
    arrival_seed: int = 0,
) -> dict:
    """Plays `scripts` with users arriving at `request_rate` (see the module docstring); returns
    `run_rate`'s result plus the figures per turn index (`per_turn`) and each request's turn."""
    from tqdm import tqdm

    arrivals_s = arrival_times_s(len(scripts), request_rate, config.burstiness, arrival_seed)
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    progress = tqdm(
        total=sum(len(c.user_messages) for c in scripts),
        disable=config.disable_tqdm,
        desc=f"rate {request_rate:g} users/s",
    )

    async def converse(script: Conversation, arrival_s: float) -> list[RequestRecord]:
        await asyncio.sleep(max(0.0, run_start_s + arrival_s - time.perf_counter()))
        history = [("system", script.system_prompt)] if script.system_prompt else []
        records = []
        for turn, (message, think_s) in enumerate(
            zip(script.user_messages, (0.0, *script.think_times_s)), start=1
        ):
            await asyncio.sleep(think_s)
            history.append(("user", message))
            record = await _send(
                config,
                backend,
                Prompt((), "", script.output_len, tuple(history)),
                limit,
                run_start_s,
            )
            records.append(replace(record, turn=turn))
            progress.update(1)
            if not record.success:
                break
            history.append(("assistant", record.reply_text))
        return records

    run_start_s = time.perf_counter()
    records = [
        r
        for user in await asyncio.gather(*(converse(c, t) for c, t in zip(scripts, arrivals_s)))
        for r in user
    ]
    duration_s = time.perf_counter() - run_start_s
    progress.close()
    result = _rate_result(config, request_rate, records, duration_s)
    result["per_turn"] = per_turn_metrics(records, config.reported_percentiles)
    result["requests"]["turns"] = [r.turn for r in records]
    return result


async def _send(
    config: BenchConfig,
    backend,
    prompt: Prompt,
    limit: Optional[asyncio.Semaphore],
    run_start_s: float,
) -> RequestRecord:
    async with limit or nullcontext():
        clock = StreamClock(run_start_s, prompt)
        try:
            return await asyncio.wait_for(backend.send(prompt, clock), config.timeout_s)
        except asyncio.TimeoutError:
            return clock.record(clock.tokens_seen, error=f"timed out after {config.timeout_s:g} s")


def _rate_result(
    config: BenchConfig, request_rate: float, records: Sequence[RequestRecord], duration_s: float
) -> dict:
    metrics = compute_metrics(
        records, duration_s, config.reported_percentiles, dict(config.goodput_slos_ms) or None
    )
    errors = list(dict.fromkeys(r.error for r in records if not r.success))
    return {
        "request_rate": request_rate,
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        **metrics,
        "distinct_errors": errors,
        "requests": {
            "input_lens": [r.prompt_len for r in records],
            "output_lens": [r.output_len for r in records],
            "ttfts_s": [r.ttft_s for r in records],
            "itls_s": [r.itls_s for r in records],
            "e2els_s": [r.e2el_s for r in records],
            "start_times_s": [r.start_s for r in records],
            "kv_bytes": [r.kv_bytes for r in records],
            "cached_prompt_tokens": [r.cached_prompt_tokens for r in records],
            "server_prefill_s": [r.server_prefill_s for r in records],
            "server_decode_step_s": [r.server_decode_step_s for r in records],
            "errors": [r.error for r in records],
        },
    }


async def run_bench(config: BenchConfig, tokenizer=None) -> dict:
    """Every rate of `config.request_rates` in turn against one connection; prints each result
    table. Returns the report: date, model, config and one result per rate. `tokenizer`: one already
    loaded for `config.tokenizer` (loading takes seconds)."""
    if tokenizer is None:
        from engine.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(config.tokenizer)
    backend = GrpcBackend(config) if config.backend == "grpc" else OpenAIBackend(config, tokenizer)
    results = []
    try:
        await backend.open()
        for index, rate in enumerate(config.request_rates):
            content_index = 0 if config.reuse_prompts else index
            if config.dataset == "conversation":
                scripts = conversations(tokenizer, config, content_index)
                result = await run_conversations(
                    config, backend, scripts, rate, arrival_seed=config.seed + index
                )
            else:
                prompts = random_prompts(tokenizer, config, content_index)
                result = await run_rate(
                    config, backend, prompts, rate, arrival_seed=config.seed + index
                )
            print(format_result(result, config), flush=True)
            results.append(result)
    finally:
        await backend.close()
    return {
        "date": datetime.now().isoformat(timespec="seconds"),
        "backend": config.backend,
        "model": backend.model,
        "config": {**asdict(config), "api_key": config.api_key and "<redacted>"},
        "results": results,
    }


def sweep(
    config: BenchConfig, request_rates: Optional[Sequence[float]] = None, tokenizer=None
) -> dict:
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


# -- command line ----------------------------------------------------------------------------


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError as error:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from error


def _goodput(pair: str) -> tuple[str, float]:
    name, _, value = pair.partition(":")
    try:
        return name.strip(), float(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(
            f"expected METRIC:MS (e.g. ttft:500), got {pair!r}"
        ) from error


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="load-test a running server with random prompts (like `vllm bench serve`) "
        "or multi-turn conversations",
    )
    p.add_argument("--backend", default="grpc", choices=BACKENDS)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--port", type=int, default=None, help="default: 50051 (grpc), 8000 (HTTP backends)"
    )
    p.add_argument(
        "--model",
        default=None,
        help="model name to send (default: the first of GET /v1/models; grpc: 'default')",
    )
    p.add_argument(
        "--tokenizer",
        default="default",
        help="tokenizer for the prompts: 'default', a .gguf file or an HF directory",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="sent as 'Authorization: Bearer KEY' (HTTP header or gRPC metadata)",
    )
    p.add_argument(
        "--tls-ca",
        default=None,
        metavar="PEM",
        help="connect with TLS, trusting this root certificate",
    )
    p.add_argument(
        "--dataset-name",
        "--dataset",
        dest="dataset",
        default="random",
        choices=DATASETS,
        help="random: independent prompts; conversation: --users chats of --turns turns, each turn "
        "sending the whole history (a shared system prompt, every earlier message and reply); "
        "needs --backend grpc or openai-chat",
    )
    p.add_argument("--num-prompts", type=int, default=100, help="random dataset")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument(
        "--random-output-len", type=int, default=128, help="max_tokens of every request (and turn)"
    )
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)]",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--users", type=int, default=8, help="conversation dataset: concurrent chats")
    p.add_argument(
        "--turns", type=int, default=4, help="conversation dataset: user messages per chat"
    )
    p.add_argument(
        "--system-prompt-len",
        type=int,
        default=256,
        help="conversation dataset: tokens of the system prompt every user shares (0: none)",
    )
    p.add_argument(
        "--turn-input-len",
        type=int,
        default=64,
        help="conversation dataset: tokens of each user message",
    )
    p.add_argument(
        "--think-time-s",
        type=float,
        default=0.0,
        help="conversation dataset: mean pause between a reply and the user's next turn, "
        "exponential and seeded (0: none)",
    )
    p.add_argument(
        "--request-rate",
        type=_floats,
        default=(math.inf,),
        help="requests/s, or a comma-separated sweep (0.5,1,2,inf); inf sends all at once "
        "(default); conversation dataset: users started/s",
    )
    p.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps; 1.0 = Poisson",
    )
    p.add_argument(
        "--max-concurrency", type=int, default=None, help="at most this many requests in flight"
    )
    p.add_argument(
        "--reuse-prompts",
        action="store_true",
        help="send the same prompts at every rate of a sweep (default: same lengths, fresh "
        "tokens per rate)",
    )
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    p.add_argument(
        "--percentile-metrics", default="ttft,tpot,itl", help=f"printed, among {','.join(METRICS)}"
    )
    p.add_argument("--metric-percentiles", type=_floats, default=(99.0,), help="e.g. 50,90,99")
    p.add_argument(
        "--goodput",
        type=_goodput,
        nargs="+",
        default=[],
        metavar="METRIC:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:2000",
    )
    p.add_argument(
        "--save-result", action="store_true", help="write the JSON report (see --result-file)"
    )
    p.add_argument(
        "--result-file",
        default=None,
        help="JSON report path (default with --save-result: pdserve-bench-<backend>-<time>.json)",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="PATH.png",
        help="plot latency percentiles and throughput against request rate",
    )
    p.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(handler=run_cli)
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    result_file = args.result_file
    if args.save_result and result_file is None:
        result_file = f"pdserve-bench-{args.backend}-{datetime.now():%Y%m%d-%H%M%S}.json"
    return BenchConfig(
        backend=args.backend,
        host=args.host,
        port=args.port,
        model=args.model,
        tokenizer=args.tokenizer,
        api_key=args.api_key,
        tls_ca=args.tls_ca,
        num_prompts=args.num_prompts,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        seed=args.seed,
        dataset=args.dataset,
        users=args.users,
        turns=args.turns,
        system_prompt_len=args.system_prompt_len,
        turn_input_len=args.turn_input_len,
        think_time_s=args.think_time_s,
        request_rates=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        timeout_s=args.timeout_s,
        percentile_metrics=tuple(
            m.strip() for m in args.percentile_metrics.split(",") if m.strip()
        ),
        metric_percentiles=args.metric_percentiles,
        goodput_slos_ms=tuple(args.goodput),
        reuse_prompts=args.reuse_prompts,
        disable_tqdm=args.disable_tqdm,
        result_file=result_file,
        plot_file=args.plot,
    )


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
