"""Creating, growing and shrinking the worker pools while serving.

New workers join routing only once they answered `info` (their engine is loaded). Removed workers
are drained: the router stops sending them requests, the ones they hold run to completion, then the
actor is stopped. On a cluster whose nodes carry the custom resources `pdserve_prefill` /
`pdserve_decode` (cluster.yaml), each pool's actors request theirs, so they land only on their own
node type.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Optional

from engine.dtypes import AUTO_DTYPE_ENV
from router.pool import WorkerStartError

log = logging.getLogger(__name__)

NODE_RESOURCE = {
    "prefill": "pdserve_prefill",
    "decode": "pdserve_decode",
    "colocated": "pdserve_decode",
}
_RESOURCE_PER_WORKER = 0.01  # a node type's marker, not a capacity: CPUs and GPUs bound the count
_DRAIN_POLL_S = 0.1


def _free_summary(free: dict[str, float]) -> str:
    """What is free, CPUs always named: Ray leaves a resource out of `available_resources` once none
    is free."""
    names = sorted({"CPU", *(name for name in free if name.startswith(("GPU", "pdserve")))})
    return ", ".join(f"{free.get(name, 0.0):g} {name}" for name in names)


class PoolManager:
    def __init__(self, config, router, epoch: int):
        self.config = config
        self.router = router
        self.epoch = epoch
        self.engine_config = config.engine_config()
        self._next_index = {"prefill": 0, "decode": 0, "colocated": 0}
        self._draining: set[asyncio.Task] = set()
        self.stopped: list = []  # WorkerLoad of each drained worker, taken just before it stopped
        self.replaced: list[str] = []  # ids of dead workers replaced, oldest first
        self._missing: dict[str, int] = {}  # dead workers not yet replaced, per role
        self._healer: Optional[asyncio.Task] = None
        # --transport rdt: the collective group of every worker, once formed
        self.kv_group: Optional[str] = None

    def start_healing(self) -> None:
        self._healer = asyncio.get_running_loop().create_task(self.heal())

    @property
    def decode_role(self) -> str:
        return "decode" if self.config.mode == "disaggregated" else "colocated"

    def _pool(self, role: str):
        return self.router.prefill_pool if role == "prefill" else self.router.decode_pool

    def _actor_options(self, role: str) -> dict:
        import ray

        options = {"num_cpus": self.config.worker_cpus}
        forced_dtype = os.environ.get(AUTO_DTYPE_ENV)
        if forced_dtype:  # what "auto" resolves to, on every node the workers land on
            options["runtime_env"] = {"env_vars": {AUTO_DTYPE_ENV: forced_dtype}}
        # One engine per GPU; Ray sets the actor's CUDA_VISIBLE_DEVICES. Under "auto" a worker
        # without a GPU of its own sees none (Ray hides them) and resolves to cpu.
        if self.config.device == "cuda" or (
            self.config.device == "auto" and ray.cluster_resources().get("GPU", 0) >= 1
        ):
            options["num_gpus"] = 1
        resource = NODE_RESOURCE[role]
        if resource in ray.cluster_resources():
            options["resources"] = {resource: _RESOURCE_PER_WORKER}
        return options

    async def add_workers(self, role: str, count: int) -> list:
        import ray

        from decode_worker.worker import DecodeWorker
        from prefill_worker.worker import PrefillWorker
        from router.pool import WorkerHandle

        if count == 0:
            return []
        if self.kv_group is not None:
            raise WorkerStartError(
                f"{role}: no worker can join the rdt transport's collective group after start "
                "(Ray 2.60 fixes a gloo group's members); scaling up and replacing dead "
                "workers need --transport ray or grpc"
            )
        options = self._actor_options(role)
        # a local node never grows: a pending actor would wait forever
        if self.config.address == "local":
            self._check_room(role, count, options)
        actors = []
        for _ in range(count):
            worker_id = f"{role}-{self._next_index[role]}"
            self._next_index[role] += 1
            if role == "prefill":
                actor = (
                    self._actor_class(PrefillWorker)
                    .options(**options)
                    .remote(
                        worker_id,
                        self.engine_config,
                        self.config.transport,
                        self.epoch,
                        self.config.kv_timeout_s,
                        self.config.core_policy,
                    )
                )
            else:
                actor = (
                    self._actor_class(DecodeWorker)
                    .options(**options)
                    .remote(
                        worker_id,
                        self.engine_config,
                        self.config.transport,
                        self.config.worker_bind_host(),
                        role,
                        self.config.core_policy,
                    )
                )
            actors.append(actor)
        try:  # ready = engine loaded; on a cluster, the wait includes any nodes its autoscaler adds
            infos = await asyncio.wait_for(
                asyncio.gather(*(actor.info.remote() for actor in actors)),
                self.config.worker_start_timeout_s,
            )
        except asyncio.TimeoutError:
            for actor in actors:
                ray.kill(actor)
            raise WorkerStartError(
                f"{role}: {count} new worker(s) were not ready within "
                f"{self.config.worker_start_timeout_s:.0f} s (each needs {options}; free on the "
                f"cluster now: {_free_summary(ray.available_resources())})"
            ) from None
        handles = [WorkerHandle(actor, info) for actor, info in zip(actors, infos)]
        self._check_agreement(role, actors, infos)
        if role != "prefill":  # subscribed to their tokens before any request can be routed to them
            watched = await asyncio.gather(
                *(self.router.watch(handle) for handle in handles), return_exceptions=True
            )
            failures = [result for result in watched if isinstance(result, BaseException)]
            if failures:
                for handle in handles:
                    handle.stop()
                    self.router.unwatch(handle, "not started")
                    ray.kill(handle.actor)
                raise WorkerStartError(
                    f"{role}: could not subscribe to the new workers' tokens: {failures[0]}"
                ) from failures[0]
        self._pool(role).workers.extend(handles)
        log.info(
            "%s pool: %d worker(s) joined: %s", role, count, ", ".join(h.worker_id for h in handles)
        )
        return handles

    def _actor_class(self, worker_class):
        import ray

        if self.config.transport != "rdt":
            return ray.remote(worker_class)
        from kvtransfer.rdt_transport import actor_class_options

        return ray.remote(**actor_class_options())(worker_class)

    async def form_kv_group(self) -> None:
        """--transport rdt, once every worker of the start is ready: the collective group Ray Direct
        Transport moves KV within (kvtransfer/rdt_transport.py); nccl where workers hold a GPU, else
        gloo."""
        from kvtransfer.rdt_transport import form_group

        backend = "nccl" if "num_gpus" in self._actor_options(self.decode_role) else "gloo"
        senders = [w.actor for w in self.router.prefill_pool.workers]
        receivers = [w.actor for w in self.router.decode_pool.workers]
        self.kv_group = await asyncio.to_thread(form_group, senders, receivers, backend)
        log.info(
            "rdt transport: %s group %s over %d prefill + %d decode workers",
            backend,
            self.kv_group,
            len(senders),
            len(receivers),
        )

    def _check_agreement(self, role: str, actors: list, infos: list) -> None:
        """Every worker of a system serves one dtype ("auto" resolves per node): a worker that
        differs would fail each KV handoff's layout check, so it never joins."""
        import ray

        known = [
            w.info
            for pool in (self.router.prefill_pool, self.router.decode_pool)
            for w in pool.workers
        ]
        dtypes = sorted({info.dtype for info in known + list(infos)})
        if len(dtypes) > 1:
            for actor in actors:
                ray.kill(actor)
            raise WorkerStartError(
                f"{role}: workers would serve different dtypes ({', '.join(dtypes)}): their nodes' "
                "CPUs differ under --dtype auto; pass --dtype float32 or bfloat16"
            )

    def _check_room(self, role: str, count: int, options: dict) -> None:
        import ray

        free = ray.available_resources()
        needs = {
            "CPU": options["num_cpus"] * count,
            **{k: v * count for k, v in options.get("resources", {}).items()},
        }
        if "num_gpus" in options:
            needs["GPU"] = options["num_gpus"] * count
        short = {name: need for name, need in needs.items() if free.get(name, 0.0) + 1e-9 < need}
        if short:
            raise WorkerStartError(
                f"{role}: {count} more worker(s) need "
                f"{', '.join(f'{v:g} {k}' for k, v in needs.items())}; this local Ray node has "
                f"{_free_summary(free)} free of {ray.cluster_resources().get('CPU', 0.0):g} CPU "
                f"(each worker holds {options['num_cpus']:g}). Serve with a smaller "
                "--cpus-per-worker, or on a cluster (--address)"
            )

    async def scale(
        self, prefill: Optional[int] = None, decode: Optional[int] = None
    ) -> tuple[int, int]:
        """Returns once the new sizes are in effect: added workers ready, removed ones draining."""
        if prefill is not None and self.config.mode != "disaggregated":
            raise ValueError("prefill: a colocated system has no prefill pool")
        for role, target in (("prefill", prefill), (self.decode_role, decode)):
            if target is None:
                continue
            if target < 1:
                raise ValueError(f"{role}: a pool needs at least 1 worker, got {target}")
            ready = self._pool(role).ready()
            if target > len(ready):
                await self.add_workers(role, target - len(ready))
            for worker in sorted(ready, key=lambda w: w.in_flight)[: max(0, len(ready) - target)]:
                worker.drain()  # the router stops picking it now
                task = asyncio.get_running_loop().create_task(self._drain_and_stop(role, worker))
                self._draining.add(task)
                task.add_done_callback(self._draining.discard)
        return len(self.router.prefill_pool.ready()), len(self.router.decode_pool.ready())

    async def _drain_and_stop(self, role: str, worker) -> None:
        import ray

        while worker.in_flight > 0 or worker.reserving > 0:
            await asyncio.sleep(_DRAIN_POLL_S)
        try:
            load = await worker.actor.load.remote()
            self.stopped.append(load)
            if load.kv_blocks_free != load.kv_blocks_total:
                log.warning(
                    "%s drained with %d of %d KV blocks still in use",
                    worker.worker_id,
                    load.kv_blocks_total - load.kv_blocks_free,
                    load.kv_blocks_total,
                )
        except Exception as error:  # it died while draining: nothing left to free
            log.warning("%s died while draining: %s", worker.worker_id, error)
        worker.stop()
        ray.kill(worker.actor)
        if worker in self._pool(role).workers:  # unless the healer already removed it as dead
            self._pool(role).workers.remove(worker)
        log.info("%s pool: %s drained and stopped", role, worker.worker_id)

    async def heal(self, interval_s: float = 2.0) -> None:
        """Forever: finds workers that died (the router marks those it sees die; a cheap `load` call
        finds idle ones) and replaces each with a fresh worker of its role. A worker heard from
        within the interval (a call answered, tokens streamed) is not asked: each Ray call costs the
        router about 1 ms of CPU here, and a busy decode worker's token stream breaks at once if it
        dies."""
        import ray

        from router.failures import is_actor_death

        while True:
            await asyncio.sleep(interval_s)
            for role in ("prefill", self.decode_role):
                pool = self._pool(role)
                now = time.monotonic()
                ready = [w for w in pool.ready() if now - w.last_heard_s > interval_s]
                answers = await asyncio.gather(
                    *(asyncio.wait_for(w.actor.load.remote(), 10) for w in ready),
                    return_exceptions=True,
                )
                for worker, answer in zip(ready, answers):
                    if isinstance(answer, BaseException) and is_actor_death(answer):
                        worker.mark_dead()
                for worker in [w for w in pool.workers if w.is_dead]:
                    pool.workers.remove(worker)
                    self.router.unwatch(worker, "found dead")  # its requests fail over now
                    try:  # dead, or alive but cut off from the router: its blocks go with it
                        ray.kill(worker.actor)
                    except Exception as error:
                        log.warning("could not kill %s: %s", worker.worker_id, error)
                    self.replaced.append(worker.worker_id)
                    self._missing[role] = self._missing.get(role, 0) + 1
                    log.warning(
                        "%s pool: %s died; %s",
                        role,
                        worker.worker_id,
                        "starting a replacement"
                        if self.kv_group is None
                        else "not replaced (the rdt transport's workers are fixed)",
                    )
                if self._missing.get(role) and self.kv_group is None:
                    try:
                        await self.add_workers(role, self._missing[role])
                        self._missing[role] = 0
                    except Exception:  # e.g. no room on the cluster now: the next round retries
                        log.exception("%s pool: could not start replacements", role)

    def stop_all(self) -> None:
        import ray

        if self._healer is not None:
            self._healer.cancel()
        for task in list(self._draining):
            task.cancel()
        for pool in (self.router.prefill_pool, self.router.decode_pool):
            for worker in pool.workers:
                worker.stop()
                self.router.unwatch(worker, "the system is stopping")
                ray.kill(worker.actor)


class AutoscaleLoop:
    """Every `interval_s`: gather the router's signals, ask the policy, apply its decisions."""

    def __init__(self, pools: PoolManager, config):
        from router.autoscaler import AutoscalePolicy

        self.pools = pools
        self.router = pools.router
        self.config = config
        self.policy = AutoscalePolicy(config)
        self.decisions: list[str] = []  # newest last; shown by GetStats
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        import time

        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                signals = await self._signals()
                for decision in self.policy.decide(time.monotonic(), signals):
                    if decision.pool == "prefill" and self.pools.config.mode != "disaggregated":
                        continue
                    line = (
                        f"{time.strftime('%H:%M:%S')} {decision.pool} -> {decision.size}: "
                        f"{decision.reason}"
                    )
                    log.info("autoscaler: %s", line)
                    self.decisions = (self.decisions + [line])[-50:]
                    if decision.pool == "prefill":
                        await self.pools.scale(prefill=decision.size)
                    else:
                        await self.pools.scale(decode=decision.size)
            except Exception:  # a failed round must not end autoscaling; the next one retries
                log.exception("autoscaler round failed")

    async def _signals(self):
        from router.autoscaler import Signals

        stats = self.router.stats()
        decode = self.router.decode_pool.ready()
        loads = await asyncio.gather(
            *(w.actor.load.remote() for w in decode), return_exceptions=True
        )
        loads = [load for load in loads if not isinstance(load, Exception)]
        total = sum(load.kv_blocks_total for load in loads) or 1
        used = sum(load.kv_blocks_total - load.kv_blocks_free for load in loads)
        return Signals(
            prefill_workers=len(self.router.prefill_pool.ready()),
            decode_workers=len(decode),
            ttft_p50_s=stats.ttft_p50_s,
            queue_p50_s=stats.queue_p50_s,
            decode_kv_use=used / total,
            waiting_for_kv=stats.requests_waiting_for_kv,
            requests_in_flight=stats.requests_in_flight,  # running or waiting for KV room
            requests_arrived=(
                stats.requests_completed + stats.requests_failed + stats.requests_in_flight
            ),
        )
