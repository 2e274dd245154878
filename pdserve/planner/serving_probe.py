"""The serving path's own costs (`ServingCosts`), fitted on a running system against the simulator.

The engine steps (profiler.py) are not what a client sees: the router admits and tokenizes, Ray
calls reach the workers, every decode step's tokens travel to the router and on to the client, all
on the cores the workers compute on; and a step on cores borrowed from another worker
(runtime/cores.py) costs more than the engine's step at that thread count. This probe starts
`pdserve serve --prefill 1 --decode 1` and sends it loads with `pdserve bench` (512 prompt tokens,
128 output tokens, ignore-eos):
- with `--lend-cores off` (each worker on its own core, where the simulator's core model is exact,
  so what is left is the serving path alone): A, one request at a time; B, `concurrency` at a time;
- with lending on: C, one request at a time, so each step runs on the other worker's idle core too.
The simulator runs the same loads on the profile, and what it misses is fitted:
- the engine's steps as the servers ran them, against the profile's: prefill_share = the server's
  prefill time in A (`pdserve bench`'s median_server_prefill_ms) / the profile's - 1, decode_share =
  the decode worker's mean step in A (median_server_decode_step_ms) / the simulator's TPOT of A on
  the profile - 1; every engine step is charged so (this VM ran 4-15 % slower in the probe than in
  the profile's first minutes, and a system under sustained load runs as the probe found it). The
  engine's own prefill, timed in this process just before and after the servers, is recorded
  beside them: it tells the machine's speed from what serving adds to a step (nothing measurable on
  an AVX2 EPYC, 2026-12-04);
- request_s = TTFT_A - the server's prefill time of A's requests - what the simulator adds to the
  profile's prefill;
- step_s + b x token_s = TPOT - the simulator's TPOT with its decode steps as the server ran them,
  at b = 1 (A) and b = concurrency (B);
- borrow_prefill_share = the server's prefill time in C / its time in A x the engine's 1-thread /
  2-thread prefill time - 1 (a share of the step: the cost grows with it; measured on an AVX2
  EPYC, a flat cost fitted on a 512-token prompt put the conversations' short later turns 2-3x too
  slow), and borrow_decode_s = TPOT_C - sim TPOT_C, the costs above included.
Figures without the server's times (other backends) fit TTFT and TPOT against the simulator's alone.
Loads of one shape, fitted once: the validation runs (other shapes, Poisson rates) check them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

from pdserve.planner.profile import Profile, ServingCosts

PROMPT_TOKENS = 512
OUTPUT_TOKENS = 128
# The probe's servers as the simulator models them: every prompt on the prefill worker (the PD
# policy would send one of a batch load's prompts local: not the serving path's cost), and a
# prefill step taking every waiting prompt (the planner does not model a CPU's first come first
# served yet)
PROBE_SHAPE = "1p1d@0.5/remote"
PROBE_FLAGS = ["--pd-policy", "remote", "--cpu-prefill-batch-tokens", "0"]
_PDSERVE = [sys.executable, "-m", "pdserve.cli"]


def measure_serving(
    profile: Profile,
    concurrency: int = 4,
    lone_requests: int = 5,
    log: Callable[[str], None] = lambda line: None,
) -> ServingCosts:
    engine_prefill_ms = engine_prefill_timer(profile.machine.get("dtype", "auto"))
    before_ms = engine_prefill_ms()
    log(f"serving probe: the engine alone prefills {PROMPT_TOKENS} tokens in {before_ms:.1f} ms")
    with _Server(profile, lend_cores="off") as port:
        log(
            f"serving probe: pdserve serve --prefill 1 --decode 1 --lend-cores off "
            f"{' '.join(PROBE_FLAGS)}, port {port}"
        )
        lone = _bench(port, lone_requests, 1, seed=5)
        log(
            f"  one at a time: TTFT p50 {lone['p50_ttft_ms']:.1f}, "
            f"TPOT p50 {lone['p50_tpot_ms']:.1f} ms"
        )
        batch = _bench(port, 2 * concurrency, concurrency, seed=6)
        log(f"  {concurrency} at a time: TPOT p50 {batch['p50_tpot_ms']:.1f} ms")
    with _Server(profile, lend_cores="all") as port:
        log(f"serving probe: the same with --lend-cores all, port {port}")
        lent = _bench(port, lone_requests, 1, seed=7)
        log(
            f"  one at a time: TTFT p50 {lent['p50_ttft_ms']:.1f}, "
            f"TPOT p50 {lent['p50_tpot_ms']:.1f} ms"
        )
    after_ms = engine_prefill_ms()
    log(f"serving probe: the engine alone again: {after_ms:.1f} ms")
    return fit(profile, lone, batch, lone_requests, concurrency, lent, (before_ms + after_ms) / 2)


def engine_prefill_timer(dtype: str, repeats: int = 3) -> Callable[[], float]:
    """A timer of the engine's one-thread prefill of a fresh 512-token prompt in this process, ms
    (median of `repeats` after a warm-up): the probe's reference for what serving adds to a prefill
    step, timed beside the servers rather than minutes before with the profile. One engine for
    every timing."""
    import torch

    from pdserve.planner.profiler import prefill_once, timing_engine

    def one_thread(run: Callable):  # and this process's thread count as it was after
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return run()
        finally:
            torch.set_num_threads(threads)

    engine, random_prompt = one_thread(lambda: timing_engine(dtype, 2 * PROMPT_TOKENS, seed=1))

    def once() -> float:
        return prefill_once(engine, random_prompt(PROMPT_TOKENS))

    def timed_ms() -> float:
        once()
        return 1e3 * statistics.median(once() for _ in range(repeats))

    return lambda: one_thread(timed_ms)


def fit(
    profile: Profile,
    lone: dict,
    batch: dict,
    lone_requests: int,
    concurrency: int,
    lent: Optional[dict] = None,
    engine_beside_ms: Optional[float] = None,
) -> ServingCosts:
    """`ServingCosts` from the loads' measured figures (`pdserve bench` result keys, ms): `lone` and
    `batch` with lending off fit the serving path; `lent`, one at a time with lending on (each step
    then runs on the other worker's idle core too), the cost of a step on borrowed cores;
    `engine_beside_ms`, the engine's 512-token prefill timed beside the loads, for the record."""
    from pdserve.planner.shape import SystemShape
    from pdserve.planner.simulator import simulate
    from router.slo import SLO

    engine_only = profile.with_serving(None)
    shape = SystemShape.parse(PROBE_SHAPE, lend_cores=False)
    slo = SLO.parse("ttft:1000,tpot:50")  # only the lending slack reads it; the loads are light
    sim_lone = simulate(engine_only, shape, slo, closed_loop(lone_requests, 1))
    sim_batch = simulate(engine_only, shape, slo, closed_loop(2 * concurrency, concurrency))
    prefill_1_ms, prefill_2_ms = (profile.chunk_s(0, PROMPT_TOKENS, t) * 1e3 for t in (1, 2))
    # The engine's prefill as the server timed it on the same requests, in place of the profile's
    # of minutes before: this VM's speed drifts, and the difference would land in the serving
    # path's cost (2026-12-04, AVX2 EPYC: client TTFT 1928 ms, server prefill 1895 ms, the profile's
    # 1668 ms: 33 ms per request, not 260).
    served_lone_ms = lone.get("median_server_prefill_ms")
    lone_prefill_ms = served_lone_ms or prefill_1_ms
    # ... and every prefill step runs as fast as the server ran it, not as the profile found it
    prefill_share = lone_prefill_ms / prefill_1_ms - 1
    request_s = max(
        0.0, (lone["p50_ttft_ms"] - lone_prefill_ms - sim_lone.ttft_ms["p50"] + prefill_1_ms) / 1e3
    )
    # Likewise the decode steps: every one runs as fast as the server ran A's, and what the client
    # saw beyond them is the serving path's (2026-12-04, AVX2 EPYC: a lone TPOT of 52.9 ms against
    # the profile's 40.3 ms step of minutes before fitted 10.4 ms per step, which runs 20 minutes
    # later did not pay)
    lone_step_ms = lone.get("median_server_decode_step_ms") or sim_lone.tpot_ms["p50"]
    decode_share = lone_step_ms / sim_lone.tpot_ms["p50"] - 1
    lone_extra_s = (lone["p50_tpot_ms"] - sim_lone.tpot_ms["p50"] * (1 + decode_share)) / 1e3
    batch_extra_s = (batch["p50_tpot_ms"] - sim_batch.tpot_ms["p50"] * (1 + decode_share)) / 1e3
    token_s = max(0.0, (batch_extra_s - lone_extra_s) / (concurrency - 1))
    step_s = max(0.0, lone_extra_s - token_s)
    fitted_from = {
        "shape": f"1p1d (pdserve serve --prefill 1 --decode 1 {' '.join(PROBE_FLAGS)})",
        "workload": f"{PROMPT_TOKENS} in / {OUTPUT_TOKENS} out, ignore-eos",
        "lend_cores_off_one_at_a_time": _figures(lone, sim_lone, lone_requests),
        f"lend_cores_off_{concurrency}_at_a_time": _figures(batch, sim_batch, 2 * concurrency),
        "engine_prefill_ms_beside": engine_beside_ms,
    }
    serving = ServingCosts(
        request_s,
        step_s,
        token_s,
        fitted_from,
        prefill_share=prefill_share,
        decode_share=decode_share,
    )
    if lent is None:
        return serving
    sim_lent = simulate(
        profile.with_serving(serving),
        SystemShape.parse(PROBE_SHAPE),
        slo,
        closed_loop(lone_requests, 1),
    )
    fitted_from["lend_cores_all_one_at_a_time"] = _figures(lent, sim_lent, lone_requests)
    lent_prefill_ms = lent.get("median_server_prefill_ms")
    if lent_prefill_ms is not None and served_lone_ms:
        # the server's prefill on borrowed cores against its prefill on one core in the first load
        # (another server, a few minutes before: drift between the two still lands here), scaled by
        # the engine's two-thread speed-up: what borrowing costs beyond the engine
        share = (lent_prefill_ms / lone_prefill_ms) * (prefill_1_ms / prefill_2_ms) - 1
    else:  # the client's TTFT against the simulator's
        share = (lent["p50_ttft_ms"] - sim_lent.ttft_ms["p50"]) / prefill_2_ms
    return replace(
        serving,
        # the lone prompt's prefill on both workers' cores: its home thread and the borrowed one
        borrow_prefill_share=max(0.0, share),
        borrow_decode_s=max(0.0, (lent["p50_tpot_ms"] - sim_lent.tpot_ms["p50"]) / 1e3),
    )


def closed_loop(requests: int, concurrency: int):
    """`requests` of 512/128 sent `concurrency` at a time, each slot's next as the one before ends
    (`pdserve bench --request-rate inf --max-concurrency C`), for the simulator."""
    from pdserve.planner.workload import Request

    return [
        Request(
            0.0,
            PROMPT_TOKENS,
            OUTPUT_TOKENS,
            index,
            0,
            follows=index - concurrency if index >= concurrency else None,
        )
        for index in range(requests)
    ]


def _figures(measured: dict, simulated, requests: int) -> dict:
    return {
        "requests": requests,
        "measured_ttft_p50_ms": measured["p50_ttft_ms"],
        "measured_tpot_p50_ms": measured["p50_tpot_ms"],
        "engine_only_ttft_p50_ms": simulated.ttft_ms["p50"],
        "engine_only_tpot_p50_ms": simulated.tpot_ms["p50"],
        "server_prefill_p50_ms": measured.get("median_server_prefill_ms"),
        "server_decode_step_p50_ms": measured.get("median_server_decode_step_ms"),
    }


class _Server:
    """`pdserve serve --prefill 1 --decode 1` on a free port, stopped (SIGTERM) on exit."""

    def __init__(self, profile: Profile, lend_cores: str):
        dtype = profile.machine.get("dtype", "auto")
        self.port = _free_port()
        self.command = [
            *_PDSERVE,
            "serve",
            "--prefill",
            "1",
            "--decode",
            "1",
            "--lend-cores",
            lend_cores,
            *PROBE_FLAGS,
            "--port",
            str(self.port),
        ] + ([] if dtype == "auto" else ["--dtype", dtype])

    def __enter__(self) -> int:
        self.process = subprocess.Popen(
            self.command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            _wait_ready(self.port, self.process)
            _bench(self.port, 2, 1, seed=99)  # warm-up, not recorded
        except BaseException:
            self.__exit__()
            raise
        return self.port

    def __exit__(self, *exc) -> None:
        self.process.send_signal(signal.SIGTERM)  # serve stops on SIGTERM
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _bench(port: int, requests: int, concurrency: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder) / "result.json"
        subprocess.run(
            [
                *_PDSERVE,
                "bench",
                "--backend",
                "grpc",
                "--port",
                str(port),
                "--dataset",
                "random",
                "--random-input-len",
                str(PROMPT_TOKENS),
                "--random-output-len",
                str(OUTPUT_TOKENS),
                "--num-prompts",
                str(requests),
                "--max-concurrency",
                str(concurrency),
                "--seed",
                str(seed),
                "--metric-percentiles",
                "50",
                "--disable-tqdm",
                "--save-result",
                "--result-file",
                str(result),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        figures = json.loads(result.read_text())["results"][0]
    if figures["failed"]:
        raise RuntimeError(f"serving probe: {figures['failed']} request(s) failed")
    return figures


def _wait_ready(port: int, server: subprocess.Popen, timeout_s: float = 300.0) -> None:
    from pdserve.client import PdserveClient

    deadline = time.monotonic() + timeout_s
    with PdserveClient("127.0.0.1", port) as client:
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise RuntimeError(f"serving probe: pdserve serve exited with {server.returncode}")
            if client.wait_ready(2.0):
                return
    raise TimeoutError(f"serving probe: pdserve serve not ready within {timeout_s:.0f} s")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
