"""A system's configuration as the simulator and planner see it: what `pdserve serve` would be told.

Written `1p1d`, `2p2d@0.5` (CPUs per worker after `@`), `colo2`, with `/remote` or `/local` for a PD
policy other than auto: `2p1d@1/remote`. The router's own configs are built from it (`pd`,
`routing`), so the simulator decides with the router's code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from router.kv_index import RoutingConfig
from router.pd_policy import POLICIES, PREFILL_ORDERS, PDPolicyConfig

MODES = ("disaggregated", "colocated")
_TEXT = re.compile(r"^(?:(\d+)p(\d+)d|colo(\d+))(?:@([0-9.]+))?(?:/(\w+))?$")


_RATE_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_LINK = re.compile(r"^\s*([0-9.]+)\s*(kbit|mbit|gbit)\s*(?:,\s*([0-9.]+)\s*(us|ms|s))?\s*$")
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclass(frozen=True)
class Link:
    """The network between the prefill and the decode pool's nodes (`--link 1gbit,0.5ms`): a
    handoff costs the profiled one (the transport's own work, on one host) plus its bytes at this
    rate plus the round trip. None: both pools on the profiled host."""

    rate_bits_per_s: float
    rtt_s: float = 0.0

    @classmethod
    def parse(cls, text: str) -> "Link":
        match = _LINK.match(text.lower())
        if match is None:
            raise ValueError(f"--link {text!r}: expected a rate and a round trip, e.g. 1gbit,0.5ms")
        rate, unit, rtt, rtt_unit = match.groups()
        link = cls(float(rate) * _RATE_UNITS[unit], float(rtt or 0) * _TIME_UNITS[rtt_unit or "s"])
        if not link.rate_bits_per_s > 0:
            raise ValueError(f"--link {text!r}: the rate must be positive")
        return link

    def wire_s(self, kv_bytes: int) -> float:
        return kv_bytes * 8 / self.rate_bits_per_s + self.rtt_s


@dataclass(frozen=True)
class SystemShape:
    mode: str = "disaggregated"
    num_prefill: int = 1
    num_decode: int = 1  # colocated: the workers doing both
    cpus_per_worker: float = 1.0  # Ray's CPUs; a worker computes with max(1, whole CPUs) threads
    pd_policy: str = "auto"
    local_prefill_max_tokens: int = 256
    decode_interleave_tokens: Optional[int] = 256  # the system's default (pdserve serve)
    # Serving's default on a CPU is 256 (long prompts one at a time); the planner still models a
    # step taking every waiting prompt the budget holds, as the serving probe's fitted costs assume
    # (its load of four prompts sent together); set it to model serving's first come first served
    cpu_prefill_batch_tokens: Optional[int] = None
    # the prefill queue's order (`pdserve serve --prefill-order`): slo, fcfs
    prefill_order: str = "slo"
    routing: str = "prefix"
    lend_cores: bool = True  # idle cores, and decode cores within TPOT slack (runtime/cores.py)
    transport: str = "ray"
    max_num_batched_tokens: int = 2048
    link: Optional[Link] = None  # between the pools' nodes; None: one host

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.num_decode < 1 or (self.mode == "disaggregated" and self.num_prefill < 1):
            raise ValueError(
                "need at least one decode worker, and one prefill worker when disaggregated"
            )
        if not self.cpus_per_worker > 0:
            raise ValueError(f"cpus_per_worker must be positive, got {self.cpus_per_worker}")
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(
                f"prefill order must be one of {', '.join(PREFILL_ORDERS)}, "
                f"got {self.prefill_order!r}"
            )
        if self.pd_policy not in POLICIES:
            raise ValueError(
                f"pd policy must be one of {', '.join(POLICIES)}, got {self.pd_policy!r}"
            )

    @classmethod
    def parse(cls, text: str, **overrides) -> "SystemShape":
        match = _TEXT.match(text.strip().lower())
        if match is None:
            raise ValueError(
                f"system shape {text!r}: expected e.g. 1p1d, 2p2d@0.5, colo2, 2p1d@1/remote"
            )
        prefill, decode, colocated, cpus, policy = match.groups()
        fields = (
            dict(mode="colocated", num_prefill=0, num_decode=int(colocated))
            if colocated
            else dict(num_prefill=int(prefill), num_decode=int(decode))
        )
        if cpus:
            fields["cpus_per_worker"] = float(cpus)
        if policy:
            fields["pd_policy"] = policy
        return cls(**{**fields, **overrides})

    def __str__(self) -> str:
        base = (
            f"colo{self.num_decode}"
            if self.mode == "colocated"
            else f"{self.num_prefill}p{self.num_decode}d"
        )
        policy = (
            f"/{self.pd_policy}"
            if self.mode == "disaggregated" and self.pd_policy != "auto"
            else ""
        )
        return f"{base}@{self.cpus_per_worker:g}{policy}"

    @property
    def num_workers(self) -> int:
        return self.num_decode + (self.num_prefill if self.mode == "disaggregated" else 0)

    @property
    def threads_per_worker(self) -> int:
        return max(1, int(self.cpus_per_worker))

    @property
    def total_cpus(self) -> float:
        return self.num_workers * self.cpus_per_worker

    @property
    def pd(self) -> PDPolicyConfig:
        return PDPolicyConfig(self.pd_policy, self.local_prefill_max_tokens)

    @property
    def routing_config(self) -> RoutingConfig:
        return RoutingConfig(self.routing)

    def serve_flags(self) -> str:
        """The `pdserve serve` flags of this shape."""
        if self.mode == "colocated":
            flags = f"--mode colocated --decode {self.num_decode}"
        else:
            flags = (
                f"--prefill {self.num_prefill} --decode {self.num_decode} "
                f"--pd-policy {self.pd_policy}"
            )
            if self.prefill_order != "slo":
                flags += f" --prefill-order {self.prefill_order}"
        return f"{flags} --cpus-per-worker {self.cpus_per_worker:g} --transport {self.transport}"
