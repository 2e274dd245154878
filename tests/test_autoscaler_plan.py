"""`--autoscale plan`: the autoscaler steers the pools to the sizes `pdserve plan` chose for the
arrival rate it sees, grows past them only under pressure, and comes back; `pdserve serve` reads the
plan file and refuses one that does not fit the system."""

from __future__ import annotations

import json

import pytest

from router.pools import AutoscaleConfig, AutoscalePolicy, PlanTarget, Signals


def plan_json(rate, prefill, decode, mode="disaggregated", cpus=0.5):
    return {
        "shape": f"{prefill}p{decode}d@{cpus:g}",
        "mode": mode,
        "num_prefill": prefill,
        "num_decode": decode,
        "cpus_per_worker": cpus,
        "rate_rps": rate,
    }


PLAN = PlanTarget.from_json([plan_json(4.0, 2, 3), plan_json(1.0, 1, 1), plan_json(2.0, 1, 2)])
CONFIG = AutoscaleConfig(max_prefill=3, max_decode=4, cooldown_s=10, idle_s=30, plan=PLAN)


def signals(prefill, decode, arrived, queue=0.05, in_flight=4):
    return Signals(prefill, decode, 0.2, queue, 0.3, 0, in_flight, requests_arrived=arrived)


def drive(policy, rate_rps, until_s, sizes, start_s=0.0, arrived=0, queue=0.05):
    """Requests arriving at `rate_rps` from `start_s`, a round every 2 s; applies the decisions."""
    log = []
    for t in range(int(start_s), int(until_s), 2):
        arrived += int(rate_rps * 2)
        s = signals(sizes["prefill"], sizes["decode"], arrived, queue=queue)
        for decision in policy.decide(float(t), s):
            sizes[decision.pool] = decision.size
            log.append((t, decision.pool, decision.size))
    return log, arrived


def test_plan_lookup_takes_the_lowest_planned_rate_covering_the_arrivals():
    assert [s.rate_rps for s in PLAN.sizes] == [1.0, 2.0, 4.0]
    assert (PLAN.for_rate(0.3).prefill, PLAN.for_rate(0.3).decode) == (1, 1)
    assert PLAN.for_rate(1.5).decode == 2
    assert PLAN.for_rate(2.0).decode == 2
    assert (PLAN.for_rate(9.0).prefill, PLAN.for_rate(9.0).decode) == (2, 3)
    assert PLAN.for_rate(None) is None  # several rates: the rate must be known
    one = PlanTarget.from_json(plan_json(2.0, 1, 2))
    assert one.for_rate(None).decode == 2  # one plan: a fixed target


def test_pools_follow_the_plan_as_the_rate_rises_and_falls():
    policy = AutoscalePolicy(CONFIG)
    sizes = {"prefill": 1, "decode": 1}
    # 4 req/s: step by step (one worker per pool per cooldown) to the 4 req/s plan, 2P + 3D
    log, arrived = drive(policy, 4.0, 60, sizes)
    assert sizes == {"prefill": 2, "decode": 3}
    assert [(p, n) for _, p, n in log] == [("prefill", 2), ("decode", 2), ("decode", 3)]
    assert log[0][0] == 2  # the first round with a rate (two samples)
    # the rate falls to 1 req/s: back to 1P + 1D once the 30 s window has forgotten the burst
    log, _ = drive(policy, 1.0, 200, sizes, start_s=60, arrived=arrived)
    assert sizes == {"prefill": 1, "decode": 1}
    assert all(t >= 60 for t, _, _ in log) and [n for _, p, n in log if p == "decode"] == [2, 1]


def test_pressure_grows_past_the_plan_and_quiet_returns_to_it():
    policy = AutoscalePolicy(CONFIG)
    sizes = {"prefill": 1, "decode": 1}
    # at 1 req/s the plan is 1P + 1D, but requests queue for prefill: grow past it
    log, arrived = drive(policy, 1.0, 30, sizes, queue=2.0)
    assert ("prefill", 2) in [(p, n) for _, p, n in log] and sizes["decode"] == 1
    grown = sizes["prefill"]
    assert grown >= 2
    # the queue drains: after 30 s without pressure, back to the plan's single prefill worker
    log, _ = drive(policy, 1.0, 150, sizes, start_s=30, arrived=arrived)
    assert sizes == {"prefill": 1, "decode": 1}
    shrinks = [t for t, p, _ in log if p == "prefill"]
    assert shrinks and shrinks[0] >= 28 + 30


def test_reactive_without_a_plan_ignores_the_rate():
    policy = AutoscalePolicy(AutoscaleConfig(max_prefill=3, max_decode=4, cooldown_s=10))
    sizes = {"prefill": 1, "decode": 1}
    log, _ = drive(policy, 4.0, 60, sizes)
    assert log == [] and sizes == {"prefill": 1, "decode": 1}


def test_config_refuses_a_plan_beyond_its_bounds_or_without_a_shape():
    with pytest.raises(ValueError, match="beyond --max-prefill 1 / --max-decode 4"):
        AutoscaleConfig(max_prefill=1, plan=PLAN)
    with pytest.raises(ValueError, match="found no shape"):
        PlanTarget.from_json({"shape": None, "rate_rps": 3.0})
    with pytest.raises(ValueError, match="mixes colocated and disaggregated"):
        PlanTarget.from_json([plan_json(1.0, 1, 1), plan_json(2.0, 0, 2, mode="colocated")])


def test_serve_flags_read_the_plan_file(tmp_path):
    import argparse

    from pdserve.cli import _serve_config, build_parser

    path = tmp_path / "plan.json"
    path.write_text(json.dumps([plan_json(1.0, 1, 1), plan_json(2.0, 1, 2)]))
    parser: argparse.ArgumentParser = build_parser()

    def config(*flags):
        return _serve_config(parser.parse_args(["serve", *flags]))

    planned = config("--autoscale", "plan", "--autoscale-plan", str(path)).autoscale
    assert planned.plan.for_rate(1.5).decode == 2
    assert config("--autoscale").autoscale.plan is None  # reactive, as before
    with pytest.raises(ValueError, match="go together"):
        config("--autoscale", "plan")
    with pytest.raises(ValueError, match="plans a disaggregated system"):
        config("--mode", "colocated", "--autoscale", "plan", "--autoscale-plan", str(path))
    with pytest.raises(ValueError, match="CPUs; this system's are --cpus-per-worker 1"):
        config("--cpus-per-worker", "1", "--autoscale", "plan", "--autoscale-plan", str(path))
