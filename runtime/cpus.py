"""The one count of CPUs this process may compute on. Every CPU-sized choice takes it from here: the
CPUs a local Ray node declares, the default CPU share of its workers, a worker's torch threads and
the cores workers lend each other (runtime/cores.py).

`os.cpu_count()` is the host's count: in a container limited to 2 CPUs on a 64-core host it says 64,
and torch threads sized to it spin 16 to a core (two torch processes each spinning two threads on
two cores slow decode 10-20x: docs/benchmarks-archive.md, 2026-12-02, SLO-aware core sharing).
Torch-free: the router's process reads it too.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Iterator, Optional

CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")


def usable_cpus(cgroup_root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> int:
    """The CPUs this process may use: those of its affinity mask (cpuset, `taskset`), lowered to its
    CPU quota where one is set (the smallest of its cgroup's and its ancestors', cgroup v2 `cpu.max`
    or v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`), rounded down, and at least 1. Rounded down
    because a thread beyond the quota does not add compute, it makes every thread wait for the next
    period."""
    cpus = _affinity_cpus()
    quota_cpus = cgroup_cpu_quota(cgroup_root, self_cgroup)
    if quota_cpus is not None:
        cpus = min(cpus, math.floor(quota_cpus))
    return max(1, cpus)


def _affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cgroup_cpu_quota(
    cgroup_root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP
) -> Optional[float]:
    """The CPU quota of this process's cgroup, in CPUs: the smallest set on its cgroup or an
    ancestor; None when none is set (v2 "max", v1 -1) or no cgroup file is readable."""
    quotas = [
        quota
        for path in _quota_files(cgroup_root, self_cgroup)
        if (quota := _read_quota(path)) is not None
    ]
    return min(quotas, default=None)


def _quota_files(cgroup_root: Path, self_cgroup: Path) -> Iterator[Path]:
    """Each quota file on the way from this process's cgroup up to the mount's root. In a container
    with its own cgroup namespace the process's cgroup is the mount's root; without one, the
    process's path may not exist under the mount (the container's cgroup is mounted as the root),
    and the root serves."""
    for mount, path in _own_cgroups(cgroup_root, self_cgroup):
        directory = mount / path.lstrip("/")
        while True:
            yield directory / ("cpu.max" if mount == cgroup_root else "cpu.cfs_quota_us")
            if directory == mount:
                break
            directory = directory.parent


def _own_cgroups(cgroup_root: Path, self_cgroup: Path) -> list[tuple[Path, str]]:
    """(mount, path of this process's cgroup under it) for the v2 hierarchy and the v1 `cpu`
    controller."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    found = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":
            found.append((cgroup_root, path))
        elif "cpu" in controllers.split(","):
            mount = cgroup_root / controllers
            found.append((mount if mount.is_dir() else cgroup_root / "cpu", path))
    if not found:  # no /proc: the mounts' roots
        found = [(cgroup_root, "/"), (cgroup_root / "cpu", "/")]
    return found


def _read_quota(path: Path) -> Optional[float]:
    """One cgroup's quota in CPUs, from v2 `cpu.max` ("max 100000" or "200000 100000") or v1
    `cpu.cfs_quota_us` (-1: none) beside `cpu.cfs_period_us`."""
    try:
        if path.name == "cpu.max":
            quota, period = path.read_text().split()
            if quota == "max":
                return None
        else:
            quota, period = path.read_text(), (path.parent / "cpu.cfs_period_us").read_text()
        quota_us, period_us = int(quota), int(period)
    except (OSError, ValueError):  # absent, or not a quota
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None
