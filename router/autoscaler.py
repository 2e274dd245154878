"""The autoscaling policy: which pool is the bottleneck, from signals the router already has.

Prefill grows when requests wait too long for their first token (queue time or TTFT over target);
decode grows when its KV cache runs full or requests wait for KV room. A pool shrinks after it has been
quiet for `idle_s`. Each pool changes by one worker at a time and not again before `cooldown_s`.
The policy is a pure function of its inputs and the time it is given, so tests drive it directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class AutoscaleConfig:
    min_prefill: int = 1
    max_prefill: int = 4
    min_decode: int = 1
    max_decode: int = 4
    cooldown_s: float = 30.0
    idle_s: float = 60.0
    ttft_target_s: float = 1.0
    queue_target_s: float = 0.5
    kv_use_high: float = 0.8  # fraction of decode KV blocks in use that counts as "full"
    interval_s: float = 2.0

    def __post_init__(self) -> None:
        if (
            not 1 <= self.min_prefill <= self.max_prefill
            or not 1 <= self.min_decode <= self.max_decode
        ):
            raise ValueError("autoscale bounds need 1 <= min <= max for both pools")


@dataclass(frozen=True)
class Signals:
    """What the router saw over the last interval."""

    prefill_workers: int
    decode_workers: int
    ttft_p50_s: Optional[float]  # None: no request finished its prefill in the window
    queue_p50_s: Optional[float]
    decode_kv_use: float  # used / total blocks over the ready decode workers
    waiting_for_kv: int  # requests the router is holding until a decode worker has room
    requests_in_flight: int


@dataclass(frozen=True)
class Decision:
    pool: str  # "prefill" or "decode"
    size: int
    reason: str


@dataclass
class AutoscalePolicy:
    config: AutoscaleConfig
    _last_change_s: dict = field(
        default_factory=lambda: {"prefill": float("-inf"), "decode": float("-inf")}
    )
    _busy_since_s: dict = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})

    def decide(self, now_s: float, signals: Signals) -> list[Decision]:
        c = self.config
        decisions = []
        prefill_slow = ((signals.queue_p50_s or 0.0) > c.queue_target_s) or (
            (signals.ttft_p50_s or 0.0) > c.ttft_target_s
        )
        decode_full = signals.decode_kv_use > c.kv_use_high or signals.waiting_for_kv > 0
        idle = signals.requests_in_flight == 0
        for pool, size, low, high, pressed, why in (
            (
                "prefill",
                signals.prefill_workers,
                c.min_prefill,
                c.max_prefill,
                prefill_slow,
                f"queue p50 {signals.queue_p50_s or 0:.2f} s / TTFT p50 {signals.ttft_p50_s or 0:.2f} s over target",
            ),
            (
                "decode",
                signals.decode_workers,
                c.min_decode,
                c.max_decode,
                decode_full,
                f"KV use {signals.decode_kv_use:.0%}, {signals.waiting_for_kv} waiting for KV room",
            ),
        ):
            if not idle:
                self._busy_since_s[pool] = now_s
            if now_s - self._last_change_s[pool] < c.cooldown_s:
                continue
            if pressed and size < high:
                decisions.append(Decision(pool, size + 1, f"grow: {why}"))
            elif idle and size > low and now_s - self._busy_since_s[pool] >= c.idle_s:
                decisions.append(
                    Decision(
                        pool, size - 1, f"shrink: idle for {now_s - self._busy_since_s[pool]:.0f} s"
                    )
                )
            else:
                continue
            self._last_change_s[pool] = now_s
        return decisions
