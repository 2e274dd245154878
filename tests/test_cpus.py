"""The one CPU count (runtime/cpus.py) against fake cgroup trees: the affinity mask lowered to the
CPU quota, v2 and v1, the quota of an ancestor cgroup, none set."""

import pytest

from runtime import cpus
from runtime.cpus import cgroup_cpu_quota, usable_cpus


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A 64-core host: the affinity mask is set per test, cgroup files are written under `root`."""
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: set(range(64)))
    root = tmp_path / "cgroup"
    root.mkdir()

    class Host:
        self_cgroup = tmp_path / "self_cgroup"

        @staticmethod
        def affinity(count):
            monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: set(range(count)))

        @staticmethod
        def write(relative, text, self_cgroup="0::/\n"):
            path = root / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            Host.self_cgroup.write_text(self_cgroup)

        @staticmethod
        def cpus():
            return usable_cpus(root, Host.self_cgroup)

        @staticmethod
        def quota():
            return cgroup_cpu_quota(root, Host.self_cgroup)

    return Host


def test_a_container_limited_to_2_cpus_on_a_64_core_host_counts_2(host):
    host.write("cpu.max", "200000 100000\n")
    assert host.cpus() == 2


def test_no_quota_leaves_the_affinity_mask(host):
    host.write("cpu.max", "max 100000\n")
    assert host.quota() is None and host.cpus() == 64
    host.affinity(3)
    assert host.cpus() == 3


def test_an_affinity_mask_smaller_than_the_quota_wins(host):
    host.write("cpu.max", "800000 100000\n")
    host.affinity(2)
    assert host.cpus() == 2


def test_a_fractional_quota_rounds_down_and_the_count_is_at_least_1(host):
    host.write("cpu.max", "150000 100000\n")
    assert host.quota() == 1.5 and host.cpus() == 1
    host.write("cpu.max", "20000 100000\n")
    assert host.cpus() == 1


def test_cgroup_v1_quota_and_its_no_limit(host):
    v1 = "1:cpu,cpuacct:/\n0::/\n"
    host.write("cpu,cpuacct/cpu.cfs_period_us", "100000\n", v1)
    host.write("cpu,cpuacct/cpu.cfs_quota_us", "-1\n", v1)
    assert host.quota() is None and host.cpus() == 64
    host.write("cpu,cpuacct/cpu.cfs_quota_us", "400000\n", v1)
    assert host.cpus() == 4


def test_cgroup_v1_with_the_cpu_controller_mounted_alone(host):
    v1 = "3:cpu:/\n"
    host.write("cpu/cpu.cfs_period_us", "50000\n", v1)
    host.write("cpu/cpu.cfs_quota_us", "150000\n", v1)
    assert host.cpus() == 3


def test_the_smallest_quota_on_the_way_to_the_root_counts(host):
    nested = "0::/pods/worker\n"
    host.write("pods/cpu.max", "300000 100000\n", nested)
    host.write("pods/worker/cpu.max", "max 100000\n", nested)
    assert host.cpus() == 3
    host.write("pods/worker/cpu.max", "200000 100000\n", nested)
    assert host.cpus() == 2


def test_a_process_path_absent_under_the_mount_falls_back_to_the_mount_root(host):
    """A container without its own cgroup namespace: /proc names the host's path, the mount is its
    cgroup."""
    host.write("cpu.max", "200000 100000\n", "0::/docker/abc123\n")
    assert host.cpus() == 2


def test_no_cgroup_files_at_all_leave_the_affinity_mask(host, tmp_path):
    host.affinity(5)
    assert usable_cpus(tmp_path / "absent", tmp_path / "absent_self") == 5


def test_garbage_in_a_cgroup_file_is_no_quota(host):
    host.write("cpu.max", "lots\n")
    assert host.quota() is None and host.cpus() == 64


def test_this_machine_counts_at_least_1_and_at_most_its_affinity():
    import os

    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))


class _FakeRay:
    """Stands in for `ray` where a test needs only what a worker or `init_ray` asks of it."""

    def __init__(self, assigned_cpus=None):
        self.assigned_cpus = assigned_cpus
        self.init_calls = []

    def get_runtime_context(self):
        assigned = self.assigned_cpus

        class Context:
            @staticmethod
            def get_assigned_resources():
                return {"CPU": assigned}

        return Context()

    def is_initialized(self):
        return False

    def init(self, **options):
        self.init_calls.append(options)


def test_a_local_node_declares_the_usable_cpus_and_sizes_shares_from_them(monkeypatch):
    import sys

    from pdserve import system

    monkeypatch.setattr(system, "usable_cpus", lambda: 2)  # a 2-CPU container on a many-core host
    config = system.ServeConfig()
    assert config.worker_cpus == 0.5
    fake = _FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setenv("RAY_preallocate_plasma_memory", "1")
    system.init_ray(config)
    assert [call["num_cpus"] for call in fake.init_calls] == [2]


def test_a_worker_never_gets_more_threads_than_the_usable_cpus(monkeypatch):
    import sys

    from runtime import startup

    monkeypatch.setattr(startup, "usable_cpus", lambda: 2)
    # a node that declared 64 CPUs
    monkeypatch.setitem(sys.modules, "ray", _FakeRay(assigned_cpus=16))
    assert startup.granted_cpus() == 2
    monkeypatch.setitem(sys.modules, "ray", _FakeRay(assigned_cpus=0.5))
    assert startup.granted_cpus() == 1


def test_home_threads_beyond_the_nodes_cores_are_clamped(tmp_path):
    from runtime.cores import CorePolicy, CoreShare

    asked = []
    share = CoreShare(
        CorePolicy("all", str(tmp_path)), home_threads=16, set_threads=asked.append, num_cores=2
    )
    try:
        assert share.home_threads == share.threads == 2 and len(share.home) == 2
        with share.step(is_prefill=True):  # nothing to borrow: the home is the whole node
            assert share.threads == 2
    finally:
        share.close()
