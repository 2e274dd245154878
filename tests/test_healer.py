"""The healer asks only workers it has not heard from lately (without Ray: stand-in actor
handles)."""

import asyncio
import time
from types import SimpleNamespace

from pdserve.system import ServeConfig
from pdserve.workers import RayWorkerFactory
from protocol.messages import WorkerInfo
from router.pools import PoolManager, WorkerHandle, WorkerPool
from router.router import Router, RouterConfig


def _worker(worker_id: str, role: str, asked: list) -> WorkerHandle:
    def load():  # answers at once
        asked.append(worker_id)
        answer = asyncio.get_running_loop().create_future()
        answer.set_result(None)
        return answer

    actor = SimpleNamespace(load=SimpleNamespace(remote=load))
    return WorkerHandle(actor=actor, info=WorkerInfo(worker_id, role, "node", None, 64, 2048, 100))


def test_the_healer_asks_only_workers_not_heard_from_within_its_interval():
    asked: list[str] = []
    busy, idle = _worker("decode-0", "decode", asked), _worker("decode-1", "decode", asked)
    quiet_prefill = _worker("prefill-0", "prefill", asked)
    router = Router(
        RouterConfig("disaggregated"),
        None,
        WorkerPool("prefill", [quiet_prefill]),
        WorkerPool("decode", [busy, idle]),
    )
    manager = PoolManager(router, RayWorkerFactory(ServeConfig(), epoch=1))

    async def run():
        healer = asyncio.get_running_loop().create_task(manager.heal(interval_s=0.05))
        for _ in range(30):  # the busy worker streams tokens all along
            busy.last_heard_s = time.monotonic()
            await asyncio.sleep(0.01)
        healer.cancel()

    asyncio.run(run())
    assert "decode-0" not in asked
    assert asked.count("decode-1") >= 3 and asked.count("prefill-0") >= 3
