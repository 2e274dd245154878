"""The SLO as an input (`pdserve serve --slo ttft:MS,tpot:MS`): its parsing, the judgement of a
completed request (as vLLM's `--goodput` counts), the router's counters and metrics, and a live
system's /metrics, GetStats and `pdserve status`."""

from __future__ import annotations

import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.dtypes import AUTO_DTYPE_ENV
from router.metrics import RouterMetrics
from router.output import FinalInfo
from router.slo import DEFAULT_SLO, FAST_SLO, FP32_CPU_SLO, SLO, auto_slo
from router.stats import RouterStats


def test_parse_takes_milliseconds_with_comma_or_space_and_prints_them_back():
    assert SLO.parse("ttft:1000,tpot:50") == SLO(ttft_s=1.0, tpot_s=0.05)
    assert SLO.parse(" tpot:50  ttft:1000 ") == SLO(ttft_s=1.0, tpot_s=0.05)
    assert SLO.parse("ttft:250.5, tpot:7.5") == SLO(ttft_s=0.2505, tpot_s=0.0075)
    assert str(SLO(ttft_s=1.0, tpot_s=0.05)) == "ttft:1000,tpot:50"
    assert DEFAULT_SLO == "auto" and str(SLO.parse(FAST_SLO)) == FAST_SLO == "ttft:1000,tpot:50"


def test_auto_suits_the_dtype_the_workers_serve(monkeypatch):
    monkeypatch.delenv(AUTO_DTYPE_ENV, raising=False)
    assert auto_slo("bfloat16", "cpu") == auto_slo("float32", "cuda") == FAST_SLO
    assert (
        auto_slo("float32", "cpu") == auto_slo("auto", "auto", cpu_flags={"avx2"}) == FP32_CPU_SLO
    )
    assert auto_slo("auto", "auto", cpu_flags={"avx512f", "avx512_bf16"}) == FAST_SLO
    monkeypatch.setenv(AUTO_DTYPE_ENV, "float32")
    assert auto_slo("auto", "cpu", cpu_flags={"avx512_bf16"}) == FP32_CPU_SLO
    assert SLO.resolve("auto", "bfloat16") == SLO.parse(FAST_SLO) and SLO.resolve(
        "ttft:5,tpot:6"
    ) == SLO(0.005, 0.006)
    for text in ("ttft:0.001,tpot:0.001", "ttft:60000,tpot:12.25", "ttft:1234567,tpot:3"):
        assert str(SLO.parse(text)) == text


@pytest.mark.parametrize(
    "text, message",
    [
        ("ttft:abc,tpot:50", r"'ttft:abc': 'abc' is not a number"),
        ("ttft:1000,tpot:50,e2el:9000", r"'e2el:9000': expected ttft:MS or tpot:MS"),
        ("ttft:1000,tpot", r"'tpot': expected ttft:MS or tpot:MS"),
        ("ttft:0,tpot:50", r"'ttft:0': ttft must be a positive number"),
        ("ttft:1000,tpot:-5", r"'tpot:-5': tpot must be a positive number"),
        ("ttft:nan,tpot:50", r"'ttft:nan': ttft must be a positive number"),
        ("ttft:1000,ttft:900,tpot:50", r"'ttft:900': ttft given twice"),
        ("ttft:1000", r"lacks tpot"),
        ("", r"lacks ttft and tpot"),
    ],
)
def test_parse_names_the_bad_part(text, message):
    with pytest.raises(ValueError, match=message):
        SLO.parse(text)


def test_a_request_meets_the_slo_within_both_targets_and_tpot_counts_only_after_one_token():
    slo = SLO.parse("ttft:1000,tpot:50")
    # a value equal to its target meets it, as in vLLM
    assert slo.met(0.5, 0.04) and slo.met(1.0, 0.05)
    assert not slo.met(1.001, 0.04) and not slo.met(0.5, 0.051)
    assert slo.met(0.5, None) and slo.met(0.5, 0.0)  # one token: no TPOT, judged by TTFT alone
    assert not slo.met(2.0, None)
    assert [
        slo.result(*values) for values in ((0.5, 0.01), (2.0, 0.01), (0.5, 0.1), (2.0, 0.1))
    ] == ["met", "ttft_missed", "tpot_missed", "both_missed"]
    with pytest.raises(ValueError, match="tpot must be a positive"):
        SLO(ttft_s=1.0, tpot_s=0.0)


def _final(
    finish_reason: str, ttft_s: float, tpot_s: float, completion_tokens: int = 8
) -> FinalInfo:
    return FinalInfo(
        finish_reason=finish_reason,
        prompt_tokens=4,
        completion_tokens=completion_tokens,
        cached_prompt_tokens=0,
        ttft_s=ttft_s,
        tpot_s=tpot_s,
        queue_s=0.0,
        prefill_s=0.0,
        kv_bytes=0,
        kv_transfer_s=0.0,
        e2e_s=1.0,
    )


def _samples(body: bytes) -> dict:
    return {
        sample.name + json.dumps(sample.labels, sort_keys=True): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


def test_the_router_counts_completed_requests_only_against_its_slo():
    stats = RouterStats(RouterMetrics(), SLO.parse("ttft:100,tpot:10"))
    for final in (
        _final("stop", 0.05, 0.005),
        _final("length", 0.05, 0.02),
        _final("length", 0.2, 0.005),
        # one token: its tpot is not judged
        _final("stop", 0.05, 0.5, completion_tokens=1),
        # ended by a worker's abort: not a completed request
        _final("abort", 0.01, 0.001),
    ):
        stats.finished(final)
    assert (stats.slo_met, stats.slo_finished) == (2, 4)
    samples = _samples(stats.metrics.render())
    results = {
        result: samples[f'pdserve_slo_requests_total{{"result": "{result}"}}']
        for result in ("met", "ttft_missed", "tpot_missed", "both_missed")
    }
    assert results == {"met": 2, "ttft_missed": 1, "tpot_missed": 1, "both_missed": 0}
    assert samples["pdserve_slo_goodput_requests_total{}"] == 2
    assert samples["pdserve_slo_ttft_target_seconds{}"] == pytest.approx(0.1)
    assert samples["pdserve_slo_tpot_target_seconds{}"] == pytest.approx(0.01)


def test_a_bad_slo_flag_is_refused_before_anything_starts(monkeypatch, capsys):
    import pdserve.system
    import router.logs
    from pdserve.cli import main

    def must_not_start(config):
        raise AssertionError("start_system called for a bad --slo")

    monkeypatch.setattr(pdserve.system, "start_system", must_not_start)
    # the test's own logging
    monkeypatch.setattr(router.logs, "configure_logging", lambda *args, **kwargs: None)
    assert main(["serve", "--slo", "ttft:abc"]) == 2
    assert (
        "pdserve serve: error: SLO part 'ttft:abc': 'abc' is not a number of milliseconds"
        in capsys.readouterr().err
    )


def _generate_twice(system) -> None:
    with system.client() as client:
        for _ in range(2):
            client.generate(client.request("Hi", max_tokens=4, temperature=0))


def _slo_samples(system) -> dict:
    with urllib.request.urlopen(
        f"http://127.0.0.1:{system.system.http_port}/metrics", timeout=60
    ) as response:
        return {
            key: value
            for key, value in _samples(response.read()).items()
            if key.startswith("pdserve_slo_")
        }


def test_a_live_system_reports_attainment_in_metrics_stats_and_status(harness, capsys):
    from pdserve.cli import main

    system = harness.start(num_prefill=1, num_decode=1, http_port=0, slo="ttft:60000 tpot:60000")
    _generate_twice(system)
    samples = _slo_samples(system)
    assert samples['pdserve_slo_requests_total{"result": "met"}'] == 2
    assert (
        sum(value for key, value in samples.items() if key.startswith("pdserve_slo_requests_total"))
        == 2
    )
    assert samples["pdserve_slo_goodput_requests_total{}"] == 2
    assert samples["pdserve_slo_ttft_target_seconds{}"] == 60.0
    assert samples["pdserve_slo_tpot_target_seconds{}"] == 60.0
    stats = system.stats()
    assert (stats.slo, stats.slo_met, stats.slo_finished) == ("ttft:60000,tpot:60000", 2, 2)
    assert "SLO ttft:60000,tpot:60000" in system.system.ready_line()
    assert main(["status", "--port", str(system.port)]) == 0
    assert (
        "SLO ttft:60000,tpot:60000: 2 of 2 completed requests met it (100.0%)"
        in capsys.readouterr().out
    )
    assert main(["status", "--port", str(system.port), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["slo"], shown["slo_met"], shown["slo_finished"]) == (
        "ttft:60000,tpot:60000",
        "2",
        "2",
    )
    system.stop()

    impossible = harness.start(
        num_prefill=1, num_decode=1, http_port=0, slo="ttft:0.001,tpot:0.001"
    )
    _generate_twice(impossible)
    samples = _slo_samples(impossible)
    assert samples['pdserve_slo_requests_total{"result": "met"}'] == 0
    assert samples["pdserve_slo_goodput_requests_total{}"] == 0
    missed = sum(
        samples[f'pdserve_slo_requests_total{{"result": "{result}"}}']
        for result in ("ttft_missed", "tpot_missed", "both_missed")
    )
    # TTFT > 1 µs
    assert missed == 2 and samples['pdserve_slo_requests_total{"result": "tpot_missed"}'] == 0
    stats = impossible.stats()
    assert (stats.slo, stats.slo_met, stats.slo_finished) == ("ttft:0.001,tpot:0.001", 0, 2)
    impossible.stop()
