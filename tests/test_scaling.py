"""Resizing the pools while serving: new workers take requests once ready; removed ones drain
first."""

import threading
import time

import pytest


@pytest.fixture(scope="module")
def system(harness):
    running = harness.start(transport="ray")
    yield running
    running.stop()


class SteadyLoad:
    """A few client threads sending short greedy requests back to back until stopped."""

    def __init__(self, system, threads: int = 3):
        self.system = system
        self.completions, self.errors = [], []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def _run(self, index: int) -> None:
        with self.system.client(timeout_s=120) as client:
            while not self._stop.is_set():
                try:
                    self.completions.append(
                        client.chat(
                            f"Say one word about the number {index}.", max_tokens=6, temperature=0
                        )
                    )
                except Exception as error:  # every failure is a test failure: collect, assert later
                    self.errors.append(error)

    def stop(self):
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)
        return self


def _decode_workers(system):
    return sorted(w.worker_id for w in system.stats().workers if w.role == "decode")


def test_scale_decode_up_then_down_under_load(system):
    load = SteadyLoad(system)
    try:
        time.sleep(2)
        started = time.monotonic()
        with system.client() as client:
            reply = client.scale(decode=2)
        scale_up_s = time.monotonic() - started
        assert reply.decode == 2 and reply.prefill == 1
        assert _decode_workers(system) == ["decode-0", "decode-1"]
        served_before = len(load.completions)
        deadline = time.monotonic() + 30
        while not any(c.decode_worker == "decode-1" for c in load.completions[served_before:]):
            assert time.monotonic() < deadline, "no request reached the new decode worker"
            time.sleep(0.2)
        with system.client() as client:
            assert client.scale(decode=1).decode == 1  # one worker starts draining now
        deadline = time.monotonic() + 60
        while len(_decode_workers(system)) > 1:
            assert time.monotonic() < deadline, "the drained worker never stopped"
            time.sleep(0.2)
        time.sleep(1)  # the load keeps running on the survivor
    finally:
        load.stop()
    assert not load.errors, load.errors[:3]
    assert len(load.completions) > 10 and all(
        c.finish_reason in ("stop", "length") and c.token_ids for c in load.completions
    )
    stats = system.wait_idle()
    assert all(w.kv_blocks_free == w.kv_blocks_total for w in stats.workers)
    # the drained worker had freed all its KV before it stopped
    [removed] = system.system.pools.stopped
    assert (
        removed.worker_id in ("decode-0", "decode-1")
        and removed.kv_blocks_free == removed.kv_blocks_total
    )
    print(f"scale-up to a serving worker: {scale_up_s:.1f} s")


def test_scale_rejects_impossible_sizes(system):
    import grpc

    with system.client() as client:
        with pytest.raises(grpc.RpcError) as failure:
            client.scale(decode=0)
        assert (
            failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            and "at least 1" in failure.value.details()
        )
        # More workers than the local Ray node has CPUs for: refused at once, not left pending
        # forever.
        before = _decode_workers(system)
        with pytest.raises(grpc.RpcError) as failure:
            client.scale(decode=50, timeout_s=60)
        assert failure.value.code() == grpc.StatusCode.FAILED_PRECONDITION, failure.value.details()
        assert f"need {49 * system.system.config.worker_cpus:g} CPU" in failure.value.details(), (
            failure.value.details()
        )
        assert "free" in failure.value.details()
        assert _decode_workers(system) == before
        assert (
            len(
                client.chat(
                    "Still serving?", max_tokens=4, temperature=0, ignore_eos=True
                ).token_ids
            )
            == 4
        )


def test_status_json_lists_every_worker_with_role_node_and_state(system):
    import json
    import subprocess
    import sys

    with system.client() as client:
        client.chat("Hello!", max_tokens=4, temperature=0)
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "status", "--port", str(system.port), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    workers = status["workers"]
    assert sorted(w["role"] for w in workers) == ["decode", "prefill"]
    assert all(w["node"] and w["state"] == "ready" for w in workers)
    assert status["recent_ttft_p50_s"] > 0 and status["mode"] == "disaggregated"
    missing = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "status", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 1 and "no server ready" in missing.stderr


def test_autoscaler_grows_the_bottleneck_pool_under_load_and_shrinks_it_after(system, harness):
    from router.pools import AutoscaleConfig

    system.stop()  # two systems would crowd two cores; this test brings its own
    # Any real prefill misses a 10 ms TTFT target, and KV never counts as full: prefill is the
    # bottleneck.
    config = AutoscaleConfig(
        max_prefill=2,
        max_decode=2,
        ttft_target_s=0.01,
        queue_target_s=10.0,
        kv_use_high=1.01,
        cooldown_s=1.0,
        idle_s=3.0,
        interval_s=0.5,
    )
    scaled = harness.start(transport="ray", autoscale=config)
    try:
        load = SteadyLoad(scaled, threads=2)
        try:
            deadline = time.monotonic() + 60
            while sorted(w.worker_id for w in scaled.stats().workers if w.role == "prefill") != [
                "prefill-0",
                "prefill-1",
            ]:
                assert time.monotonic() < deadline, "prefill never grew under load"
                time.sleep(0.5)
        finally:
            load.stop()
        deadline = time.monotonic() + 60
        while len([w for w in scaled.stats().workers if w.role == "prefill"]) != 1:
            assert time.monotonic() < deadline, "prefill never shrank after the load stopped"
            time.sleep(0.5)
        stats = scaled.stats()
        # decode was never the bottleneck
        assert [w.role for w in stats.workers].count("decode") == 1
        assert any("prefill -> 2: grow" in line for line in stats.autoscaler_decisions)
        assert any("prefill -> 1: shrink" in line for line in stats.autoscaler_decisions)
        assert not load.errors
    finally:
        scaled.stop()


def test_a_planned_autoscaler_steers_the_pools_by_the_arrival_rate_the_router_counts(harness):
    from router.pools import AutoscaleConfig, PlannedSize, PlanTarget

    # Any arrivals at all are above the plan's second rate, so it asks for a second prefill worker;
    # the reactive signals never press (targets no request misses), so only the counted rate can.
    plan = PlanTarget(
        (
            PlannedSize(0.0, "disaggregated", prefill=1, decode=1, cpus_per_worker=1.0),
            PlannedSize(0.01, "disaggregated", prefill=2, decode=1, cpus_per_worker=1.0),
        )
    )
    config = AutoscaleConfig(
        max_prefill=2,
        max_decode=1,
        ttft_target_s=1e6,
        queue_target_s=1e6,
        kv_use_high=1.01,
        cooldown_s=1.0,
        idle_s=1e6,
        interval_s=0.5,
        plan=plan,
    )
    planned = harness.start(transport="ray", autoscale=config)
    try:
        load = SteadyLoad(planned, threads=1)
        try:
            deadline = time.monotonic() + 60
            while len([w for w in planned.stats().workers if w.role == "prefill"]) != 2:
                assert time.monotonic() < deadline, "the plan never grew prefill under arrivals"
                time.sleep(0.5)
        finally:
            load.stop()
        decisions = planned.stats().autoscaler_decisions
        assert any(
            "prefill -> 2: plan: 2 planned for 0.01 req/s, arriving at" in d for d in decisions
        )
        assert not load.errors
    finally:
        planned.stop()
