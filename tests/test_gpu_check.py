"""scripts/gpu_check.py, the device check of #17, in its CPU mode: every section's code path on a
tiny model (and the default one, one prompt), so the GPU run finds no bug that a CPU could have
shown."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_device_check_runs_every_section_on_cpu(tmp_path):
    out = tmp_path / "check.json"
    run = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    report = json.loads(out.read_text())
    sections = report["sections"]
    assert list(sections) == [
        "correctness",
        "prefill_backend",
        "attention_accuracy",
        "decode_kernel",
        "engine_speed",
        "kv_handoff",
    ]
    assert all(section["ok"] for section in sections.values())
    assert sections["correctness"]["fp32_identical_to_hf"]
    assert sections["prefill_backend"]["fused"]
    accuracy = sections["attention_accuracy"]  # bf16 against float64
    for case in accuracy["prefill_bf16_max_abs_difference_vs_float64"]:
        assert case["engine"] < 5e-2 and case["strided_gqa"] < 5e-2
    assert [
        case["default"] < 2e-2 for case in accuracy["decode_bf16_max_abs_difference_vs_float64"]
    ] == [True, True]
    for case in sections["decode_kernel"]["cases"]:
        # bf16 rounding
        assert case["kernel"] == "PagedDecodeAttention" and case["max_abs_difference"] < 2e-2
    speed = sections["engine_speed"]
    assert speed["decode_attention"] == "PagedDecodeAttention"
    for who in ("pdserve", "hf_transformers"):
        assert (
            set(speed[who]["ttft_ms"]) == {"16", "64"}
            and speed[who]["tpot_ms"] > 0
            and speed[who]["batch_output_tok_s"] > 0
        )
    assert sections["kv_handoff"]["cases"][0]["device_copy_gb_s"] > 0
    # the transport between two processes
    assert sections["kv_handoff"]["cases"][0]["grpc_gb_s"] > 0
    assert "pdserve TPOT ms (one stream)" in run.stdout  # the table
