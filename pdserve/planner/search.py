"""`pdserve plan`: the cheapest system that meets the SLO at a rate, or the highest rate a size
holds.

A shape meets the target when at least `attainment` of the simulated requests (default 90 %) meet
both SLO targets (router/slo.py). Cost is the CPUs Ray accounts to the workers (workers x CPUs per
worker; on GPUs read it as devices): shapes are tried cheapest first, every shape of a cost is
simulated, and the first cost with a shape that meets the target wins; among those, the highest
attainment, then the fewest workers. The same workload draw (its seed) is used for every shape, so
they are compared on the same requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from pdserve.planner.profile import Profile
from pdserve.planner.report import Report
from pdserve.planner.shape import Link, SystemShape
from pdserve.planner.simulator import simulate
from pdserve.planner.workload import Workload
from router.slo import SLO

DEFAULT_ATTAINMENT = 0.9


@dataclass(frozen=True)
class SearchSpace:
    max_workers: int = 8
    cpus_per_worker: tuple[float, ...] = (0.5, 1.0, 2.0)
    pd_policies: tuple[str, ...] = ("auto", "remote")
    colocated: bool = True
    disaggregated: bool = True
    transport: str = "ray"
    lend_cores: bool = True  # CPUs; GPUs lend nothing
    max_num_batched_tokens: int = 2048
    link: Optional[Link] = None  # between the pools' nodes (`--link`); None: one host

    def shapes(self, max_cpus: Optional[float] = None) -> list[SystemShape]:
        """Every shape of the space (within `max_cpus`), cheapest first."""
        shapes = []
        for cpus in self.cpus_per_worker:
            if self.colocated:
                shapes += [
                    SystemShape("colocated", 0, n, cpus, **self._settings)
                    for n in range(1, self.max_workers + 1)
                ]
            if self.disaggregated:
                shapes += [
                    SystemShape("disaggregated", p, d, cpus, policy, **self._settings)
                    for p in range(1, self.max_workers)
                    for d in range(1, self.max_workers - p + 1)
                    for policy in self.pd_policies
                ]
        if max_cpus is not None:
            shapes = [s for s in shapes if s.total_cpus <= max_cpus + 1e-9]
        return sorted(shapes, key=lambda s: (s.total_cpus, s.num_workers, str(s)))

    @property
    def _settings(self) -> dict:
        return dict(
            transport=self.transport,
            lend_cores=self.lend_cores,
            max_num_batched_tokens=self.max_num_batched_tokens,
            link=self.link,
        )


@dataclass(frozen=True)
class Plan:
    shape: Optional[SystemShape]  # None: nothing in the space meets the target
    rate_rps: float
    report: Optional[Report]
    tried: list = field(default_factory=list)  # one dict per shape simulated

    def to_json(self) -> dict:
        return {
            "shape": None if self.shape is None else str(self.shape),
            # what `pdserve serve --autoscale plan` reads (router/pools/autoscaler.py's PlanTarget)
            **(
                {}
                if self.shape is None
                else {
                    "mode": self.shape.mode,
                    "num_prefill": self.shape.num_prefill,
                    "num_decode": self.shape.num_decode,
                    "cpus_per_worker": self.shape.cpus_per_worker,
                }
            ),
            "serve_flags": None if self.shape is None else self.shape.serve_flags(),
            "cpus": None if self.shape is None else self.shape.total_cpus,
            "rate_rps": self.rate_rps,
            "predicted": None if self.report is None else self.report.to_json(),
            "tried": self.tried,
        }


def cheapest(
    profile: Profile,
    workload: Workload,
    slo: SLO,
    rate_rps: float,
    space: SearchSpace = SearchSpace(),
    attainment: float = DEFAULT_ATTAINMENT,
    node_cores: Optional[int] = None,
    log: Callable[[str], None] = lambda line: None,
) -> Plan:
    requests = workload.requests(rate_rps)
    tried, winners, winning_cost = [], [], None
    for shape in space.shapes():
        if winning_cost is not None and shape.total_cpus > winning_cost + 1e-9:
            break
        report = _tried(profile, shape, slo, requests, node_cores, tried, log)
        if report.slo_attainment >= attainment:
            winners.append((shape, report))
            winning_cost = shape.total_cpus
    if not winners:
        return Plan(None, rate_rps, None, tried)
    shape, report = max(winners, key=lambda w: (w[1].slo_attainment, -w[0].num_workers))
    return Plan(shape, rate_rps, report, tried)


def best_of(
    profile: Profile,
    workload: Workload,
    slo: SLO,
    rate_rps: float,
    shapes: list[SystemShape],
    node_cores: Optional[int] = None,
    log: Callable[[str], None] = lambda line: None,
) -> Plan:
    """Of `shapes` that take the same machine (say all of one node), the one with the highest
    goodput at `rate_rps`; ties: the higher attainment, then the fewer CPUs. Simulated on the same
    requests."""
    requests = workload.requests(rate_rps)
    tried, best = [], None
    for shape in shapes:
        report = _tried(profile, shape, slo, requests, node_cores, tried, log)
        key = (round(report.goodput_rps, 6), report.slo_attainment, -shape.total_cpus)
        if best is None or key > best[0]:
            best = (key, shape, report)
    return Plan(best[1], rate_rps, best[2], tried)


def _tried(profile, shape, slo, requests, node_cores, tried: list, log) -> Report:
    """`shape` simulated on `requests`, noted in `tried` and logged."""
    report = simulate(profile, shape, slo, requests, node_cores)
    tried.append(
        dict(
            shape=str(shape),
            cpus=shape.total_cpus,
            slo_attainment=report.slo_attainment,
            goodput_rps=report.goodput_rps,
        )
    )
    log(f"{shape}: {report.slo_attainment:.0%} within SLO, goodput {report.goodput_rps:.2f} req/s")
    return report


def highest_rate(
    profile: Profile,
    workload: Workload,
    slo: SLO,
    cluster_cpus: float,
    space: SearchSpace = SearchSpace(),
    attainment: float = DEFAULT_ATTAINMENT,
    node_cores: Optional[int] = None,
    steps: int = 7,
    log: Callable[[str], None] = lambda line: None,
) -> Plan:
    """For each shape within `cluster_cpus` that uses more than half of it: the highest rate
    (bisected, `steps` times after doubling from 0.25 req/s) at which it meets the target; the best
    of them."""
    best: Optional[tuple[float, SystemShape, Report]] = None
    tried = []
    for shape in space.shapes(cluster_cpus):
        if shape.total_cpus <= cluster_cpus / 2:
            continue

        def meets(rate: float) -> Optional[Report]:
            report = simulate(profile, shape, slo, workload.requests(rate), node_cores)
            return report if report.slo_attainment >= attainment else None

        low, low_report, high = 0.0, None, 0.25
        while (report := meets(high)) is not None and high < 1e4:
            low, low_report, high = high, report, high * 2
        for _ in range(steps):
            middle = (low + high) / 2
            if (report := meets(middle)) is not None:
                low, low_report = middle, report
            else:
                high = middle
        tried.append(
            dict(
                shape=str(shape),
                cpus=shape.total_cpus,
                max_rate_rps=low,
                goodput_rps=low_report.goodput_rps if low_report else 0.0,
            )
        )
        log(f"{shape}: holds {low:.2f} req/s")
        if low_report is not None and (best is None or low > best[0] + 1e-9):
            best = (low, shape, low_report)
    if best is None:
        return Plan(None, 0.0, None, tried)
    return Plan(best[1], best[0], best[2], tried)
