"""`pdserve bench`: the metrics by hand, the arrival schedule, the driver with a fake backend, the
random workload, and the whole benchmark against a live local system over gRPC and both OpenAI
HTTP backends."""

import asyncio
import json
import math
import socket

import numpy as np
import pytest

from pdserve.bench import (
    BenchConfig,
    Prompt,
    RequestRecord,
    arrival_times_s,
    compute_metrics,
    random_prompts,
    run_rate,
    sweep,
)

METRIC_FIELDS = [
    f"{stat}_{metric}_ms"
    for metric in ("ttft", "tpot", "itl", "e2el")
    for stat in ("mean", "median", "std", "p50", "p99")
]
RESULT_FIELDS = [
    "request_rate",
    "burstiness",
    "max_concurrency",
    "completed",
    "failed",
    "duration_s",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "max_concurrent_requests",
    "median_server_prefill_ms",
    "median_server_decode_step_ms",
    "distinct_errors",
    "requests",
    *METRIC_FIELDS,
]
PER_REQUEST_FIELDS = [
    "input_lens",
    "output_lens",
    "ttfts_s",
    "itls_s",
    "e2els_s",
    "start_times_s",
    "server_prefill_s",
    "server_decode_step_s",
    "errors",
]


def _records() -> list[RequestRecord]:
    return [
        RequestRecord(
            True,
            prompt_len=10,
            output_len=5,
            ttft_s=0.1,
            itls_s=[0.05, 0.05, 0.1, 0.2],
            e2el_s=0.5,
            start_s=0.0,
        ),
        RequestRecord(
            True,
            prompt_len=20,
            output_len=3,
            ttft_s=0.3,
            itls_s=[0.1, 0.3],
            e2el_s=0.7,
            start_s=0.1,
        ),
        RequestRecord(
            True, prompt_len=5, output_len=1, ttft_s=0.2, itls_s=[], e2el_s=0.2, start_s=0.2
        ),
        RequestRecord(
            False,
            prompt_len=7,
            output_len=0,
            ttft_s=None,
            itls_s=[],
            e2el_s=0.05,
            start_s=0.3,
            error="UNAVAILABLE: gone",
        ),
    ]


# -- metrics ---------------------------------------------------------------------------------


def test_metrics_by_hand():
    m = compute_metrics(_records(), duration_s=2.0, percentiles=(50, 99))
    assert (m["completed"], m["failed"]) == (3, 1)
    # the failed request counts nowhere
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (35, 9)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(22.0)
    assert m["request_goodput"] is None  # no SLO given
    assert m["max_concurrent_requests"] == 4  # all four overlap at t = 0.3 s
    # TTFT 100, 300, 200 ms
    assert m["mean_ttft_ms"] == pytest.approx(200) and m["median_ttft_ms"] == pytest.approx(200)
    assert m["p99_ttft_ms"] == pytest.approx(298)  # linear interpolation between 200 and 300
    assert m["std_ttft_ms"] == pytest.approx(np.std([100, 200, 300]))
    # TPOT: (500-100)/4 = 100 and (700-300)/2 = 200 ms; the one-token request has none
    assert m["mean_tpot_ms"] == pytest.approx(150) and m["p50_tpot_ms"] == pytest.approx(150)
    assert m["p99_tpot_ms"] == pytest.approx(199)
    # ITL pools every gap: 50, 50, 100, 200, 100, 300 ms
    assert m["mean_itl_ms"] == pytest.approx(800 / 6) and m["median_itl_ms"] == pytest.approx(100)
    assert m["mean_e2el_ms"] == pytest.approx(1400 / 3) and m["median_e2el_ms"] == pytest.approx(
        500
    )
    assert m["median_server_prefill_ms"] is None  # no record says
    assert m["median_server_decode_step_ms"] is None


def test_the_servers_prefill_time_is_the_median_over_completed_requests_that_report_it():
    records = _records()
    for record, seconds in zip(records, (0.08, None, 0.05, 0.01)):  # the last one failed
        record.server_prefill_s = seconds
    assert compute_metrics(records, 2.0)["median_server_prefill_ms"] == pytest.approx(65)


def test_the_servers_decode_step_is_the_median_over_completed_requests_that_report_it():
    records = _records()
    for record, seconds in zip(records, (0.04, 0.03, None, 0.5)):  # the last one failed
        record.server_decode_step_s = seconds
    assert compute_metrics(records, 2.0)["median_server_decode_step_ms"] == pytest.approx(35)


def test_goodput_counts_completed_requests_meeting_every_slo():
    records = _records()
    # TTFT <= 250 and TPOT <= 150: the first (100, 100) and the one-token request (200, no TPOT)
    # pass; the second fails TTFT (300); the failed request never counts.
    m = compute_metrics(records, 2.0, goodput_slos_ms={"ttft": 250, "tpot": 150})
    assert m["request_goodput"] == pytest.approx(1.0)
    assert compute_metrics(records, 2.0, goodput_slos_ms={"tpot": 99})[
        "request_goodput"
    ] == pytest.approx(0.5)
    assert compute_metrics(records, 2.0, goodput_slos_ms={"e2el": 400})[
        "request_goodput"
    ] == pytest.approx(0.5)
    all_good = compute_metrics(
        records, 2.0, goodput_slos_ms={"ttft": 1000, "tpot": 1000, "e2el": 1000}
    )
    assert (
        all_good["request_goodput"]
        == pytest.approx(all_good["request_throughput"])
        == pytest.approx(1.5)
    )
    assert compute_metrics(records, 2.0, goodput_slos_ms={"ttft": 50})["request_goodput"] == 0


def test_metrics_over_no_completed_request_are_none_not_zero():
    failed = [r for r in _records() if not r.success]
    m = compute_metrics(failed, 1.0, goodput_slos_ms={"ttft": 100})
    assert (m["completed"], m["failed"], m["request_throughput"], m["request_goodput"]) == (
        0,
        1,
        0,
        0,
    )
    assert all(m[name] is None for name in METRIC_FIELDS)
    with pytest.raises(ValueError, match="duration_s"):
        compute_metrics(failed, 0.0)


def test_config_names_the_bad_flag():
    with pytest.raises(ValueError, match="--goodput"):
        BenchConfig(goodput_slos_ms=(("itl", 10.0),))
    with pytest.raises(ValueError, match="--request-rate"):
        BenchConfig(request_rates=(1.0, 0.0))
    with pytest.raises(ValueError, match="--random-range-ratio"):
        BenchConfig(random_range_ratio=1.0)


# -- arrivals and the driver -----------------------------------------------------------------


def test_poisson_arrivals_have_the_rate_and_are_reproducible():
    times = arrival_times_s(2000, request_rate=4.0, seed=1)
    gaps = np.diff(times)
    assert len(times) == 2000 and times[0] == 0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.1)
    assert 0.85 < gaps.std() / gaps.mean() < 1.15  # exponential gaps: coefficient of variation 1
    assert times == arrival_times_s(2000, 4.0, seed=1) and times != arrival_times_s(
        2000, 4.0, seed=2
    )
    bursty = np.diff(arrival_times_s(2000, 4.0, burstiness=0.25, seed=1))
    # CV 1/sqrt(0.25)
    assert bursty.mean() == pytest.approx(0.25, rel=0.2) and bursty.std() / bursty.mean() > 1.6
    assert arrival_times_s(5, math.inf) == [0.0] * 5


class _FakeBackend:
    """Streams two one-token chunks `decode_s` apart; tracks how many requests are in flight."""

    def __init__(self, decode_s: float = 0.05):
        self.decode_s = decode_s
        self.in_flight = self.peak_in_flight = 0

    async def send(self, prompt, clock):
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        clock.chunk(1)
        await asyncio.sleep(self.decode_s)
        clock.chunk(1)
        self.in_flight -= 1
        return clock.record(2)


def _fake_prompts(n: int) -> list[Prompt]:
    return [Prompt((i,), "", output_len=2) for i in range(n)]


def test_infinite_rate_sends_everything_at_once():
    config = BenchConfig(disable_tqdm=True)
    result = asyncio.run(run_rate(config, _FakeBackend(), _fake_prompts(20), math.inf))
    assert result["completed"] == 20 and max(result["requests"]["start_times_s"]) < 0.1
    assert result["max_concurrent_requests"] == 20 and result["total_output_tokens"] == 40


def test_finite_rate_follows_the_schedule_and_concurrency_is_capped():
    config = BenchConfig(disable_tqdm=True)
    expected = arrival_times_s(8, 20.0, seed=3)
    result = asyncio.run(
        run_rate(config, _FakeBackend(0.01), _fake_prompts(8), 20.0, arrival_seed=3)
    )
    for started, planned in zip(result["requests"]["start_times_s"], expected):
        assert planned - 0.001 <= started < planned + 0.1
    backend = _FakeBackend(0.05)
    capped = asyncio.run(
        run_rate(
            BenchConfig(disable_tqdm=True, max_concurrency=2), backend, _fake_prompts(6), math.inf
        )
    )
    assert backend.peak_in_flight == 2 and capped["max_concurrent_requests"] == 2
    assert capped["duration_s"] >= 3 * 0.05


def test_a_request_over_its_timeout_fails():
    config = BenchConfig(disable_tqdm=True, timeout_s=0.05)
    slow = asyncio.run(run_rate(config, _FakeBackend(decode_s=1.0), _fake_prompts(2), math.inf))
    assert slow["failed"] == 2 and slow["distinct_errors"] == ["timed out after 0.05 s"]
    assert slow["requests"]["ttfts_s"][0] is not None  # the first chunk had arrived


def test_an_unreachable_grpc_server_fails_every_request(tokenizer):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = BenchConfig(
        port=port,
        num_prompts=3,
        random_input_len=8,
        random_output_len=2,
        disable_tqdm=True,
        timeout_s=10,
    )
    (result,) = sweep(config, tokenizer=tokenizer)["results"]
    assert (result["completed"], result["failed"]) == (0, 3)
    assert result["distinct_errors"][0].startswith("UNAVAILABLE")


# -- the workload ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from engine.tokenizer import load_tokenizer

    return load_tokenizer("default")


def test_random_prompts_are_reproducible_distinct_and_free_of_special_tokens(tokenizer):
    config = BenchConfig(
        num_prompts=50, random_input_len=40, random_output_len=10, random_range_ratio=0.5, seed=7
    )
    prompts = random_prompts(tokenizer, config)
    assert prompts == random_prompts(tokenizer, config)
    assert all(20 <= p.prompt_len <= 60 and 5 <= p.output_len <= 15 and not p.text for p in prompts)
    assert len({p.token_ids[:16] for p in prompts}) == 50
    assert len({p.prompt_len for p in prompts}) > 5  # lengths vary with the ratio
    special = {0, 1, 2, *range(3, 17)}  # SmolLM2's control tokens
    assert not special & {t for p in prompts for t in p.token_ids}
    # A sweep's next rate: the same lengths, other tokens (so the prefix cache cannot serve it).
    next_rate = random_prompts(tokenizer, config, content_index=1)
    assert [p.prompt_len for p in next_rate] == [p.prompt_len for p in prompts]
    assert not {p.token_ids[:16] for p in next_rate} & {p.token_ids[:16] for p in prompts}


def test_text_prompts_tokenize_back_to_their_length(tokenizer):
    prompts = random_prompts(
        tokenizer, BenchConfig(backend="openai", num_prompts=20, random_input_len=32, seed=1)
    )
    assert all(list(p.token_ids) == tokenizer.encode(p.text) for p in prompts)
    assert sum(p.prompt_len == 32 for p in prompts) >= 18
    assert len({p.text for p in prompts}) == 20


# -- live ------------------------------------------------------------------------------------

API_KEY = "bench-key"


@pytest.fixture(scope="module")
def system(harness):
    """One 1 prefill + 1 decode system serving gRPC and the OpenAI HTTP API, behind an API key, for
    all live tests."""
    running = harness.start(num_prefill=1, num_decode=1, http_port=0, api_keys=(API_KEY,))
    yield running
    running.stop()


def _check_report(report_path, num_prompts: int, output_len: int) -> dict:
    report = json.loads(report_path.read_text())
    assert {"date", "backend", "model", "config", "results"} <= set(report)
    assert report["config"]["api_key"] == "<redacted>"
    (result,) = report["results"]
    assert set(RESULT_FIELDS) <= set(result) and set(PER_REQUEST_FIELDS) <= set(result["requests"])
    assert result["request_rate"] == "inf"
    assert result["completed"] == num_prompts and result["failed"] == 0, result["distinct_errors"]
    # ignore_eos: exactly max_tokens each
    assert result["total_output_tokens"] == num_prompts * output_len
    assert result["requests"]["output_lens"] == [output_len] * num_prompts
    assert result["total_input_tokens"] == sum(result["requests"]["input_lens"])
    assert all(ttft > 0 for ttft in result["requests"]["ttfts_s"]) and result["mean_ttft_ms"] > 0
    assert all(0 < len(itls) <= output_len - 1 for itls in result["requests"]["itls_s"])
    assert result["mean_tpot_ms"] > 0 and result["p99_itl_ms"] >= result["median_itl_ms"] > 0
    assert all(
        e2el > ttft
        for e2el, ttft in zip(result["requests"]["e2els_s"], result["requests"]["ttfts_s"])
    )
    return report


def test_grpc_benchmark_against_a_live_system(system, tokenizer, tmp_path, capsys):
    import matplotlib.image

    result_file, plot_file = tmp_path / "grpc.json", tmp_path / "grpc.png"
    config = BenchConfig(
        backend="grpc",
        port=system.port,
        api_key=API_KEY,
        num_prompts=6,
        random_input_len=32,
        random_output_len=8,
        goodput_slos_ms=(("ttft", 60_000.0), ("tpot", 60_000.0)),
        disable_tqdm=True,
        result_file=str(result_file),
        plot_file=str(plot_file),
    )
    sweep(config, tokenizer=tokenizer)
    report = _check_report(result_file, num_prompts=6, output_len=8)
    (result,) = report["results"]
    assert result["total_input_tokens"] == 6 * 32  # token ids are sent as they are
    # generous SLOs: all good
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    # the server times the prefill worker's step of each request
    server_prefill_s = result["requests"]["server_prefill_s"]
    ttfts_s = result["requests"]["ttfts_s"]
    # (the harness's system prefills every prompt remotely)
    assert all(s is not None and 0 < s < ttft for s, ttft in zip(server_prefill_s, ttfts_s))
    assert 0 < result["median_server_prefill_ms"] < result["median_ttft_ms"]
    # and the decode worker its mean engine decode step of each (8 tokens: 7 decode steps)
    steps_s = result["requests"]["server_decode_step_s"]
    assert all(s is not None and 0 < s for s in steps_s)
    assert 0 < result["median_server_decode_step_ms"] <= result["p99_itl_ms"]
    printed = capsys.readouterr().out
    assert (
        "============ Serving Benchmark Result ============" in printed
        and "Mean TTFT (ms):" in printed
    )
    png = plot_file.read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000
    image = matplotlib.image.imread(str(plot_file))
    assert image.shape[0] > 500 and image.shape[1] > 800


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_http_benchmark_against_a_live_system(system, tokenizer, backend, tmp_path):
    result_file = tmp_path / f"{backend}.json"
    config = BenchConfig(
        backend=backend,
        port=system.system.http_port,
        api_key=API_KEY,
        num_prompts=4,
        random_input_len=32,
        random_output_len=8,
        disable_tqdm=True,
        result_file=str(result_file),
    )
    sweep(config, tokenizer=tokenizer)
    report = _check_report(result_file, num_prompts=4, output_len=8)
    assert report["model"]  # found through GET /v1/models
    assert report["results"][0]["median_server_prefill_ms"] is None  # the HTTP APIs do not say
    assert report["results"][0]["median_server_decode_step_ms"] is None
    input_lens = report["results"][0]["requests"]["input_lens"]
    # the server's count
    assert all(n > 32 if backend == "openai-chat" else abs(n - 32) <= 2 for n in input_lens)


def test_server_errors_count_as_failed_requests(system, tokenizer):
    def failures(**overrides) -> list[str]:
        config = BenchConfig(
            **{
                "num_prompts": 2,
                "random_input_len": 8,
                "random_output_len": 2,
                "disable_tqdm": True,
                "api_key": API_KEY,
                **overrides,
            }
        )
        (result,) = sweep(config, tokenizer=tokenizer)["results"]
        assert (result["completed"], result["failed"]) == (0, 2)
        return result["distinct_errors"]

    http_port = system.system.http_port
    (wrong_model,) = failures(backend="openai", port=http_port, model="no-such-model")
    assert wrong_model.startswith("HTTP 404")
    (no_key,) = failures(backend="openai-chat", port=http_port, model="any", api_key=None)
    assert no_key.startswith("HTTP 401")
    (bad_key,) = failures(backend="grpc", port=system.port, api_key="wrong")
    assert bad_key.startswith("UNAUTHENTICATED")


def test_cli_sweeps_two_rates(system, tmp_path, capsys):
    import argparse

    from pdserve.bench import add_parser

    parser = argparse.ArgumentParser(prog="pdserve")
    add_parser(parser.add_subparsers(dest="command"))
    result_file, plot_file = tmp_path / "sweep.json", tmp_path / "sweep.png"
    args = parser.parse_args(
        [
            "bench",
            "--backend",
            "openai",
            "--port",
            str(system.system.http_port),
            "--api-key",
            API_KEY,
            "--num-prompts",
            "3",
            "--random-input-len",
            "16",
            "--random-output-len",
            "4",
            "--request-rate",
            "8,inf",
            "--goodput",
            "ttft:60000",
            "e2el:60000",
            "--metric-percentiles",
            "50,90",
            "--disable-tqdm",
            "--result-file",
            str(result_file),
            "--plot",
            str(plot_file),
        ]
    )
    assert args.handler(args) == 0
    report = json.loads(result_file.read_text())
    assert [r["request_rate"] for r in report["results"]] == [8.0, "inf"]
    assert all(r["completed"] == 3 and r["total_output_tokens"] == 12 for r in report["results"])
    assert all(
        r["request_goodput"] == pytest.approx(r["request_throughput"]) for r in report["results"]
    )
    printed = capsys.readouterr().out
    assert printed.count("Serving Benchmark Result") == 2 and "P90 TTFT (ms):" in printed
    assert plot_file.read_bytes().startswith(b"\x89PNG")
