"""The autoscaling policy under synthetic load: it grows the bottleneck pool, then shrinks when
idle."""

import pytest

from router.pools import AutoscaleConfig, AutoscalePolicy, Signals

CONFIG = AutoscaleConfig(
    min_prefill=1, max_prefill=3, min_decode=1, max_decode=3, cooldown_s=10, idle_s=30
)


def signals(prefill=1, decode=1, ttft=0.2, queue=0.05, kv_use=0.3, waiting=0, in_flight=4):
    return Signals(prefill, decode, ttft, queue, kv_use, waiting, in_flight)


def run(policy, timeline):
    """Feeds (time, signals) pairs; returns the decisions as (time, pool, size)."""
    return [(t, d.pool, d.size) for t, s in timeline for d in policy.decide(t, s)]


def test_long_prompts_grow_prefill_only_then_idle_shrinks_it():
    policy = AutoscalePolicy(CONFIG)
    sizes = {"prefill": 1, "decode": 1}
    log = []
    for t in range(0, 120, 2):
        busy = t < 40  # a burst of long prompts: prefill queues up, decode has room
        s = signals(
            prefill=sizes["prefill"],
            decode=sizes["decode"],
            queue=1.5 if busy else 0.0,
            ttft=2.0 if busy else None,
            in_flight=8 if busy else 0,
        )
        for decision in policy.decide(float(t), s):
            sizes[decision.pool] = decision.size
            log.append((t, decision.pool, decision.size))
    # last busy sample at t=38: idle for 30 s at t=68, then one more step after the 10 s cooldown
    assert log == [(0, "prefill", 2), (10, "prefill", 3), (68, "prefill", 2), (78, "prefill", 1)]


def test_long_outputs_grow_decode_on_kv_pressure_within_bounds():
    policy = AutoscalePolicy(CONFIG)
    timeline = [
        (float(t), signals(decode=min(1 + t // 10, 3), kv_use=0.95, waiting=3))
        for t in range(0, 60, 5)
    ]
    decisions = run(policy, timeline)
    # capped at max
    assert [(pool, size) for _, pool, size in decisions] == [("decode", 2), ("decode", 3)]


def test_cooldown_and_bounds_are_respected():
    policy = AutoscalePolicy(CONFIG)
    assert run(policy, [(0.0, signals(queue=2.0)), (5.0, signals(prefill=2, queue=2.0))]) == [
        (0.0, "prefill", 2)
    ]
    idle = AutoscalePolicy(CONFIG)
    # already at min
    assert run(idle, [(float(t), signals(in_flight=0)) for t in range(0, 100, 5)]) == []
    with pytest.raises(ValueError):
        AutoscaleConfig(min_decode=3, max_decode=2)
