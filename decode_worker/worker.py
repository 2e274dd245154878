"""The decode worker: reserves KV blocks before a transfer starts, installs arriving KV, admits each
request into its running batch (continuous batching) and streams its tokens.

A disaggregated request arrives in two calls from the router, in this order: `reserve` (blocks set
aside, with a deadline) -> `admit` (with the KV deliveries of a routed transport).
The KV may become ready before or after `admit`; either way the request joins the batch at the next
step once both have happened. Ready KV that nobody claims within the reservation's deadline is freed.
In colocated mode `admit_colocated` runs the whole request here. Tokens of every request leave through
one gRPC server stream that the router subscribes to once (`output_address` says where): one message
per engine step, not one per request per step. It is not a Ray streaming generator: those cost the
router about twice the CPU per item (docs/benchmarks.md). Everything touching the engine runs on its
loop thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from dataclasses import dataclass
from typing import AsyncIterator, Optional, Sequence

import grpc
import msgpack

from engine.engine_loop import EngineLoop
from engine.llm_engine import EngineConfig, RequestOutput
from engine.sampling_params import SamplingParams
from engine.telemetry import gpu_stats, rss_bytes
from engine.worker_messages import (OUTPUT_STREAM_SERVICE, OUTPUT_STREAM_VERSION, TokenChunk, WorkerInfo, WorkerLoad,
                                    encode_chunks)
from engine.worker_runtime import Parking, describe, node_ip_address, start_engine
from kvtransfer.errors import KVTransferError
from kvtransfer.registry import create_receiver
from kvtransfer.wire import host_port

log = logging.getLogger(__name__)


@dataclass
class _Awaiting:  # generate() was called; the KV is not ready yet
    prompt_ids: list[int]
    first_token_id: int
    params: SamplingParams


@dataclass
class _Ready:  # the KV is ready; generate() has not been called yet
    block_ids: list[int]
    deadline_s: float


class DecodeWorker:
    def __init__(self, worker_id: str, config: EngineConfig, transport: str, kv_host: Optional[str] = "127.0.0.1",
                 role: str = "decode"):
        self.worker_id = worker_id
        self.role = role
        self.engine = start_engine(config)
        kv_host = kv_host or node_ip_address()  # None: this node's address (on a cluster)
        receiver_options = {"host": kv_host, "port": 0} if transport == "grpc" else {}
        self.receiver = create_receiver(transport, self.engine.kv_cache, self.engine.allocator, **receiver_options)
        self._awaiting: dict[str, _Awaiting] = {}
        self._ready: dict[str, _Ready] = {}
        self._timeouts_s: dict[str, float] = {}
        self._kv_ready_wall_s: dict[str, float] = {}  # reported once, on the request's first chunk
        self._served = 0
        self._kv_host = kv_host  # the token stream binds where the KV receiver does
        self._output_server = None  # grpc.aio.Server, started on the actor's event loop by output_address
        self._output_port = 0
        self._output_secret = secrets.token_hex(16)
        self._output_channel: Optional[asyncio.Queue] = None  # the current subscription's
        self.parking = Parking()
        self.receiver.reservations.before_payload = lambda request_id: self.parking.hold("transfer", request_id)
        self.loop = EngineLoop(self.engine, hooks=(self._poll_receiver,), on_output=self._on_output)
        self.loop.expecting_events = lambda: self.receiver.reservations.num_reserved_requests > 0

    def info(self) -> WorkerInfo:
        return describe(self.engine, self.worker_id, self.role, self._kv_address())

    def _kv_address(self) -> Optional[str]:
        """Where senders reach our KV receiver."""
        address = self.receiver.address
        return None if address is None else _reachable(address)

    # -- disaggregated path --------------------------------------------------------------------

    async def reserve(self, request_id: str, num_prompt_tokens: int, timeout_s: float) -> None:
        """Sets blocks aside for a prompt's KV; raises OutOfBlocksError when they are not free."""
        def reserve() -> None:
            self.receiver.reserve(request_id, self.engine.allocator.blocks_needed(num_prompt_tokens), timeout_s)
            self._timeouts_s[request_id] = timeout_s

        await self.loop.call(reserve)

    async def renew(self, request_id: str, timeout_s: float) -> bool:
        """Restarts a reservation's clock (its prompt still waits for prefill); False when it is gone."""
        return await self.loop.call(lambda: self.receiver.reservations.renew(request_id, timeout_s))

    async def deliver(self, deliveries: Sequence) -> None:
        for delivery in deliveries:  # a failure is reported to the request's stream by the next poll
            try:
                await asyncio.to_thread(self.receiver.deliver, delivery)
            except KVTransferError as error:
                log.warning("KV delivery failed: %s", error)
                return

    async def admit(self, request_id: str, prompt_ids: Sequence[int], first_token_id: int, params: SamplingParams,
                    deliveries: Sequence = ()) -> None:
        """The request joins the running batch as soon as its KV is ready (now, if it already is).
        `deliveries` are a routed transport's KV messages (ray): installed here, in the same call (each
        Ray call costs the router about 1 ms of CPU)."""
        await self.loop.call(lambda: self._admit(request_id, _Awaiting(list(prompt_ids), first_token_id, params)))
        await self.deliver(deliveries)

    # -- colocated path ------------------------------------------------------------------------

    async def admit_colocated(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        await self.parking.hold_async("queued", request_id)
        await self.loop.call(lambda: self.engine.add_request(request_id, prompt_ids, params))

    # -- both ----------------------------------------------------------------------------------

    async def output_address(self) -> tuple[str, str]:
        """Where the router subscribes to this worker's tokens, and the secret it must present (it
        travels only through Ray); the server starts on the first call."""
        if self._output_server is None:
            server = grpc.aio.server()
            handler = grpc.unary_stream_rpc_method_handler(self._serve_outputs)  # bytes in and out
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(OUTPUT_STREAM_SERVICE, {"Subscribe": handler}),))
            self._output_port = server.add_insecure_port(host_port(self._kv_host, 0))
            if self._output_port == 0:
                raise OSError(f"decode worker {self.worker_id} could not bind its token stream on {self._kv_host}")
            await server.start()
            self._output_server = server
        return _reachable(host_port(self._kv_host, self._output_port)), self._output_secret

    async def _serve_outputs(self, request: bytes, context) -> AsyncIterator[bytes]:
        """The router's subscription: a hello once the channel is open (nothing is lost after it), then
        each engine step's chunks for all its requests, errors and aborts included, and an empty
        message after each second without any (the router hears the worker is alive). A request ends
        with a chunk that has a finish reason or an error. A new subscription ends the previous one,
        whose router then fails its requests over rather than wait on a stream nobody feeds."""
        offered = dict(context.invocation_metadata() or ()).get("authorization", "")
        if not secrets.compare_digest(offered.encode(), self._output_secret.encode()):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "this token stream is the router's")
        if self._output_channel is not None:
            self._output_channel.put_nowait(None)
        channel = self._output_channel = self.loop.open_channel()
        try:
            yield msgpack.packb([OUTPUT_STREAM_VERSION, self.worker_id])
            while True:
                try:
                    batch = await asyncio.wait_for(channel.get(), _HEARTBEAT_S)
                except asyncio.TimeoutError:
                    batch = []
                if batch is None:
                    return
                yield encode_chunks([item if isinstance(item, TokenChunk) else
                                     TokenChunk(request_id, (), error=f"{type(item).__name__}: {item}")
                                     for request_id, item in batch])
        finally:  # the router went away, cancelled the call, or a new subscription replaced this one
            self.loop.close_channel(channel)
            if self._output_channel is channel:
                self._output_channel = None

    async def park_at(self, phases: Sequence[str]) -> None:
        """Tests only: see engine.worker_runtime.Parking."""
        self.parking.arm(phases)

    async def parked(self) -> dict[str, str]:
        return dict(self.parking.parked)

    async def release_parked(self) -> None:
        self.parking.release()

    async def abort(self, request_id: str) -> bool:
        return await self.loop.call(lambda: self._abort(request_id))

    async def load(self) -> WorkerLoad:
        gpus, gpu_note = gpu_stats()  # here, not on the engine thread: NVML calls take a while
        return dataclasses.replace(await self.loop.call(self._load), gpus=gpus, gpu_note=gpu_note, rss_bytes=rss_bytes())

    # -- loop thread ---------------------------------------------------------------------------

    def _admit(self, request_id: str, request: _Awaiting) -> None:
        ready = self._ready.pop(request_id, None)
        if ready is None:
            self._awaiting[request_id] = request
            return
        self.engine.start_decode(request_id, request.prompt_ids, request.first_token_id, request.params, ready.block_ids)

    def _poll_receiver(self) -> None:
        events = self.receiver.poll()
        now = time.monotonic()
        for request_id, block_ids in events.ready.items():
            self._kv_ready_wall_s[request_id] = time.time()
            timeout_s = self._timeouts_s.pop(request_id, 30.0)
            waiting = self._awaiting.pop(request_id, None)
            if waiting is None:
                self._ready[request_id] = _Ready(block_ids, now + timeout_s)
            else:
                self.engine.start_decode(request_id, waiting.prompt_ids, waiting.first_token_id, waiting.params, block_ids)
        for request_id, error in events.failed:
            self._timeouts_s.pop(request_id, None)
            self._awaiting.pop(request_id, None)
            self.loop.publish(request_id, TokenChunk(request_id, (), error=f"KV transfer failed: {error}"))
        for request_id in [r for r, ready in self._ready.items() if ready.deadline_s <= now]:
            log.warning("KV of request %s was never claimed; freeing it", request_id)
            self.engine.allocator.free(self._ready.pop(request_id).block_ids)

    def _abort(self, request_id: str) -> bool:
        found = self.engine.abort(request_id) | self.receiver.abort(request_id)
        self._awaiting.pop(request_id, None)
        self._timeouts_s.pop(request_id, None)
        self._kv_ready_wall_s.pop(request_id, None)
        ready = self._ready.pop(request_id, None)
        if ready is not None:
            self.engine.allocator.free(ready.block_ids)
            found = True
        if found:
            self.loop.publish(request_id, TokenChunk(request_id, (), finish_reason="abort"))
        return found

    def _on_output(self, output: RequestOutput) -> TokenChunk:
        if output.num_output_tokens == 1:  # colocated: its prompt is computed, its first token not yet out
            self.parking.hold("prefill", output.request_id)
        if output.finished:
            self._served += 1
        return TokenChunk(
            output.request_id, tuple(output.new_token_ids), output.finish_reason,
            kv_ready_wall_s=self._kv_ready_wall_s.pop(output.request_id, None),
            num_prompt_tokens=output.num_prompt_tokens, num_cached_prompt_tokens=output.num_cached_prompt_tokens,
        )

    def _load(self) -> WorkerLoad:
        scheduler = self.engine.scheduler
        return WorkerLoad(self.worker_id, len(scheduler.running), len(scheduler.waiting) + len(self._awaiting),
                          self.engine.allocator.num_free_blocks, self.engine.allocator.num_blocks,
                          self._served, self.loop.max_batch_size_seen, self.loop.decode_steps, self.loop.decode_steps_s)


_HEARTBEAT_S = 1.0


def _reachable(address: str) -> str:
    """A bound host:port as others reach it: a wildcard bind is advertised as this node's address."""
    host, _, port = address.rpartition(":")
    if host in ("0.0.0.0", "[::]", "::"):
        host = node_ip_address()
    return host_port(host.strip("[]"), int(port))
