"""The decode worker: reserves KV blocks before a transfer starts, installs arriving KV, admits each
request into its running batch (continuous batching) and streams its tokens.

A disaggregated request arrives in two calls, in this order: `reserve` from the router (blocks set
aside, with a deadline) -> `admit` from the prefill worker, directly (its first token, and the KV
deliveries of a routed transport, installed here and acknowledged to that prefill worker directly).
The KV may become ready before or after `admit` (grpc streams it in-band); either way the request
joins the batch at the next step once both have happened. Ready KV that nobody claims within the
reservation's deadline is freed. In colocated mode `admit_colocated` runs the whole request here.
Tokens of every request leave through one gRPC server stream that the router subscribes to once
(`output_address` says where): one message per engine step, not one per request per step. It is not
a Ray streaming generator: those cost the router about twice the CPU per item (docs/benchmarks.md).
Everything touching the engine runs on its loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass
from typing import AsyncIterator, Optional, Sequence

import grpc

from engine.block_manager import OutOfBlocksError
from engine.llm_engine import EngineConfig, RequestOutput
from engine.sampling_params import SamplingParams
from kvtransfer.errors import KVTransferError
from kvtransfer.registry import create_receiver
from protocol.addresses import host_port
from protocol.messages import WorkerInfo, WorkerLoad
from protocol.requests import (
    AbortRequest,
    AcknowledgeRequest,
    AdmitColocatedRequest,
    AdmitRequest,
    RenewRequest,
    ReserveRequest,
)
from protocol.token_stream import OUTPUT_STREAM_SERVICE, TokenChunk, encode_chunks, encode_hello
from runtime.cores import CorePolicy
from runtime.engine_loop import EngineLoop
from runtime.parking import Parking, ParkingEndpoints
from runtime.startup import describe, node_ip_address, share_cores, start_engine
from runtime.telemetry import load_report

log = logging.getLogger(__name__)


@dataclass
class _Admission:  # what `admit` brings: the request as it decodes here
    prompt_ids: list[int]
    first_token_id: int
    params: SamplingParams


@dataclass
class _Handoff:
    """A disaggregated request on this worker from its reservation to its first decoded chunk. It
    joins the running batch once both its admission and its KV are here, in either order; ready KV
    that is not admitted within `timeout_s` is freed."""

    timeout_s: float
    admission: Optional[_Admission] = None
    # set once the KV is ready and verified (the blocks are ours then)
    block_ids: Optional[list[int]] = None
    # time.time() its last layer group was installed: reported on the first chunk
    kv_ready_wall_s: Optional[float] = None
    unclaimed_deadline_s: float = 0.0
    decoding: bool = False


class DecodeWorker(ParkingEndpoints):
    def __init__(
        self,
        worker_id: str,
        config: EngineConfig,
        transport: str,
        kv_host: Optional[str] = "127.0.0.1",
        role: str = "decode",
        cores: CorePolicy = CorePolicy(),
    ):
        self.worker_id = worker_id
        self.role = role
        self.engine = start_engine(config)
        kv_host = kv_host or node_ip_address()  # None: this node's address (on a cluster)
        receiver_options = {"host": kv_host, "port": 0} if transport == "grpc" else {}
        self.receiver = create_receiver(
            transport, self.engine.kv_cache, self.engine.allocator, **receiver_options
        )
        self._handoffs: dict[str, _Handoff] = {}  # engine thread only
        self._acknowledgements: set[asyncio.Task] = set()  # to prefill workers, under way
        self._next_unclaimed_check_s = 0.0
        # request id -> expiry (monotonic s): aborts that found nothing, in case their request's own
        # reserve call is yet to run here
        self._aborted_unknown: dict[str, float] = {}
        self._served = 0
        # per decoding request: the engine loop's decode step count and seconds before its first
        # decoded token (the mean step of its decoding goes with its last chunk); engine thread
        self._decode_from: dict[str, tuple[int, float]] = {}
        self._kv_host = kv_host  # the token stream binds where the KV receiver does
        # grpc.aio.Server, started on the actor's event loop by output_address
        self._output_server = None
        self._output_port = 0
        self._output_secret = secrets.token_hex(16)
        self._output_channel: Optional[asyncio.Queue] = None  # the current subscription's
        self.parking = Parking()
        self.receiver.before_payload = lambda request_id: self.parking.hold("transfer", request_id)
        self.loop = EngineLoop(
            self.engine,
            hooks=(self._poll_receiver, self._forget_gone_decodes),
            on_output=self._on_output,
            cores=share_cores(self.engine, cores),
            core_policy=cores,
        )
        # KV that arrives wakes the loop: a worker waiting for a prompt's KV does not poll every few
        # milliseconds through the prefill (which computes on this worker's idle core meanwhile)
        self.receiver.on_event = self.loop.wake

    def info(self) -> WorkerInfo:
        return describe(self.engine, self.worker_id, self.role, self._kv_address())

    def _kv_address(self) -> Optional[str]:
        """Where senders reach our KV receiver (host:port), or on which GPU (`cuda:<UUID>`)."""
        address = self.receiver.address
        return None if address is None else _reachable(address)

    # -- disaggregated path --------------------------------------------------------------------

    async def reserve(self, request: ReserveRequest) -> Optional[int]:
        """Sets blocks aside for a prompt's KV. With its token ids, the blocks of its prefix that
        this worker holds (an earlier turn, a shared system prompt) are reused rather than sent;
        else only its length counts. Returns how many leading blocks are reused (the prefill worker
        sends the others), or None (a reply, not an exception) when the blocks are not free."""
        request_id, prompt_ids, timeout_s = (
            request.request_id,
            request.prompt_ids,
            request.timeout_s,
        )

        def reserve() -> Optional[int]:
            if self._aborted_unknown.pop(request_id, None) is not None:
                return None  # its abort overtook it (a Ray async actor may run calls out of order)
            try:
                if prompt_ids is None:
                    self.receiver.reserve(
                        request_id,
                        self.engine.allocator.blocks_needed(request.num_prompt_tokens),
                        timeout_s,
                    )
                    reused = 0
                else:
                    reused = self.receiver.reserve_prompt(request_id, prompt_ids, timeout_s)[1]
            except OutOfBlocksError:
                return None
            self._handoffs[request_id] = _Handoff(timeout_s)
            return reused

        # only free blocks are set aside: safe mid-step
        return await self.loop.call(reserve, mid_step=True)

    async def renew(self, request: RenewRequest) -> bool:
        """Restarts a reservation's clock (its prompt still waits for prefill); False when it is
        gone."""
        return await self.loop.call(
            lambda: self.receiver.renew(request.request_id, request.timeout_s), mid_step=True
        )

    async def deliver(self, deliveries: Sequence) -> bool:
        """Installs a routed transport's deliveries; True once the request has all its KV. A failure
        is reported to the request's stream by the next poll."""
        ready = False
        for delivery in deliveries:
            try:
                ready = await asyncio.to_thread(self.receiver.deliver, delivery)
            except KVTransferError as error:
                log.warning("KV delivery failed: %s", error)
                return False
        return ready

    async def admit(self, request: AdmitRequest) -> None:
        """From the prefill worker: the request joins the running batch as soon as its KV is ready
        (now, if it already is). `deliveries` are a routed transport's KV messages (ray, rdt):
        installed here, in the same call, and acknowledged to `acknowledge_to` (the prefill worker)
        as soon as all are, so its sender frees the blocks; neither message passes through the
        router."""
        admission = _Admission(list(request.prompt_ids), request.first_token_id, request.params)
        # the KV is installed while the loop finishes its step: the admission waits for the loop,
        # the delivery does not (it joins the batch when both are in, in either order)
        admitted = self.loop.call(lambda: self._admit(request.request_id, admission))
        try:
            delivered = await self.deliver(request.deliveries)
        finally:
            await admitted
        if delivered and request.acknowledge_to is not None:
            self._acknowledge(request.acknowledge_to, request.request_id)

    def _acknowledge(self, prefill, request_id: str) -> None:
        """Best effort: a lost acknowledgement (the prefill worker died) costs nothing, and one that
        never comes is the lease's to settle."""
        call = prefill.acknowledge.remote(AcknowledgeRequest(request_id))

        async def acknowledged() -> None:
            try:
                await call
            except Exception as error:
                log.warning("acknowledging the KV of request %s failed: %s", request_id, error)

        task = asyncio.get_running_loop().create_task(acknowledged())
        self._acknowledgements.add(task)
        task.add_done_callback(self._acknowledgements.discard)

    # -- colocated path ------------------------------------------------------------------------

    async def admit_colocated(self, request: AdmitColocatedRequest) -> None:
        await self.parking.hold_async("queued", request.request_id)
        await self.loop.call(
            lambda: self.engine.add_request(request.request_id, request.prompt_ids, request.params)
        )

    # -- both ----------------------------------------------------------------------------------

    async def output_address(self) -> tuple[str, str]:
        """Where the router subscribes to this worker's tokens, and the secret it must present (it
        travels only through Ray); the server starts on the first call."""
        if self._output_server is None:
            server = grpc.aio.server()
            handler = grpc.unary_stream_rpc_method_handler(self._serve_outputs)  # bytes in and out
            server.add_generic_rpc_handlers(
                (
                    grpc.method_handlers_generic_handler(
                        OUTPUT_STREAM_SERVICE, {"Subscribe": handler}
                    ),
                )
            )
            self._output_port = server.add_insecure_port(host_port(self._kv_host, 0))
            if self._output_port == 0:
                raise OSError(
                    f"decode worker {self.worker_id} could not bind its token stream on "
                    f"{self._kv_host}"
                )
            await server.start()
            self._output_server = server
        return _reachable(host_port(self._kv_host, self._output_port)), self._output_secret

    async def _serve_outputs(self, request: bytes, context) -> AsyncIterator[bytes]:
        """The router's subscription: a hello once the channel is open (nothing is lost after it),
        then each engine step's chunks for all its requests, errors and aborts included, and an
        empty message after each second without any (the router hears the worker is alive). A
        request ends with a chunk that has a finish reason or an error. A new subscription ends the
        previous one, whose router then fails its requests over rather than wait on a stream nobody
        feeds."""
        offered = dict(context.invocation_metadata() or ()).get("authorization", "")
        if not secrets.compare_digest(offered.encode(), self._output_secret.encode()):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED, "this token stream is the router's"
            )
        if self._output_channel is not None:
            self._output_channel.put_nowait(None)
        channel = self._output_channel = self.loop.open_channel()
        allocator = self.engine.allocator
        try:
            # The router's index of which prefixes live here starts from what the cache holds now;
            # the hash events of each step then travel with its chunks.
            yield encode_hello(self.worker_id, await self.loop.call(allocator.track_events))
            while True:
                try:
                    batch = await asyncio.wait_for(channel.get(), _HEARTBEAT_S)
                except asyncio.TimeoutError:
                    batch = []
                if batch is None:
                    return
                yield encode_chunks(
                    [
                        item
                        if isinstance(item, TokenChunk)
                        else TokenChunk(request_id, (), error=f"{type(item).__name__}: {item}")
                        for request_id, item in batch
                    ],
                    allocator.drain_events(),
                    self.loop.costs,
                )
        finally:
            # the router went away, cancelled the call, or a new subscription replaced this one
            self.loop.close_channel(channel)
            if self._output_channel is channel:
                self._output_channel = None

    async def abort(self, request: AbortRequest) -> bool:
        return await self.loop.call(lambda: self._abort(request.request_id))

    async def load(self) -> WorkerLoad:
        return await load_report(
            self.worker_id, self.loop, lambda: self._served, self._num_waiting_for_kv
        )

    # -- loop thread ---------------------------------------------------------------------------

    def _admit(self, request_id: str, admission: _Admission) -> None:
        handoff = self._handoffs.get(request_id)
        if handoff is None:  # its reservation already failed or was aborted: that was reported
            return
        handoff.admission = admission
        self._start_if_complete(request_id, handoff)

    def _poll_receiver(self) -> None:
        events = self.receiver.poll()
        now = time.monotonic()
        for request_id, block_ids in events.ready.items():
            handoff = self._handoffs.setdefault(request_id, _Handoff(0.0))
            handoff.block_ids = block_ids
            handoff.kv_ready_wall_s = events.ready_wall_s[request_id]
            handoff.unclaimed_deadline_s = now + handoff.timeout_s
            self._start_if_complete(request_id, handoff)
        for request_id, error in events.failed:
            self._handoffs.pop(request_id, None)
            self.loop.publish(
                request_id, TokenChunk(request_id, (), error=f"KV transfer failed: {error}")
            )
        # the poll runs every loop turn; deadlines are seconds away
        if now < self._next_unclaimed_check_s:
            return
        self._next_unclaimed_check_s = now + _UNCLAIMED_CHECK_S
        for request_id in [r for r, expiry_s in self._aborted_unknown.items() if expiry_s <= now]:
            del self._aborted_unknown[request_id]
        for request_id, handoff in list(self._handoffs.items()):
            if (
                handoff.block_ids is not None
                and not handoff.decoding
                and handoff.unclaimed_deadline_s <= now
            ):
                log.warning("KV of request %s was never claimed; freeing it", request_id)
                self.engine.allocator.free(self._handoffs.pop(request_id).block_ids)

    def _start_if_complete(self, request_id: str, handoff: _Handoff) -> None:
        admission = handoff.admission
        if admission is not None and handoff.block_ids is not None and not handoff.decoding:
            handoff.decoding = True  # the blocks are the engine's now
            self.engine.start_decode(
                request_id,
                admission.prompt_ids,
                admission.first_token_id,
                admission.params,
                handoff.block_ids,
            )

    def _num_waiting_for_kv(self) -> int:
        return sum(
            1
            for handoff in self._handoffs.values()
            if handoff.admission is not None and not handoff.decoding
        )

    def _abort(self, request_id: str) -> bool:
        self._decode_from.pop(request_id, None)
        found = self.engine.abort(request_id) | self.receiver.abort(request_id)
        handoff = self._handoffs.pop(request_id, None)
        if handoff is not None and handoff.block_ids is not None and not handoff.decoding:
            self.engine.allocator.free(handoff.block_ids)
            found = True
        if found:
            self.loop.publish(request_id, TokenChunk(request_id, (), finish_reason="abort"))
        else:
            self._aborted_unknown[request_id] = time.monotonic() + _ABORTED_UNKNOWN_KEEP_S
        return found

    def _on_output(self, output: RequestOutput) -> TokenChunk:
        # colocated: its prompt is computed, its first token not yet out
        if output.num_output_tokens == 1:
            self.parking.hold("prefill", output.request_id)
        if output.finished:
            self._served += 1
        return TokenChunk(
            output.request_id,
            tuple(output.new_token_ids),
            output.finish_reason,
            decode_step_s=self._decode_step_s(output),
            kv_ready_wall_s=self._first_chunk_kv_ready_wall_s(output.request_id),
            num_cached_prompt_tokens=output.num_cached_prompt_tokens,
            logprobs=tuple(output.logprobs) if output.logprobs is not None else None,
            prompt_logprobs=tuple(output.prompt_logprobs)
            if output.prompt_logprobs is not None
            else None,
        )

    def _decode_step_s(self, output: RequestOutput) -> Optional[float]:
        """The mean engine decode step while the request decoded here (every decode step of the
        worker from its first decoded token on has it in its batch), on its last output; None
        before, and for a request that never decoded here."""
        loop = self.loop
        if not self.engine.last_step_was_prefill and output.request_id not in self._decode_from:
            # its first decoded token: the counters before this step
            self._decode_from[output.request_id] = (
                loop.decode_steps - 1,
                loop.decode_steps_s - loop.last_step_s,
            )
        if not output.finished:
            return None
        started = self._decode_from.pop(output.request_id, None)
        if started is None or loop.decode_steps <= started[0]:
            return None
        return (loop.decode_steps_s - started[1]) / (loop.decode_steps - started[0])

    def _forget_gone_decodes(self) -> None:
        """Drops the decode-step starts of requests the engine no longer holds that never finished
        here (an engine step that raised fails its requests without an output). A loop hook: no
        step's outputs are half handled then."""
        scheduler = self.engine.scheduler
        if len(self._decode_from) <= len(scheduler.running) + len(scheduler.waiting):
            return
        held = {s.request_id for s in scheduler.running} | {s.request_id for s in scheduler.waiting}
        for request_id in [r for r in self._decode_from if r not in held]:
            del self._decode_from[request_id]

    def _first_chunk_kv_ready_wall_s(self, request_id: str) -> Optional[float]:
        """When the request's KV became ready, on its first decoded chunk (its handoff ends
        there)."""
        handoff = self._handoffs.get(request_id)
        if handoff is None or not handoff.decoding:
            return None
        del self._handoffs[request_id]
        return handoff.kv_ready_wall_s


_HEARTBEAT_S = 1.0
_UNCLAIMED_CHECK_S = 0.5  # how often ready KV that nobody admitted is looked for
# how long an abort that found nothing refuses a late reserve of its id
_ABORTED_UNKNOWN_KEEP_S = 30.0


def _reachable(address: str) -> str:
    """A bound address as others reach it: a wildcard bind (host:port) is advertised as this
    node's address; any other address as it is."""
    host, _, port = address.rpartition(":")
    if host not in ("0.0.0.0", "[::]", "::"):
        return address
    return host_port(node_ip_address(), int(port))
