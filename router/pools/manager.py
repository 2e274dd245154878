"""Growing, shrinking and healing the worker pools while serving.

New workers join routing only once they answered `info` (their engine is loaded) and the router is
subscribed to their tokens. Removed workers are drained: the router stops sending them requests, the
ones they hold run to completion, then the actor is stopped. Dead workers are replaced.

The manager decides which workers a pool holds and when each changes state; a `WorkerFactory` (Ray
actors in serving: pdserve/workers.py) starts and stops the actors behind them, so this module
imports no worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Optional, Protocol

from protocol.messages import WorkerInfo
from router.pools.autoscaler import AutoscaleConfig, AutoscalePolicy, Signals
from router.pools.workers import WorkerHandle, WorkerPool, WorkerStartError

if TYPE_CHECKING:
    from router.router import Router

log = logging.getLogger(__name__)

_DRAIN_POLL_S = 0.1


class WorkerFactory(Protocol):
    """Starts and stops the actors behind a pool's workers."""

    async def start(self, role: str, count: int) -> list[tuple[Any, WorkerInfo]]:
        """`count` new workers of `role`, each (actor, its `info`), once all are ready. Raises
        WorkerStartError (having stopped any it started) when the cluster has no room for them or
        they are not ready in time."""

    def kill(self, actor: Any) -> None:
        """Stops the actor at once; its requests and KV blocks go with it."""

    async def form_kv_group(self, senders: list, receivers: list, receiver_role: str) -> str:
        """--transport rdt: forms the collective group of these actors; returns its name."""

    def node_type_missing(self, role: str) -> bool:
        """Whether the cluster had nodes of this role's type and has no live one now (new workers
        of the role then land on other nodes)."""

    def is_displaced(self, worker_id: str) -> bool:
        """Whether the worker was started off its node type, none being alive then."""


class PoolManager:
    def __init__(self, router: Router, workers: WorkerFactory):
        self.router = router  # its pools and its public methods only
        self.workers = workers
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
    def mode(self) -> str:
        return self.router.config.mode

    @property
    def decode_role(self) -> str:
        return "decode" if self.mode == "disaggregated" else "colocated"

    def _pool(self, role: str) -> WorkerPool:
        return self.router.prefill_pool if role == "prefill" else self.router.decode_pool

    async def add_workers(self, role: str, count: int) -> list[WorkerHandle]:
        if count == 0:
            return []
        if self.kv_group is not None:
            raise WorkerStartError(
                f"{role}: no worker can join the rdt transport's collective group after start "
                "(Ray 2.60 fixes a gloo group's members); scaling up and replacing dead "
                "workers need --transport ray or grpc"
            )
        started = await self.workers.start(role, count)
        handles = [WorkerHandle(actor, info) for actor, info in started]
        self._check_agreement(role, handles)
        if role != "prefill":  # subscribed to their tokens before any request can be routed to them
            watched = await asyncio.gather(
                *(self.router.watch(handle) for handle in handles), return_exceptions=True
            )
            failures = [result for result in watched if isinstance(result, BaseException)]
            if failures:
                for handle in handles:
                    handle.stop()
                    self.router.unwatch(handle, "not started")
                    self.workers.kill(handle.actor)
                raise WorkerStartError(
                    f"{role}: could not subscribe to the new workers' tokens: {failures[0]}"
                ) from failures[0]
        self._pool(role).workers.extend(handles)
        log.info(
            "%s pool: %d worker(s) joined: %s", role, count, ", ".join(h.worker_id for h in handles)
        )
        return handles

    async def form_kv_group(self) -> None:
        """--transport rdt, once every worker of the start is ready: the collective group Ray Direct
        Transport moves KV within. Its members are fixed: no worker joins it later."""
        senders = [w.actor for w in self.router.prefill_pool.workers]
        receivers = [w.actor for w in self.router.decode_pool.workers]
        self.kv_group = await self.workers.form_kv_group(senders, receivers, self.decode_role)

    def _check_agreement(self, role: str, handles: list[WorkerHandle]) -> None:
        """Every worker of a system serves one dtype ("auto" resolves per node): a worker that
        differs would fail each KV handoff's layout check, so it never joins."""
        known = [
            w.info
            for pool in (self.router.prefill_pool, self.router.decode_pool)
            for w in pool.workers
        ]
        dtypes = sorted({info.dtype for info in known + [h.info for h in handles]})
        if len(dtypes) > 1:
            for handle in handles:
                self.workers.kill(handle.actor)
            raise WorkerStartError(
                f"{role}: workers would serve different dtypes ({', '.join(dtypes)}): their nodes' "
                "CPUs differ under --dtype auto; pass --dtype float32 or bfloat16"
            )

    async def scale(
        self, prefill: Optional[int] = None, decode: Optional[int] = None
    ) -> tuple[int, int]:
        """Returns once the new sizes are in effect: added workers ready, removed ones draining."""
        if prefill is not None and self.mode != "disaggregated":
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

    async def _drain_and_stop(self, role: str, worker: WorkerHandle) -> None:
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
        self.workers.kill(worker.actor)
        if worker in self._pool(role).workers:  # unless the healer already removed it as dead
            self._pool(role).workers.remove(worker)
        log.info("%s pool: %s drained and stopped", role, worker.worker_id)

    async def heal(self, interval_s: float = 2.0) -> None:
        """Forever: finds workers that died (the router marks those it sees die; a cheap `load` call
        finds idle ones) and replaces each with a fresh worker of its role. A worker heard from
        within the interval (a call answered, tokens streamed) is not asked: each Ray call costs the
        router about 1 ms of CPU here, and a busy decode worker's token stream breaks at once if it
        dies."""
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
                        self.workers.kill(worker.actor)
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
                await self._move_back(role)

    def degraded(self) -> dict[str, str]:
        """Each pool that serves degraded, with why: no live node of its type (its replacements run
        on other nodes), no ready worker (the other pool's workers do its work: decode workers
        prefill), or workers still off their node type."""
        reasons = {}
        for role in (
            ("prefill", self.decode_role) if self.mode == "disaggregated" else ("colocated",)
        ):
            ready = self._pool(role).ready()
            displaced = [w for w in ready if self.workers.is_displaced(w.worker_id)]
            if self.workers.node_type_missing(role):
                reasons[role] = (
                    f"no live node of its type: {len(displaced)} worker(s) on other nodes"
                )
            elif not ready:
                reasons[role] = "no ready worker: replacements starting"
            elif displaced:
                reasons[role] = f"{len(displaced)} worker(s) off their node type: moving back"
        return reasons

    async def _move_back(self, role: str) -> None:
        """Workers started off their node type (none was alive then) are replaced by workers on it
        once one is alive again, then drained: the pools run on the nodes sized for them."""
        pool = self._pool(role)
        displaced = [w for w in pool.ready() if self.workers.is_displaced(w.worker_id)]
        if not displaced or self.kv_group is not None or self.workers.node_type_missing(role):
            return
        try:
            await self.add_workers(role, len(displaced))
        except Exception:  # e.g. no room on that node yet: the next round retries
            log.exception("%s pool: could not start workers on its node type", role)
            return
        for worker in displaced:
            log.info("%s pool: %s moves back to its node type", role, worker.worker_id)
            worker.drain()
            task = asyncio.get_running_loop().create_task(self._drain_and_stop(role, worker))
            self._draining.add(task)
            task.add_done_callback(self._draining.discard)

    def stop_all(self) -> None:
        if self._healer is not None:
            self._healer.cancel()
        for task in list(self._draining):
            task.cancel()
        for pool in (self.router.prefill_pool, self.router.decode_pool):
            for worker in pool.workers:
                worker.stop()
                self.router.unwatch(worker, "the system is stopping")
                self.workers.kill(worker.actor)


class AutoscaleLoop:
    """Every `interval_s`: gather the router's signals, ask the policy, apply its decisions."""

    def __init__(self, pools: PoolManager, config: AutoscaleConfig):
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
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                signals = await self._signals()
                for decision in self.policy.decide(time.monotonic(), signals):
                    if decision.pool == "prefill" and self.pools.mode != "disaggregated":
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

    async def _signals(self) -> Signals:
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
