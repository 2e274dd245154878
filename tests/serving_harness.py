"""Running a real pdserve system (local Ray cluster on loopback, real actors, real gRPC) inside a
test."""

from __future__ import annotations

import asyncio
import threading
import time

from pdserve.client import PdserveClient
from pdserve.system import ServeConfig, init_ray, new_event_loop, start_system


def settled_stats(stats, timeout_s: float = 30):
    """`stats()` once nothing is in flight and every worker's KV blocks are all free again (a worker
    that does not answer reports 0 of 0 blocks: it never counts as free); the last seen after
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = stats()
        settled = seen.requests_in_flight == 0 and all(
            w.kv_blocks_total > 0 and w.kv_blocks_free == w.kv_blocks_total for w in seen.workers
        )
        if settled or time.monotonic() > deadline:
            return seen
        time.sleep(0.2)


class RunningSystem:
    def __init__(self, loop: asyncio.AbstractEventLoop, config: ServeConfig):
        self.loop = loop
        self.config = config
        self.system = asyncio.run_coroutine_threadsafe(start_system(config), loop).result(
            timeout=300
        )
        self.port = self.system.port

    def client(self, timeout_s: float = 120) -> PdserveClient:
        return PdserveClient(port=self.port, timeout_s=timeout_s)

    def openai_client(self, api_key: str = "none"):
        """The official `openai` client on this system's HTTP API (started with `http_port`): no
        retries, so a failure shows at once."""
        import openai

        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.system.http_port}/v1",
            api_key=api_key,
            max_retries=0,
            timeout=120,
        )

    def stats(self):
        with self.client() as client:
            return client.stats()

    def wait_idle(self, timeout_s: float = 30):
        return settled_stats(self.stats, timeout_s)

    def stop(self) -> None:
        if self.system is not None:  # idempotent: a test may stop a shared system early
            asyncio.run_coroutine_threadsafe(self.system.stop(), self.loop).result(timeout=60)
            self.system = None


class Harness:
    """One Ray cluster and one router event loop for the whole test session; systems come and go. A
    test module that needs a cluster of its own shuts this one down (`ray.shutdown()`); the next
    `start` brings it back."""

    def __init__(self, core_dir: str, num_cpus: int = 8):
        self._num_cpus = num_cpus
        self._core_dir = core_dir
        self.loop = new_event_loop()  # the loop the router serves on
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="router-loop", daemon=True
        )
        self._thread.start()
        self._ray_started = False
        self._running: list[RunningSystem] = []

    def ensure_ray(self) -> None:
        """The session's local cluster, started here if it is not up. Its processes keep the
        environment of that moment: a test that sets a variable for one system's workers only
        (they get it through the worker factory) starts the cluster first."""
        import ray

        if not ray.is_initialized():
            # sizes the local cluster's CPU count: max(this machine's cores, num_cpus)
            init_ray(
                ServeConfig(
                    num_prefill=1, num_decode=max(1, self._num_cpus - 1), cpus_per_worker=1.0
                )
            )
            self._ray_started = True

    def start(self, **config) -> RunningSystem:
        self.ensure_ray()
        # fp32 unless told: the tests compare with HF transformers in fp32, whatever this CPU
        # prefers; every disaggregated request through the prefill pool unless told (tests of the
        # local path ask for it) and the test run's own directory for lending cores, so a pdserve
        # serving beside the tests on this machine does not change which cores its workers lend
        defaults = {
            "port": 0,
            "kv_cache_bytes": 64 << 20,
            "dtype": "float32",
            "pd_policy": "remote",
            "core_dir": self._core_dir,
        }
        system = RunningSystem(self.loop, ServeConfig(**{**defaults, **config}))
        self._running.append(system)
        return system

    def stop_systems(self) -> None:
        """Stops every system started here that is still up: what one test module leaves running
        must not hold the cluster's CPUs (or memory) while the next one starts its own."""
        for system in self._running:
            system.stop()
        self._running.clear()

    def close(self) -> None:
        import ray

        if self._ray_started:
            ray.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
