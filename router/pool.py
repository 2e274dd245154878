"""The worker pools as the router sees them: actor handles, what each worker told us about itself,
and how many of our requests each one holds right now (the routing signal, known without an RPC)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from protocol.messages import WorkerInfo


@dataclass
class WorkerHandle:
    actor: Any  # a Ray actor handle
    info: WorkerInfo
    in_flight: int = 0  # requests this router has routed here and not seen finish
    # prompt tokens routed here to prefill whose first token has not come back
    queued_prompt_tokens: int = 0
    # KV reservations on their way here, not yet tracked in `in_flight` (a drain waits for both)
    reserving: int = 0
    state: str = "ready"  # "ready", "draining", "stopping" or "dead"
    kv_blocks_free: Optional[int] = None  # refreshed from the worker's load reports
    # time.monotonic() of its last sign of life: a call answered, a step of tokens
    last_heard_s: float = 0.0

    @property
    def worker_id(self) -> str:
        return self.info.worker_id


@dataclass
class WorkerPool:
    role: str
    workers: list[WorkerHandle] = field(default_factory=list)

    def ready(self) -> list[WorkerHandle]:
        return [w for w in self.workers if w.state == "ready"]


class NoWorkerError(RuntimeError):
    pass


class WorkerStartError(RuntimeError):
    """New workers cannot start: the cluster lacks room for them, or they were not ready in time."""
