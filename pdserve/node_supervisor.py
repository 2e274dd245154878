"""`pdserve node`: keeps this machine's Ray node in the cluster, for the pools' hosts.

Ray marks a node dead once the head misses its health checks for long enough (a partition, a
stalled host); the node's raylet then exits on its own and never rejoins, so the pools that lived on
it stay empty. `pdserve node` runs `ray start --block --address ...` and starts it again whenever
the node goes: the `ray start` process exits, or its raylet does (after a partition `ray start`
itself may linger with no raylet under it). Each start waits a back-off first (1 s, doubling up to
`--max-backoff-s`), reset once a node stayed up for `--stable-s`. The router needs no call: its
healer finds the node's resources again and refills the pool there (router/pools/manager.py).

    pdserve node --address 10.0.0.1:6379 -- --node-ip-address=10.0.0.2 \\
        --resources='{"pdserve_decode": 1}' --num-cpus=8

SIGTERM or SIGINT stops the node (its process group) and the supervisor.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

log = logging.getLogger("pdserve.node")


@dataclass(frozen=True)
class NodeConfig:
    address: str  # the head's GCS, host:port
    ray_args: tuple[str, ...] = ()  # more `ray start` flags
    check_period_s: float = 0.5  # how often the node's processes are looked at
    first_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_s: float = 60.0  # a node up this long resets the back-off
    stop_timeout_s: float = 10.0  # SIGTERM to SIGKILL

    def command(self) -> list[str]:
        ray = str(Path(sys.executable).with_name("ray"))
        return [ray, "start", "--block", f"--address={self.address}", *self.ray_args]


def _children(pid: int) -> dict[int, str]:
    """pid -> command name of the processes whose parent is `pid`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        if parent == pid:
            found[int(entry.name)] = name
    return found


class NodeSupervisor:
    def __init__(self, config: NodeConfig):
        self.config = config
        self.starts = 0
        self._stopping = threading.Event()
        self._process: Optional[subprocess.Popen] = None

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> int:
        backoff_s = self.config.first_backoff_s
        while not self._stopping.is_set():
            started_s = time.monotonic()
            why = self._run_once()
            if self._stopping.is_set():
                break
            if time.monotonic() - started_s >= self.config.stable_s:
                backoff_s = self.config.first_backoff_s
            log.warning("ray node gone (%s): starting it again in %.1f s", why, backoff_s)
            if self._stopping.wait(backoff_s):
                break
            backoff_s = min(2 * backoff_s, self.config.max_backoff_s)
        return 0

    def _run_once(self) -> str:
        """Starts the node and returns why it went."""
        self.starts += 1
        log.info(
            "starting the ray node (start %d): %s", self.starts, " ".join(self.config.command())
        )
        self._process = subprocess.Popen(
            self.config.command(), stdin=subprocess.DEVNULL, start_new_session=True
        )
        raylet_seen = False
        try:
            while not self._stopping.wait(self.config.check_period_s):
                code = self._process.poll()
                if code is not None:
                    return f"`ray start` exited with {code}"
                raylet = "raylet" in _children(self._process.pid).values()
                if raylet_seen and not raylet:
                    return "its raylet exited (the head marked the node dead)"
                raylet_seen = raylet_seen or raylet
            return "stopping"
        finally:
            self._stop_node()

    def _stop_node(self) -> None:
        process = self._process
        if process is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=self.config.stop_timeout_s)
                break
            except subprocess.TimeoutExpired:
                continue
        # the group may outlive its leader a moment: what is left of it goes too
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._process = None


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "node",
        help="run this host's Ray node (`ray start --block`) and start it again whenever it goes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--address", required=True, help="the Ray head's GCS address, host:port")
    p.add_argument("--max-backoff-s", type=float, default=NodeConfig.max_backoff_s)
    p.add_argument("--stable-s", type=float, default=NodeConfig.stable_s)
    p.add_argument("ray_args", nargs=argparse.REMAINDER, help="-- then more `ray start` flags")
    p.set_defaults(handler=_node)


def _node(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s pdserve node: %(message)s")
    ray_args = tuple(a for i, a in enumerate(args.ray_args) if not (i == 0 and a == "--"))
    supervisor = NodeSupervisor(
        NodeConfig(args.address, ray_args, max_backoff_s=args.max_backoff_s, stable_s=args.stable_s)
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: supervisor.stop())
    return supervisor.run()
