"""Token stream intake: each decode worker's tokens reach the router over one gRPC server stream
(`pdserve.internal.v1.DecodeOutputs/Subscribe`), read on a thread of its own, and are handed to the
requests' inboxes on the router's loop.

`TokenStreams` holds one `Subscription` per decode worker and one `Inbox` per request attempt, fed
only by the worker that holds that attempt (a worker whose reservation was handed back cannot end
the attempt running elsewhere under the same id). When a worker's stream ends, every request it
holds gets `WorkerLost` in its inbox. The write gate lets the consumers a step woke prepare their
messages before any of them writes.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import Callable, Optional

import grpc

from protocol.token_stream import (
    OUTPUT_STREAM_METHOD,
    OUTPUT_STREAM_VERSION,
    TokenChunk,
    decode_chunks,
    decode_hello,
)
from router.failures import WorkerError, WorkerLost
from router.kv_index import PrefixIndex
from router.pools.workers import WorkerHandle, WorkerState

log = logging.getLogger("router.router")


class TokenStreams:
    def __init__(self, kv_index: Optional[PrefixIndex] = None) -> None:
        # fed with the hash events that travel with the tokens
        self.kv_index = kv_index or PrefixIndex()
        # worker request id -> (the decode worker holding it, its chunks)
        self._inboxes: dict[str, tuple[WorkerHandle, Inbox]] = {}
        self._subscriptions: dict[str, Subscription] = {}  # decode worker id -> its token stream
        self._write_gate: Optional[asyncio.Future] = None  # see `_take`

    async def watch(self, worker: WorkerHandle, timeout_s: float = 30.0) -> None:
        """Subscribes to a decode worker's token stream; returns once the subscription is in place,
        so nothing the worker emits for requests routed to it after this is lost."""
        address, secret = await worker.actor.output_address.remote()
        subscription = Subscription(
            worker,
            address,
            secret,
            asyncio.get_running_loop(),
            self._take,
            self._lost,
            self.kv_index,
        )
        self._subscriptions[worker.worker_id] = subscription
        try:
            await asyncio.wait_for(asyncio.wrap_future(subscription.started), timeout_s)
        except BaseException:
            subscription.cancel("no token stream")
            raise

    def unwatch(self, worker: WorkerHandle, reason: str) -> None:
        """Ends the subscription to a worker found dead (or stopped) elsewhere: its requests fail
        over at once."""
        subscription = self._subscriptions.get(worker.worker_id)
        if subscription is not None:
            subscription.cancel(reason)

    def open(self, worker_request_id: str, holder: WorkerHandle) -> "Inbox":
        """The inbox of a request attempt on `holder`: opened before any call that could make it
        emit."""
        inbox = Inbox(asyncio.get_running_loop())
        self._inboxes[worker_request_id] = (holder, inbox)
        return inbox

    def inbox(self, worker_request_id: str) -> Optional["Inbox"]:
        entry = self._inboxes.get(worker_request_id)
        return entry[1] if entry is not None else None

    def close(self, worker_request_id: str) -> None:
        self._inboxes.pop(worker_request_id, None)

    def deliver(self, worker: WorkerHandle, chunks: list[TokenChunk]) -> None:
        for chunk in chunks:
            holder, inbox = self._inboxes.get(chunk.request_id, (None, None))
            if holder is worker:
                inbox.put_nowait(chunk)

    async def writes_released(self) -> None:
        """Returns once the consumers of the current step have all prepared their messages (at once
        when no step is being handed out)."""
        gate = self._write_gate
        if gate is not None and not gate.done():
            # a consumer cancelled here (its client left) must not cancel the gate
            await asyncio.shield(gate)

    def _take(self, subscription: "Subscription") -> None:
        """On the loop: hands out every chunk the subscription's reader thread collected since the
        last call. After a stall (a busy loop) that is several steps, which each request then sends
        as one message."""
        self.deliver(subscription.worker, subscription.take())
        # The requests' consumers woken above run before this gate opens: each does its Python work
        # (detokenizing, metrics, the response) and waits in `writes_released`, then the step's
        # writes go out back to back, which costs less CPU than writes spaced out by that work.
        loop = asyncio.get_running_loop()
        gate = self._write_gate = loop.create_future()
        loop.call_soon(_open_gate, gate)

    def _lost(self, subscription: "Subscription", error: str) -> None:
        """On the loop: the worker's stream ended (it died, was stopped, or was found dead)."""
        worker = subscription.worker
        if self._subscriptions.get(worker.worker_id) is subscription:
            del self._subscriptions[worker.worker_id]
            self.kv_index.forget(worker.worker_id)
        self._take(subscription)  # what it sent before is delivered
        if worker.state is not WorkerState.STOPPING:
            log.warning(
                "decode worker %s is gone (%s); failing its requests", worker.worker_id, error
            )
        worker.mark_dead()
        for holder, inbox in list(self._inboxes.values()):
            if holder is worker:
                inbox.put_nowait(WorkerLost(worker, error))


class Inbox:
    """A request's chunks, queued for its consumer: asyncio.Queue's part that the router uses, minus
    its cost per message (it looks the running loop up, a getpid system call, for each wait)."""

    __slots__ = ("_items", "_waiter", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._items: collections.deque = collections.deque()
        self._waiter: Optional[asyncio.Future] = None
        self._loop = loop

    def put_nowait(self, item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    async def get(self):
        while not self._items:
            self._waiter = self._loop.create_future()
            await self._waiter
        return self._items.popleft()


def _open_gate(gate: asyncio.Future) -> None:
    if not gate.done():
        gate.set_result(None)


class Subscription:
    """One decode worker's token stream, read by a thread of its own (a blocking gRPC stream), so
    that steps keep arriving while the router's loop is busy and a stalled loop then takes them all
    at once. (Read on the loop with grpc.aio, each step would be handed out before the next is
    read.) Every message, the worker's idle heartbeats included, counts as hearing from it
    (`last_heard_s`): a worker that falls silent is pinged through Ray by the healer, which finds a
    lost node that way. No gRPC keepalive: its pings, on a stream where the router never sends, trip
    the server's limits. The KV hash events that travel with the chunks go straight into `kv_index`,
    from this thread."""

    def __init__(
        self,
        worker: WorkerHandle,
        address: str,
        secret: str,
        loop: asyncio.AbstractEventLoop,
        on_chunks: Callable[["Subscription"], None],
        on_lost: Callable[["Subscription", str], None],
        kv_index: PrefixIndex,
    ):
        """`on_chunks(self)` runs on `loop` when chunks wait in `take()`; `on_lost(self, error)`
        once the stream has ended."""
        self.worker = worker
        self._kv_index = kv_index
        # set once the worker's hello came
        self.started: concurrent.futures.Future = concurrent.futures.Future()
        self._on_chunks = on_chunks
        self._on_lost = on_lost
        self._loop = loop
        self._pending: list[TokenChunk] = []
        self._lock = threading.Lock()
        self._cancel_reason: Optional[str] = None
        self._channel = grpc.insecure_channel(address)
        self._call = self._channel.unary_stream(OUTPUT_STREAM_METHOD)(
            b"", metadata=(("authorization", secret),)
        )
        threading.Thread(target=self._read, name=f"tokens-{worker.worker_id}", daemon=True).start()

    def cancel(self, reason: str) -> None:
        self._cancel_reason = reason
        self._call.cancel()

    def take(self) -> list[TokenChunk]:
        with self._lock:
            chunks, self._pending = self._pending, []
        return chunks

    def _read(self) -> None:
        try:
            for index, data in enumerate(self._call):
                if index == 0:
                    self._check_hello(data)
                    continue
                self.worker.last_heard_s = time.monotonic()
                chunks, kv_events, self.worker.costs = decode_chunks(data)
                if kv_events:
                    self._kv_index.apply(self.worker.worker_id, kv_events)
                if not chunks:  # a heartbeat
                    continue
                with self._lock:
                    wake = not self._pending  # else a `_take` is already on its way
                    self._pending.extend(chunks)
                if wake:
                    self._loop.call_soon_threadsafe(self._on_chunks, self)
            error = "its output stream ended"
        except Exception as failure:
            if self._cancel_reason is not None:
                error = self._cancel_reason
            elif isinstance(failure, grpc.RpcError):
                error = f"{failure.code().name}: {failure.details()}"
            else:
                error = f"{type(failure).__name__}: {failure}"
        finally:
            self._channel.close()
        if not self.started.done():
            self.started.set_exception(
                WorkerError(f"decode worker {self.worker.worker_id}: no token stream ({error})")
            )
        try:
            self._loop.call_soon_threadsafe(self._on_lost, self, error)
        except RuntimeError:  # the router's loop is closed: the system has stopped
            pass

    def _check_hello(self, data: bytes) -> None:
        version, worker_id, held = decode_hello(data)
        if version != OUTPUT_STREAM_VERSION or worker_id != self.worker.worker_id:
            raise WorkerError(
                f"the token stream of {self.worker.worker_id} answered as {worker_id} with "
                f"version {version}, not {OUTPUT_STREAM_VERSION}"
            )
        self._kv_index.reset(worker_id, held)
        self.started.set_result(None)


def open_chunk(chunk) -> bool:
    return isinstance(chunk, TokenChunk) and chunk.finish_reason is None and chunk.error is None


def joined(first: TokenChunk, then: TokenChunk) -> TokenChunk:
    """Two consecutive chunks of one request as one."""
    return dataclasses.replace(
        then,
        token_ids=first.token_ids + then.token_ids,
        kv_ready_wall_s=first.kv_ready_wall_s
        if first.kv_ready_wall_s is not None
        else then.kv_ready_wall_s,
        num_cached_prompt_tokens=max(first.num_cached_prompt_tokens, then.num_cached_prompt_tokens),
        logprobs=None
        if first.logprobs is None and then.logprobs is None
        else (first.logprobs or ()) + (then.logprobs or ()),
        prompt_logprobs=first.prompt_logprobs
        if first.prompt_logprobs is not None
        else then.prompt_logprobs,
    )
