"""How a request fails, and what each failure tells its client.

The flow raises these; `describe_failure` turns any of them (or anything else) into a kind that each
front end maps to its status (gRPC code, HTTP status) and a message naming the request.
"""

from __future__ import annotations

import logging

from router.overload import OverloadedError
from router.pools.workers import NoWorkerError, WorkerHandle

log = logging.getLogger("router.router")


class WorkerError(RuntimeError):
    """A worker failed the request (the message says why); the client gets UNAVAILABLE/INTERNAL."""


class AdmissionTimeoutError(RuntimeError):
    """No worker had room for the request in time; the client gets RESOURCE_EXHAUSTED."""


class DuplicateRequestError(ValueError):
    """Another request with the same id is in flight; the client gets ALREADY_EXISTS / HTTP 409."""


class RequestAborted(Exception):
    """`Router.abort` was called for the request: it ends at once with finish reason "abort"."""


class WorkerLost(Exception):
    """A worker holding the request died. The request is migrated: re-run as prompt + tokens so
    far."""

    def __init__(self, worker: WorkerHandle, reason: str):
        super().__init__(f"worker {worker.worker_id} died: {reason}")
        self.worker = worker


def is_actor_death(error: BaseException) -> bool:
    """True when a Ray call failed because the actor is gone (not because the call raised)."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(error, (ActorDiedError, ActorUnavailableError, RayActorError))


def describe_failure(error: BaseException, request_id: str) -> tuple[str, str]:
    """What a frontend tells a client whose request failed with `error`: a kind ("unavailable",
    "overloaded", "conflict", "deadline" or "internal"), which each frontend maps to its status, and
    a message."""
    if isinstance(error, (AdmissionTimeoutError, OverloadedError)):
        return "overloaded", str(error)
    if isinstance(error, NoWorkerError):
        return "unavailable", str(error)
    if isinstance(error, DuplicateRequestError):
        return "conflict", str(error)
    if isinstance(error, TimeoutError):
        return "deadline", f"request {request_id} passed its deadline"
    if isinstance(error, WorkerError):
        log.warning("failed on a worker: %s", error)
        return "unavailable", f"request {request_id} failed: {error}"
    log.error("failed: %s: %s", type(error).__name__, error, exc_info=error)
    return "internal", f"request {request_id} failed: {type(error).__name__}: {error}"
