"""The autoscaling policy: which pool is the bottleneck, from signals the router already has.

Reactive (the default): prefill grows when requests wait too long for their first token (queue time
or TTFT over target); decode grows when its KV cache runs full or requests wait for KV room. A pool
shrinks after it has been quiet for `idle_s`.
With a plan (`pdserve serve --autoscale plan --autoscale-plan FILE`, FILE written by `pdserve plan
--json`, one plan or a list for several rates): each pool is steered to the size planned for the
arrival rate the router sees (the plan of the lowest planned rate at or above it; above them all,
the highest). A pool still grows past its planned size when the reactive signals press (the plan was
wrong), and comes back to it once they have been quiet for `idle_s`.
Either way each pool changes by one worker at a time and not again before `cooldown_s`.
The policy is a pure function of its inputs and the time it is given, so tests drive it directly.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

RATE_WINDOW_S = 30.0  # the arrival rate is measured over this much of the recent past


@dataclass(frozen=True)
class PlannedSize:
    rate_rps: float
    mode: str  # "disaggregated" or "colocated"
    prefill: int  # 0 when colocated
    decode: int
    cpus_per_worker: float


@dataclass(frozen=True)
class PlanTarget:
    """The pool sizes `pdserve plan` chose, by rate, ascending."""

    sizes: tuple[PlannedSize, ...]

    def __post_init__(self) -> None:
        if not self.sizes:
            raise ValueError("an autoscale plan needs at least one planned size")
        if len({s.mode for s in self.sizes}) > 1:
            raise ValueError("an autoscale plan mixes colocated and disaggregated shapes")

    @property
    def mode(self) -> str:
        return self.sizes[0].mode

    def for_rate(self, rate_rps: Optional[float]) -> Optional[PlannedSize]:
        """The size planned for `rate_rps`; None (rate unknown) unless the plan has one size
        only."""
        if rate_rps is None:
            return self.sizes[0] if len(self.sizes) == 1 else None
        return next((s for s in self.sizes if s.rate_rps >= rate_rps - 1e-9), self.sizes[-1])

    @classmethod
    def from_json(cls, data) -> "PlanTarget":
        plans = data if isinstance(data, list) else [data]
        sizes = []
        for plan in plans:
            if plan.get("shape") is None:
                raise ValueError(
                    f"the plan for {plan.get('rate_rps')} req/s found no shape meeting its SLO"
                )
            sizes.append(
                PlannedSize(
                    float(plan["rate_rps"]),
                    plan["mode"],
                    int(plan["num_prefill"]),
                    int(plan["num_decode"]),
                    float(plan["cpus_per_worker"]),
                )
            )
        return cls(tuple(sorted(sizes, key=lambda s: s.rate_rps)))

    @classmethod
    def load(cls, path: str | Path) -> "PlanTarget":
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except (KeyError, TypeError, json.JSONDecodeError) as error:
            raise ValueError(
                f"{path}: not the output of `pdserve plan --json` ({error!r})"
            ) from None


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
    plan: Optional[PlanTarget] = None  # None: reactive only

    def __post_init__(self) -> None:
        if (
            not 1 <= self.min_prefill <= self.max_prefill
            or not 1 <= self.min_decode <= self.max_decode
        ):
            raise ValueError("autoscale bounds need 1 <= min <= max for both pools")
        for size in self.plan.sizes if self.plan else ():
            if size.decode > self.max_decode or size.prefill > self.max_prefill:
                raise ValueError(
                    f"the plan for {size.rate_rps:g} req/s wants {size.prefill} prefill + "
                    f"{size.decode} decode workers, beyond --max-prefill {self.max_prefill} / "
                    f"--max-decode {self.max_decode}"
                )


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
    # requests the router has taken in since it started (None: not counted); its rate of change is
    # the arrival rate a plan is looked up by
    requests_arrived: Optional[int] = None


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
    _pressed_since_s: dict = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})
    _arrivals: deque = field(default_factory=deque)  # (time s, requests arrived)

    def arrival_rate_rps(self, now_s: float, signals: Signals) -> Optional[float]:
        """Requests per second over the last RATE_WINDOW_S (None: not counted, or one sample
        yet)."""
        if signals.requests_arrived is None:
            return None
        self._arrivals.append((now_s, signals.requests_arrived))
        while len(self._arrivals) > 2 and now_s - self._arrivals[1][0] >= RATE_WINDOW_S:
            self._arrivals.popleft()
        (first_s, first), (last_s, last) = self._arrivals[0], self._arrivals[-1]
        return (last - first) / (last_s - first_s) if last_s > first_s else None

    def decide(self, now_s: float, signals: Signals) -> list[Decision]:
        c = self.config
        decisions = []
        prefill_slow = ((signals.queue_p50_s or 0.0) > c.queue_target_s) or (
            (signals.ttft_p50_s or 0.0) > c.ttft_target_s
        )
        decode_full = signals.decode_kv_use > c.kv_use_high or signals.waiting_for_kv > 0
        idle = signals.requests_in_flight == 0
        rate = self.arrival_rate_rps(now_s, signals)
        planned = c.plan.for_rate(rate) if c.plan else None
        for pool, size, low, high, pressed, why in (
            (
                "prefill",
                signals.prefill_workers,
                c.min_prefill,
                c.max_prefill,
                prefill_slow,
                f"queue p50 {signals.queue_p50_s or 0:.2f} s / "
                f"TTFT p50 {signals.ttft_p50_s or 0:.2f} s over target",
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
            if pressed:
                self._pressed_since_s[pool] = now_s
            if now_s - self._last_change_s[pool] < c.cooldown_s:
                continue
            target = None
            if planned is not None and not (planned.mode == "colocated" and pool == "prefill"):
                target = min(max(getattr(planned, pool), low), high)
            at_rate = f"planned for {planned.rate_rps:g} req/s" if planned else ""
            if rate is not None and planned is not None:
                at_rate += f", arriving at {rate:.2f} req/s"
            if target is not None and size < target:
                decisions.append(Decision(pool, size + 1, f"plan: {target} {at_rate}"))
            elif pressed and size < high:
                decisions.append(Decision(pool, size + 1, f"grow: {why}"))
            elif (
                target is not None
                and size > target
                and now_s - self._pressed_since_s[pool] >= c.idle_s
            ):
                decisions.append(
                    Decision(
                        pool,
                        size - 1,
                        f"plan: {target} {at_rate}; quiet for "
                        f"{now_s - self._pressed_since_s[pool]:.0f} s",
                    )
                )
            elif (
                target is None
                and idle
                and size > low
                and now_s - self._busy_since_s[pool] >= c.idle_s
            ):
                decisions.append(
                    Decision(
                        pool, size - 1, f"shrink: idle for {now_s - self._busy_since_s[pool]:.0f} s"
                    )
                )
            else:
                continue
            self._last_change_s[pool] = now_s
        return decisions
