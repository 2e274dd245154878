"""A worker's state as the router sees it (router/pools/workers.py): its transitions, and who a
pool routes to."""

from protocol.messages import WorkerInfo
from router.pools import WorkerHandle, WorkerPool, WorkerState


def _worker(worker_id: str) -> WorkerHandle:
    return WorkerHandle(
        actor=None, info=WorkerInfo(worker_id, "decode", "node", None, 64, 2048, 100)
    )


def test_a_pool_routes_only_to_ready_workers_and_each_state_changes_by_one_method():
    ready, draining, stopping, dead = (_worker(f"decode-{i}") for i in range(4))
    draining.drain()
    stopping.stop()
    dead.mark_dead()
    pool = WorkerPool("decode", [ready, draining, stopping, dead])
    assert pool.ready() == [ready] and ready.is_ready and dead.is_dead
    assert [w.state for w in pool.workers] == ["ready", "draining", "stopping", "dead"]
    assert f"{draining.state}" == "draining" and draining.state is WorkerState.DRAINING


def test_only_a_ready_worker_starts_draining():
    worker = _worker("decode-0")
    worker.mark_dead()
    worker.drain()  # a dead worker stays dead: the healer replaces it
    assert worker.state is WorkerState.DEAD
