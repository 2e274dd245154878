"""The worker pools as the router sees them: actor handles, what each worker told us about itself,
how many of our requests each one holds right now (the routing signal, known without an RPC), and
its state, which changes only through `WorkerHandle`'s methods:

    ready --drain()--> draining --stop()--> stopping
    any --stop()--> stopping (never started, the system stopping)
    any --mark_dead()--> dead (a call or its token stream found it gone; the healer replaces it)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

from protocol.messages import WorkerCosts, WorkerInfo


class WorkerState(str, enum.Enum):
    READY = "ready"  # routed to
    DRAINING = "draining"  # a scale-down chose it: no new requests; stopped once it holds none
    STOPPING = "stopping"  # stopped on purpose
    DEAD = "dead"  # found dead: skipped from then on, and replaced by the healer

    def __str__(self) -> str:
        return self.value


@dataclass
class WorkerHandle:
    actor: Any  # a Ray actor handle
    info: WorkerInfo
    in_flight: int = 0  # requests this router has routed here and not seen finish
    # prompt tokens routed here to prefill whose first token has not come back
    queued_prompt_tokens: int = 0
    # those prompts, each with its TTFT deadline (router.counting.QueuedPrompt; a prefill worker's)
    queued_prompts: dict = field(default_factory=dict)
    # KV reservations on their way here, not yet tracked in `in_flight` (a drain waits for both)
    reserving: int = 0
    state: WorkerState = WorkerState.READY  # changed by the methods below only
    kv_blocks_free: Optional[int] = None  # refreshed from the worker's load reports
    # its step costs as it last reported them (a prefill worker's with each result, a decode
    # worker's with each message of its token stream): the PD policy reads them
    costs: WorkerCosts = WorkerCosts()
    # time.monotonic() of its last sign of life: a call answered, a step of tokens
    last_heard_s: float = 0.0

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def is_ready(self) -> bool:
        return self.state is WorkerState.READY

    @property
    def is_dead(self) -> bool:
        return self.state is WorkerState.DEAD

    def drain(self) -> None:
        """A scale-down chose it: the router stops picking it now."""
        if self.state is WorkerState.READY:
            self.state = WorkerState.DRAINING

    def stop(self) -> None:
        """It is being stopped on purpose: its stream's end is not a failure to report."""
        self.state = WorkerState.STOPPING

    def mark_dead(self) -> None:
        self.state = WorkerState.DEAD


@dataclass
class WorkerPool:
    role: str
    workers: list[WorkerHandle] = field(default_factory=list)

    def ready(self) -> list[WorkerHandle]:
        return [w for w in self.workers if w.is_ready]


class NoWorkerError(RuntimeError):
    pass


class WorkerStartError(RuntimeError):
    """New workers cannot start: the cluster lacks room for them, or they were not ready in time."""
