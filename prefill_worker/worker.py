"""The prefill worker: runs prompts (batched, chunked), samples each first token, returns it at once
and hands the request to the decode worker that reserved its KV, directly (not through the router):
the prompt's KV to its `kvtransfer` sender, and an `AdmitRequest` (the first token, and a routed
transport's deliveries) to that worker's `admit`.

Ownership: after prefill the engine detaches the request's blocks and the sender owns them until the
decode side acknowledges (ray, rdt: the decode worker calls `acknowledge` once it installed them;
grpc: on the KV stream), the request is aborted, or the lease expires (`kvtransfer` frees them
then). Everything touching the engine runs on its loop thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Optional

from engine.llm_engine import EngineConfig, RequestOutput
from kvtransfer.registry import create_sender
from protocol.messages import PrefillResult, WorkerInfo, WorkerLoad
from protocol.requests import AbortRequest, AcknowledgeRequest, AdmitRequest, PrefillRequest
from runtime.cores import CorePolicy
from runtime.engine_loop import EngineLoop
from runtime.parking import Parking, ParkingEndpoints
from runtime.startup import describe, share_cores, start_engine
from runtime.telemetry import load_report

log = logging.getLogger(__name__)


@dataclass
class _Prefilling:
    request: Optional[PrefillRequest]
    arrival_s: float


@dataclass(frozen=True)
class _Prefilled:
    """What the engine thread hands the request's `prefill` call: the router's reply, and what the
    decode worker is sent (None: nothing to hand off)."""

    result: PrefillResult
    admission: Optional[AdmitRequest]


class PrefillWorker(ParkingEndpoints):
    def __init__(
        self,
        worker_id: str,
        config: EngineConfig,
        transport: str,
        epoch: int,
        kv_lease_s: float = 30.0,
        cores: CorePolicy = CorePolicy(),
    ):
        self.worker_id = worker_id
        self.engine = start_engine(config)
        self.kv_lease_s = kv_lease_s
        self.sender = create_sender(
            transport, self.engine.kv_cache, self.engine.allocator, worker_id, epoch
        )
        self._requests: dict[str, _Prefilling] = {}
        self._admissions: set[asyncio.Task] = set()  # `admit` calls to decode workers under way
        self._actor = None  # this worker's own handle, which decode workers acknowledge to
        self._served = 0
        self.parking = Parking()
        self.sender.between_header_and_payload = lambda request_id: self.parking.hold(
            "transfer", request_id
        )
        # its hash events travel to the router with each result
        self.engine.allocator.track_events()
        self.loop = EngineLoop(
            self.engine,
            hooks=(self._poll_sender,),
            on_output=self._on_output,
            expecting_events=lambda: self.sender.ledger.num_held_requests > 0,
            cores=share_cores(self.engine, cores),
            core_policy=cores,
        )

    def info(self) -> WorkerInfo:
        return describe(self.engine, self.worker_id, "prefill", None)

    async def prefill(self, request: PrefillRequest) -> Optional[PrefillResult]:
        """The prompt's first token and KV handoff, which leaves out the first `skip_blocks` blocks
        (the decode worker holds them already); None when the request was aborted meanwhile."""
        request_id = request.request_id
        outputs = self.loop.listen(request_id)
        arrival_s = time.monotonic()
        budget_s = request.ttft_budget_s
        try:
            self._requests[request_id] = _Prefilling(request, arrival_s)
            await self.parking.hold_async("queued", request_id)
            await self.loop.call(
                lambda: self.engine.add_request(
                    request_id,
                    request.prompt_ids,
                    request.params,
                    hand_off_after_prefill=True,
                    ttft_deadline_s=None if budget_s is None else arrival_s + budget_s,
                )
            )
            result = await outputs.get()
        except BaseException:
            self._requests.pop(request_id, None)
            await self.loop.call(lambda: self._abort(request_id))
            raise
        finally:
            self.loop.unlisten(request_id)
        if isinstance(result, Exception):
            raise result
        if result is None:
            return None
        if result.admission is not None:
            self._hand_over(request, result.admission)
        return result.result

    def _hand_over(self, request: PrefillRequest, admission: AdmitRequest) -> None:
        """Sends the decode worker its admission before the first token goes back to the router. Its
        failure (the decode worker died) reaches the router on that worker's token stream: logged
        only; the KV stays the sender's until the router's abort or the lease."""
        if request.decode is None:
            log.warning("request %s has no decode worker to hand its KV to", request.request_id)
            return
        if admission.deliveries:
            if self._actor is None:
                import ray  # this process is a Ray actor's

                self._actor = ray.get_runtime_context().current_actor
            admission = dataclasses.replace(admission, acknowledge_to=self._actor)
        call = request.decode.admit.remote(admission)

        async def admitted() -> None:
            try:
                await call
            except Exception as error:
                log.warning(
                    "handing request %s to its decode worker failed: %s", request.request_id, error
                )

        task = asyncio.get_running_loop().create_task(admitted())
        self._admissions.add(task)
        task.add_done_callback(self._admissions.discard)

    async def acknowledge(self, request: AcknowledgeRequest) -> None:
        await self.loop.call(lambda: self.sender.acknowledge(request.request_id))

    async def abort(self, request: AbortRequest) -> bool:
        return await self.loop.call(lambda: self._abort(request.request_id))

    async def load(self) -> WorkerLoad:
        return await load_report(self.worker_id, self.loop, lambda: self._served)

    # -- loop thread ---------------------------------------------------------------------------

    def _abort(self, request_id: str) -> bool:
        found = self.engine.abort(request_id)
        if found:
            # its `prefill` call returns (None) instead of waiting for ever
            self.loop.publish(request_id, None)
        if request_id in self.sender.ledger.request_ids():
            self.sender.abort(request_id)
            found = True
        return found

    def _poll_sender(self) -> None:
        events = self.sender.poll()
        for request_id, error in events.failed:
            log.warning("KV handoff of request %s failed: %s", request_id, error)

    def _on_output(self, output: RequestOutput) -> _Prefilled:
        self.parking.hold("prefill", output.request_id)
        prefilling = self._requests.pop(output.request_id, None)
        request = prefilling.request if prefilling is not None else None
        arrival_s = prefilling.arrival_s if prefilling is not None else time.monotonic()
        now = time.monotonic()
        prefill_s = self.loop.last_step_s
        kv_bytes, admission, sent_wall_s = 0, None, time.time()
        kv_wire, kv_wire_bytes = "none", 0
        if output.handed_off:
            blocks = self.engine.detach_kv(output.request_id)
            skip = min(request.skip_blocks if request is not None else 0, len(blocks) - 1)
            # not sent; they stay in this worker's prefix cache
            self.engine.allocator.free(blocks[:skip])
            blocks = blocks[skip:]
            kv_bytes = len(blocks) * self.engine.layout.bytes_per_block
            destination = request.destination if request is not None else None
            wire = request.kv_wire if request is not None else "none"
            self.sender.start(output.request_id, blocks, destination, self.kv_lease_s, wire)
            delivery = self.sender.send_layers(output.request_id)
            kv_wire, kv_wire_bytes = self.sender.wire_sent(output.request_id)
            if request is not None:
                admission = AdmitRequest(
                    output.request_id,
                    request.prompt_ids,
                    output.new_token_ids[0],
                    request.params,
                    (delivery,) if delivery is not None else (),
                )
        self._served += 1
        result = PrefillResult(
            self.worker_id,
            output.new_token_ids[0],
            output.finish_reason,
            output.num_cached_prompt_tokens,
            queue_s=max(0.0, now - arrival_s - prefill_s),
            prefill_s=prefill_s,
            kv_bytes=kv_bytes,
            kv_sent_wall_s=sent_wall_s,
            kv_events=tuple(self.engine.allocator.drain_events()),
            first_token_logprobs=output.logprobs[0] if output.logprobs else None,
            prompt_logprobs=tuple(output.prompt_logprobs)
            if output.prompt_logprobs is not None
            else None,
            costs=self.loop.costs,
            kv_wire=kv_wire,
            kv_wire_bytes=kv_wire_bytes,
        )
        return _Prefilled(result, admission)
