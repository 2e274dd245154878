"""What `pdserve serve` tells a user at start (the dtype and why, KV tokens, context, threads), what
`auto` resolves to (and `$PDSERVE_AUTO_DTYPE`, which makes every CPU kind testable with the other
dtype), and a taken port: one line, a non-zero exit within seconds, nothing left running."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

import pytest
import torch

from engine.dtypes import AUTO_DTYPE_ENV, auto_dtype, dtype_reason

NATIVE_BF16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def test_auto_names_the_cpu_and_the_environment_overrides_it(monkeypatch):
    monkeypatch.delenv(AUTO_DTYPE_ENV, raising=False)
    isa = torch.backends.cpu.get_cpu_capability()
    reason = dtype_reason("auto", "cpu")
    assert (
        reason.startswith(f"auto: CPU {isa} with") and ("with native bf16" in reason) == NATIVE_BF16
    )
    assert dtype_reason("float32", "cpu") == "asked"
    assert dtype_reason("auto", "cuda") == "auto: CUDA"
    for forced, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        monkeypatch.setenv(AUTO_DTYPE_ENV, forced)
        assert (
            auto_dtype("cpu") == dtype
            and dtype_reason("auto") == f"auto: ${AUTO_DTYPE_ENV}={forced}"
        )
        assert auto_dtype("cuda") == torch.bfloat16  # CPUs only
    monkeypatch.setenv(AUTO_DTYPE_ENV, "fp8")
    with pytest.raises(ValueError, match=f"{AUTO_DTYPE_ENV} must be float32 or bfloat16"):
        auto_dtype("cpu")


def test_the_ready_line_names_the_dtype_the_workers_resolved_kv_tokens_context_and_threads(
    harness, monkeypatch
):
    """`auto` with the environment forcing the dtype this CPU would not pick: the workers (Ray
    actors) get the override, and the ready line says what they chose and why."""
    other = "float32" if NATIVE_BF16 else "bfloat16"
    monkeypatch.setenv(AUTO_DTYPE_ENV, other)
    system = harness.start(dtype="auto", num_prefill=1, num_decode=1)
    try:
        line = system.system.ready_line()
        workers = system.stats().workers
    finally:
        system.stop()
    assert f"dtype {other} (auto: ${AUTO_DTYPE_ENV}={other})" in line, line
    context = re.search(r"context (\d+) tokens \(model (\d+)\)", line)
    assert context and 0 < int(context[1]) <= int(context[2]), line
    for role in ("prefill", "decode"):
        worker = next(w for w in workers if w.role == role)
        assert (
            f"1 {role} x {worker.threads} thread(s), {worker.kv_capacity_tokens} KV tokens each"
            in line
        ), line


@pytest.mark.parametrize("flag", ["--port", "--http-port"])
def test_a_taken_port_is_one_line_and_a_quick_nonzero_exit_with_nothing_left(flag):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        other = ["--http-port", "0"] if flag == "--port" else ["--port", "0"]
        started = time.monotonic()
        served = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "serve", flag, str(port), *other],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert served.returncode == 1, served.stderr
    # refused before Ray and the workers start (those take 5-20 s)
    assert time.monotonic() - started < 10
    lines = served.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in served.stderr, served.stderr
    assert f"127.0.0.1:{port}" in lines[0] and flag in lines[0], lines[0]
