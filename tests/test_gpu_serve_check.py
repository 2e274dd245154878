"""scripts/gpu_serve_check.py, the serving check of #32, in its CPU mode: the whole system (real Ray
actors, real weights) started by the script, driven by `pdserve bench` at two rates, disaggregated
and colocated, for the default model and a random-weights model; the result files' fields, the KV
handoff recorded per request, and greedy tokens through the system equal to the engine's alone."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RATE_FIELDS = {
    "request_rate",
    "completed",
    "failed",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "output_throughput",
    "request_goodput",
    "kv_handoff",
}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_serving_check_runs_end_to_end_on_cpu(tmp_path):
    run = subprocess.run(
        [sys.executable, "scripts/gpu_serve_check.py", "--device", "cpu", "--quick"]
        + ["--out-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads((tmp_path / "serve_check_cpu_quick_8b_default.json").read_text())
    assert (tmp_path / "serve_check_cpu_quick_8b_default.md").read_text().count("| 2 |") == 4
    assert list(report["sections"]) == ["8b", "default"]
    for name, section in report["sections"].items():
        assert section["ok"], section.get("traceback")
        assert [s["mode"] for s in section["systems"]] == ["disaggregated", "colocated"]
        for system in section["systems"]:
            assert [r["request_rate"] for r in system["rates"]] == [2, 8]
            for rate in system["rates"]:
                assert RATE_FIELDS <= set(rate), RATE_FIELDS - set(rate)
                assert rate["completed"] == 2 and rate["failed"] == 0
                assert rate["median_ttft_ms"] > 0 and rate["median_tpot_ms"] > 0
                assert rate["output_throughput"] > 0
                kv = rate["kv_handoff"]
                assert kv["requests"] == 2
                if system["mode"] == "disaggregated":  # every request's KV went prefill -> decode
                    assert kv["requests_with_kv_handoff"] == 2
                    assert len(kv["kv_transfer_ms"]) == 2 and all(
                        0 < ms < ttft for ms, ttft in zip(kv["kv_transfer_ms"], kv["ttft_ms"])
                    )
                    assert 0 < kv["median_kv_share_of_ttft"] < 1
                    # 24 prompt tokens of SmolLM2's shape in fp32: 2 blocks of 16 x 46,080 B
                    assert kv["kv_bytes"] == [2 * 16 * 46080] * 2
                else:
                    assert kv["requests_with_kv_handoff"] == 0
    default = report["sections"]["default"]["systems"]
    assert [s["greedy_identical"] for s in default] == [[True, True], [True, True]]
    assert set(report["targets"]) == {"8b", "default"}
    assert "targets [default]" in run.stdout
