"""Two hosts on one machine (root only): hosts A and B are network namespaces of our own joined by
a veth pair whose link `tc` shapes, and a Ray cluster spans them: a head on A's address with the
prefill pool's resource, a node on B's with the decode pool's (cluster.yaml's node types). The root
namespace is the clients' machine: an unshaped control link reaches A (where `pdserve serve` runs
and serves), and B through A.

    with TwoHosts.create(rate="1gbit") as hosts:
        hosts.start_ray()                             # ray start --block on A, then on B
        server = hosts.serve("--transport=grpc")      # pdserve serve on A, healthy
        with server.client() as client: ...
        hosts.link.shape(rate="100mbit")              # at once, also mid-stream
        hosts.link.partition(); hosts.link.heal()

What it promises
    - Names: every namespace, link and directory is `pd2h...` with a random token, the namespaces
      also with the owner's pid (`pd2h-<token>-<pid>-a`); the /24 is 10.77.<n>.0/24 with an <n> no
      address of this machine uses (A-B link on .0/25, control link on .128/25).
    - Traffic goes only to the addresses made here. Every Ray process lives in A or B: Ray 2.60
      binds its servers to all interfaces unless its node address is 127.0.0.1, so a node in the
      root namespace would listen on the machine's own interfaces. Their namespaces being ours
      alone, Ray's and pdserve's default ports are free there.
    - Each process is a child in a session of its own, stopped by its process group (SIGTERM, then
      SIGKILL), never `ray stop`; what is left in the namespaces is killed by pid before they go.
    - Tear-down always runs (`close`, the context manager, atexit) and every wait is bounded. A run
      that crashed leaves its owner pid dead: `sweep()` (run at each `create`) removes what such
      runs left (processes, namespaces, links, directories), and nothing of a live run.
    - Delay, jitter and loss need sch_netem: kernels without it (this repo's CI VMs) can shape the
      rate and partition only (`Link.netem_available`).
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

PREFIX = "pd2h"
_NAMESPACE = re.compile(rf"^{PREFIX}-([0-9a-f]{{6}})-(\d+)-[ab]$")
_LINK = re.compile(rf"^{PREFIX}([0-9a-f]{{6}})[a-d]$")
_RUN_DIR_ROOT = Path("/tmp")
_SUBNET_FIRST_OCTETS = "10.77"
_COMMAND_TIMEOUT_S = 10.0
_RAY_START_TIMEOUT_S = 60.0
_STOP_TIMEOUT_S = 8.0
# the nodes go after everything on them stopped: no state of theirs is worth waiting for
_RAY_STOP_TIMEOUT_S = 3.0
_SERVE_START_TIMEOUT_S = 240.0
# Ray's own default ports and pdserve's are free on the hosts: their namespaces are this run's alone
_RAY_PORT = 6379
_SERVE_PORT = 50051
# The head's GCS marks a node dead after `failure_threshold` health checks in a row failed (each
# `timeout_ms`, one every `period_ms`): Ray 2.60's defaults are 3000 / 10000 / 5 (~40 s seen on a
# partition); these make it ~5 s, so a test can outlast it
FAST_NODE_TIMEOUT_ENV = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1500",
    "RAY_health_check_failure_threshold": "3",
}


class TwoHostsError(RuntimeError):
    """The two hosts could not be made (not root, no `ip`/`tc`, a command failed)."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise TwoHostsError(f"{' '.join(argv)}: {error}") from None
    if check and done.returncode != 0:
        raise TwoHostsError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class Shape:
    """One direction of the link: `tbf` at `rate`, under a `netem` (delay, jitter, loss) when any
    of those is set. Kernels without sch_netem (this repo's CI VMs: 6.18 "fc" builds have tbf and
    htb but no netem, no classifiers, no iptables) can shape the rate and partition only."""

    rate: str = "1gbit"
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0

    @property
    def needs_netem(self) -> bool:
        return self.delay_ms > 0 or self.jitter_ms > 0 or self.loss_pct > 0

    def netem_args(self) -> list[str]:
        args = ["limit", "100000"]
        if self.delay_ms > 0 or self.jitter_ms > 0:
            args += ["delay", f"{self.delay_ms}ms"]
            if self.jitter_ms > 0:
                args += [f"{self.jitter_ms}ms", "distribution", "normal"]
        if self.loss_pct > 0:
            args += ["loss", f"{self.loss_pct}%"]
        return args


_TBF = ["burst", "256kb", "latency", "50ms"]
# a token bucket of 1 byte: every packet is larger, and tbf drops it silently (a partition that
# raises no error at either end, as a real one: TCP retransmits, a connect times out)
_PARTITION = ["tbf", "rate", "8bit", "burst", "1", "limit", "1"]


class Link:
    """The veth pair between host A (namespace `namespaces["a"]`, device `devices["a"]`) and host B;
    both directions are shaped alike."""

    def __init__(self, namespaces: dict[str, str], devices: dict[str, str]):
        self.namespaces = namespaces
        self.devices = devices
        self.current = Shape()
        self.partitioned = False

    def _tc(self, side: str, *args: str) -> None:
        """`tc qdisc <verb> dev <this side's device> <rest>`, inside that side's namespace."""
        inside = ("ip", "netns", "exec", self.namespaces[side])
        _run(*inside, "tc", "qdisc", args[0], "dev", self.devices[side], *args[1:])

    def netem_available(self) -> bool:
        try:
            self._tc("a", "replace", "root", "netem", "limit", "1000")
        except TwoHostsError:
            return False
        finally:
            if self.partitioned:
                self.partition()
            else:
                self._apply(self.current)
        return True

    def shape(
        self,
        rate: str = "1gbit",
        delay_ms: float = 0.0,
        jitter_ms: float = 0.0,
        loss_pct: float = 0.0,
    ) -> Shape:
        """Both directions: at most `rate` (tc's units: 1gbit, 100mbit), `delay_ms` (± `jitter_ms`,
        normal) one way, `loss_pct` of packets dropped. Takes effect at once, also while traffic
        flows; a partition stays until `heal`. Delay and loss need sch_netem (`netem_available`):
        without it, `TwoHostsError` and the link keeps its shape."""
        shape = Shape(rate, delay_ms, jitter_ms, loss_pct)
        if not self.partitioned:
            self._apply(shape)
        self.current = shape
        return shape

    def _apply(self, shape: Shape) -> None:
        tbf = ("tbf", "rate", shape.rate, *_TBF)
        for side in ("a", "b"):
            if shape.needs_netem:
                self._tc(side, "replace", "root", "handle", "1:", "netem", *shape.netem_args())
                self._tc(side, "replace", "parent", "1:1", "handle", "10:", *tbf)
            else:
                self._tc(side, "replace", "root", *tbf)

    def partition(self) -> None:
        """Every packet dropped both ways, the link left up."""
        self.partitioned = True
        for side in ("a", "b"):
            self._tc(side, "replace", "root", *_PARTITION)

    def heal(self) -> None:
        self.partitioned = False
        self._apply(self.current)

    def qdiscs(self) -> str:
        """What `tc` says is on both ends (for a log)."""
        lines = []
        for side in ("a", "b"):
            inside = ("ip", "netns", "exec", self.namespaces[side])
            shown = _run(*inside, "tc", "qdisc", "show", "dev", self.devices[side]).stdout
            lines.append(f"{side.upper()}: {shown.strip()}")
        return "\n".join(lines)


@dataclass(frozen=True)
class RayCluster:
    address: str  # the head's GCS, A:port
    head_ip: str
    node_ip: str


class TwoHosts:
    """Hosts A and B, each a network namespace of ours (`namespaces`), and the root namespace as
    the clients' machine: it reaches A over an unshaped control link (A's `control` address, where
    the router serves) and B through A. Every Ray process lives in A or B: Ray binds its servers to
    all of a node's interfaces unless its address is 127.0.0.1, so in the root namespace they would
    listen on the machine's own interfaces too."""

    def __init__(self, token: str, subnet: int):
        self.token = token
        self.namespaces = {side: f"{PREFIX}-{token}-{os.getpid()}-{side}" for side in "ab"}
        # a-b: the shaped link; c (root) - d (in A): the control link
        self.devices = {side: f"{PREFIX}{token}{side}" for side in "abcd"}
        net = f"{_SUBNET_FIRST_OCTETS}.{subnet}"
        self.subnet = ipaddress.ip_network(f"{net}.0/24")
        self.a, self.b = f"{net}.1", f"{net}.2"  # the link's ends: Ray's node addresses
        self.root, self.control = f"{net}.129", f"{net}.130"  # the control link's ends
        self.run_dir = _RUN_DIR_ROOT / f"{PREFIX}-{token}"
        self.link = Link(self.namespaces, {"a": self.devices["a"], "b": self.devices["b"]})
        self.processes: list[Child] = []
        self.cluster: Optional[RayCluster] = None
        self.ray_env: dict[str, str] = {}  # more environment for every process on the hosts
        self._closed = False

    # -- making the hosts ------------------------------------------------------------------------

    @classmethod
    def create(cls, rate: str = "1gbit") -> "TwoHosts":
        """The namespaces, both links, the addresses and routes, the link at `rate`. Raises
        `TwoHostsError` (nothing left behind) when any step fails."""
        if os.geteuid() != 0:
            raise TwoHostsError("network namespaces need root")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise TwoHostsError(f"`{tool}` is not installed (iproute2)")
        sweep()
        hosts = cls(secrets.token_hex(3), _free_subnet())
        atexit.register(hosts.close)
        try:
            hosts._make(rate)
        except BaseException:
            hosts.close()
            raise
        return hosts

    def inside(self, side: str) -> tuple[str, ...]:
        """The prefix that runs a command on host `side` ("a" or "b")."""
        return ("ip", "netns", "exec", self.namespaces[side])

    def _make(self, rate: str) -> None:
        self.run_dir.mkdir(mode=0o700)
        self._write_state()
        ns_a, ns_b = self.namespaces["a"], self.namespaces["b"]
        dev = self.devices
        for namespace in (ns_a, ns_b):
            _run("ip", "netns", "add", namespace)
            _run("ip", "-n", namespace, "link", "set", "lo", "up")
        veth = ("type", "veth", "peer", "name")
        _run("ip", "-n", ns_a, "link", "add", dev["a"], *veth, dev["b"], "netns", ns_b)
        _run("ip", "link", "add", dev["c"], *veth, dev["d"], "netns", ns_a)
        for namespace, device, address in (
            (ns_a, dev["a"], f"{self.a}/25"),
            (ns_b, dev["b"], f"{self.b}/25"),
            (ns_a, dev["d"], f"{self.control}/25"),
            (None, dev["c"], f"{self.root}/25"),
        ):
            where = () if namespace is None else ("-n", namespace)
            _run("ip", *where, "addr", "add", address, "dev", device)
            _run("ip", *where, "link", "set", device, "up")
        # the root namespace reaches B through A; B answers through A
        _run("ip", "route", "add", f"{self.subnet.network_address}/25", "via", self.control)
        _run("ip", "-n", ns_b, "route", "add", "default", "via", self.a)
        _run(*self.inside("a"), "sysctl", "-qw", "net.ipv4.ip_forward=1")
        self.link.shape(rate)
        # another run that picked the same /24 at the same moment would share its routes: refuse
        others = [d for d, ip in _addresses() if ip in self.subnet and d != dev["c"]]
        if others:
            raise TwoHostsError(f"{self.subnet} is also on {others}: another run took it meanwhile")
        self._wait_reachable()

    def reachable(self, timeout_s: float = 1.0) -> bool:
        """Whether B answers the root namespace (through A and the link): a TCP connect to a port
        nobody listens on in B is refused at once when packets pass, and times out otherwise."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.settimeout(timeout_s)
            try:
                probe.connect((self.b, 9))
            except ConnectionRefusedError:
                return True
            except OSError:
                return False
        return True

    def _wait_reachable(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.reachable():
            if time.monotonic() > deadline:
                raise TwoHostsError(f"{self.b} does not answer within {timeout_s:.0f} s")
            time.sleep(0.1)

    def _write_state(self) -> None:
        state = {
            "owner_pid": os.getpid(),
            "namespaces": list(self.namespaces.values()),
            "pgids": [child.process.pid for child in self.processes],
        }
        (self.run_dir / "state.json").write_text(json.dumps(state))

    # -- processes -------------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """For Ray processes on the hosts: no token auth (nothing to hand over), the node addresses
        we give bound (the test run's "0" pins Ray to loopback), no inherited cluster address."""
        env = {
            **os.environ,
            "RAY_AUTH_MODE": "disabled",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
            **self.ray_env,
        }
        env.pop("RAY_ADDRESS", None)
        return env

    def spawn(self, side: str, name: str, argv: list[str]) -> "Child":
        """`argv` on host `side`, in a process group of its own (stopped by it), output to a log in
        the run's directory."""
        log_path = self.run_dir / f"{name}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                [*self.inside(side), *argv],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env(),
                start_new_session=True,
            )
        child = Child(name, process, log_path)
        self.processes.append(child)
        self._write_state()
        return child

    def start_ray(
        self,
        head_cpus: int = 2,
        node_cpus: int = 1,
        head_resources: Optional[dict] = None,
        node_resources: Optional[dict] = None,
        object_store_bytes: int = 256 << 20,
        supervise_node: bool = False,
        fast_node_timeout: bool = False,
    ) -> RayCluster:
        """`ray start --head --block` on A, then `ray start --block --address` on B; returns once
        both nodes are alive in the head's view. Resources default to cluster.yaml's node types:
        the prefill pool's on A, the decode pool's on B. `supervise_node`: B's node runs under
        `pdserve node` (pdserve/node_supervisor.py), which starts it again whenever it goes;
        `fast_node_timeout`: the head marks a silent node dead after ~5 s, not ~40."""
        if fast_node_timeout:
            self.ray_env.update(FAST_NODE_TIMEOUT_ENV)
        head_resources = {"pdserve_prefill": 1} if head_resources is None else head_resources
        node_resources = {"pdserve_decode": 1} if node_resources is None else node_resources
        ray = str(Path(sys.executable).with_name("ray"))
        port = _RAY_PORT
        common = [
            "--block",
            "--disable-usage-stats",
            f"--object-store-memory={object_store_bytes}",
            f"--temp-dir={self.run_dir / 'ray'}",
        ]
        self.spawn(
            "a",
            "ray-head",
            [
                ray,
                "start",
                "--head",
                f"--node-ip-address={self.a}",
                f"--port={port}",
                "--include-dashboard=false",
                f"--num-cpus={head_cpus}",
                f"--resources={json.dumps(head_resources)}",
                *common,
            ],
        )
        address = f"{self.a}:{port}"
        self._wait_nodes(address, 1)
        node_args = [
            f"--node-ip-address={self.b}",
            f"--num-cpus={node_cpus}",
            f"--resources={json.dumps(node_resources)}",
            *common,
        ]
        if supervise_node:
            node_args.remove("--block")  # the supervisor's own
            pdserve = str(Path(sys.executable).with_name("pdserve"))
            argv = [pdserve, "node", f"--address={address}", "--max-backoff-s=4", "--", *node_args]
        else:
            argv = [ray, "start", f"--address={address}", *node_args]
        self.spawn("b", "ray-node", argv)
        self._wait_nodes(address, 2)
        self.cluster = RayCluster(address, self.a, self.b)
        return self.cluster

    def _wait_nodes(self, address: str, count: int) -> None:
        """Until the head lists `count` alive nodes; a Ray process that exits fails at once."""
        from ray._raylet import GcsClient

        deadline = time.monotonic() + _RAY_START_TIMEOUT_S
        alive, error = 0, None
        while True:
            for child in self.processes:
                child.check_running()
            try:
                nodes = GcsClient(address=address).get_all_node_info(timeout=5)
                alive = sum(1 for info in nodes.values() if info.state == 0)  # ALIVE
            except Exception as failure:  # not up yet: Ray raises several kinds
                error = failure
            if alive >= count:
                return
            if time.monotonic() > deadline:
                logs = "\n".join(c.tail() for c in self.processes)
                raise TwoHostsError(
                    f"{count} Ray node(s) not alive at {address} within "
                    f"{_RAY_START_TIMEOUT_S:.0f} s (alive: {alive}, last error: {error}):\n{logs}"
                )
            time.sleep(0.5)

    def serve(self, *args: str, timeout_s: float = _SERVE_START_TIMEOUT_S) -> "Server":
        """`pdserve serve --address <the head>` on host A (the router and the driver there, beside
        the prefill node), serving on A's control address; `args` are more of its flags. Returns
        once it is healthy."""
        from pdserve.client import PdserveClient

        if self.cluster is None:
            raise TwoHostsError("start_ray() first")
        pdserve = str(Path(sys.executable).with_name("pdserve"))
        port = _SERVE_PORT
        child = self.spawn(
            "a",
            f"pdserve-{len(self.processes)}",
            [
                pdserve,
                "serve",
                f"--address={self.cluster.address}",
                f"--host={self.control}",
                f"--port={port}",
                "--insecure",
                *args,
            ],
        )
        server = Server(self, child, self.control, port)
        deadline = time.monotonic() + timeout_s
        with PdserveClient(self.control, port) as client:
            while not client.is_serving():
                try:
                    child.check_running()
                    if time.monotonic() > deadline:
                        raise TwoHostsError(
                            f"not serving within {timeout_s:.0f} s:\n{child.tail()}"
                        )
                except TwoHostsError:
                    self.stop(child)
                    raise
                time.sleep(0.5)
        return server

    def kill_node(self, side: str, spare: tuple[int, ...] = ()) -> list[int]:
        """SIGKILL to every process on host `side` but the pids in `spare` (a node's death: its
        raylet, its workers, everything); returns the pids killed."""
        killed = []
        for pid in _run("ip", "netns", "pids", self.namespaces[side]).stdout.split():
            if int(pid) in spare:
                continue
            try:
                os.kill(int(pid), signal.SIGKILL)
                killed.append(int(pid))
            except ProcessLookupError:
                pass
        return killed

    def alive_nodes(self, timeout_s: float = 5.0) -> dict[str, str]:
        """Ray node id (hex) -> address, of the nodes the head lists as alive."""
        from ray._raylet import GcsClient

        nodes = GcsClient(address=self.cluster.address).get_all_node_info(timeout=timeout_s)
        return {
            node_id.hex(): info.node_manager_address
            for node_id, info in nodes.items()
            if info.state == 0  # ALIVE
        }

    # -- tear-down ------------------------------------------------------------------------------

    def stop(self, child: "Child", timeout_s: float = _STOP_TIMEOUT_S) -> None:
        """SIGTERM to the child's process group, SIGKILL to what is left after `timeout_s`."""
        _stop_groups([child.process.pid], timeout_s)
        try:
            child.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        if child in self.processes:
            self.processes.remove(child)
            self._write_state()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            # servers first (their actors' owner), then the nodes
            for child in [c for c in self.processes if not c.name.startswith("ray-")]:
                self.stop(child)
            _stop_groups([c.process.pid for c in self.processes], _RAY_STOP_TIMEOUT_S)
            for child in self.processes:
                try:
                    child.process.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    pass
            self.processes.clear()
            _kill_naming(str(self.run_dir))
        finally:
            _remove(list(self.namespaces.values()), self.devices["c"], self.run_dir)
            atexit.unregister(self.close)

    def __enter__(self) -> "TwoHosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class Server:
    """A `pdserve serve` on host A."""

    hosts: TwoHosts
    child: "Child"
    host: str
    port: int

    def client(self, timeout_s: float = 120.0):
        from pdserve.client import PdserveClient

        return PdserveClient(self.host, self.port, timeout_s=timeout_s)

    def stop(self) -> None:
        self.hosts.stop(self.child)

    def stats(self):
        with self.client() as client:
            return client.stats()

    def wait_idle(self, timeout_s: float = 30.0):
        """Stats once nothing is in flight and every worker's blocks are free (or the last seen)."""
        from tests.serving_harness import settled_stats

        return settled_stats(self.stats, timeout_s)


def assert_no_block_held(stats) -> None:
    """Nothing in flight, every worker answering, and none holding a KV block."""
    held = {w.worker_id: w.kv_blocks_total - w.kv_blocks_free for w in stats.workers}
    assert stats.requests_in_flight == 0 and all(w.kv_blocks_total > 0 for w in stats.workers), (
        stats
    )
    assert not any(held.values()), held


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    log_path: Path

    def tail(self, chars: int = 3000) -> str:
        try:
            return f"--- {self.name}:\n{self.log_path.read_text(errors='replace')[-chars:]}"
        except OSError:
            return f"--- {self.name}: no log"

    def check_running(self) -> None:
        if self.process.poll() is not None:
            raise TwoHostsError(f"{self.name} exited ({self.process.returncode}):\n{self.tail()}")


def _stop_groups(pgids: list[int], timeout_s: float) -> None:
    """SIGTERM to process groups of ours (`ray start --block` stops its node on it, `pdserve
    serve` its system), SIGKILL to what is left after `timeout_s`."""
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    left = list(pgids)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [pgid for pgid in left if _group_alive(pgid)]
    for pgid in left:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _kill_naming(run_dir: str) -> None:
    """SIGKILL to every process whose command line names `run_dir` (this run's own directory, so
    only Ray processes this run started: raylet workers may leave their node's process group)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if run_dir.encode() in cmdline:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _remove(namespaces: list[str], root_device: Optional[str], run_dir: Optional[Path]) -> None:
    """The namespaces (every process still inside them is ours: killed first; the veth pairs go
    with them), the control link's root end, the directory; each step whatever the others did."""
    present = _namespaces()
    for namespace in namespaces:
        if namespace not in present:
            continue
        for pid in _run("ip", "netns", "pids", namespace, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _run("ip", "netns", "del", namespace, check=False)
    if root_device is not None and root_device in _links():
        _run("ip", "link", "del", root_device, check=False)
    if run_dir is not None:
        shutil.rmtree(run_dir, ignore_errors=True)


def _namespaces() -> list[str]:
    done = _run("ip", "netns", "list", check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _links() -> list[str]:
    done = _run("ip", "-o", "link", "show", check=False)
    return [line.split(":")[1].strip().split("@")[0] for line in done.stdout.splitlines()]


def _addresses() -> list[tuple[str, ipaddress.IPv4Address]]:
    done = _run("ip", "-o", "-4", "addr", "show", check=False)
    found = []
    for line in done.stdout.splitlines():
        fields = line.split()
        found.append((fields[1], ipaddress.ip_interface(fields[3]).ip))
    return found


def _free_subnet() -> int:
    used = {
        int(str(ip).split(".")[2])
        for _, ip in _addresses()
        if str(ip).startswith(_SUBNET_FIRST_OCTETS + ".")
    }
    free = [n for n in range(1, 255) if n not in used]
    if not free:
        raise TwoHostsError(f"every {_SUBNET_FIRST_OCTETS}.<n>.0/24 is in use")
    return free[secrets.randbelow(len(free))]


def sweep() -> list[str]:
    """Removes what earlier runs whose owner process is gone left behind: their processes (by the
    process groups their state recorded, any process inside their namespaces or naming their
    directory), namespaces, root-side links and directories. A live run's things are left alone.
    Returns what it removed."""
    removed = []
    live_tokens = set()
    for run_dir in _RUN_DIR_ROOT.glob(f"{PREFIX}-*"):
        token = run_dir.name.split("-", 1)[1]
        try:
            state = json.loads((run_dir / "state.json").read_text())
        except (OSError, ValueError):
            state = None
        if state is not None and _pid_alive(state["owner_pid"]):
            live_tokens.add(token)
            continue
        if state is None and time.time() - run_dir.stat().st_mtime < 60:
            live_tokens.add(token)  # being made right now
            continue
        _stop_groups((state or {}).get("pgids", []), timeout_s=2.0)
        _kill_naming(str(run_dir))
        _remove((state or {}).get("namespaces", []), None, run_dir)
        removed.append(str(run_dir))
    for namespace in _namespaces():
        match = _NAMESPACE.match(namespace)
        if match is None:
            continue
        if _pid_alive(int(match.group(2))):
            live_tokens.add(match.group(1))
        else:
            _remove([namespace], None, None)
            removed.append(namespace)
    for link in _links():
        match = _LINK.match(link)
        if match is not None and match.group(1) not in live_tokens:
            _run("ip", "link", "del", link, check=False)
            removed.append(link)
    return removed
