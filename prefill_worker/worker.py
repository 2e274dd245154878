"""The prefill worker: runs prompts (batched, chunked), samples each first token, returns it at once
and hands the prompt's KV to its `kvtransfer` sender.

Ownership: after prefill the engine detaches the request's blocks and the sender owns them until the
decode side acknowledges (the router calls `acknowledge`), the request is aborted, or the lease
expires (`kvtransfer` frees them then). Everything touching the engine runs on its loop thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

from engine.llm_engine import EngineConfig, RequestOutput
from kvtransfer.registry import create_sender
from protocol.messages import PrefillResult, WorkerInfo, WorkerLoad
from protocol.requests import AbortRequest, AcknowledgeRequest, PrefillRequest
from runtime.cores import CorePolicy
from runtime.engine_loop import EngineLoop
from runtime.parking import Parking, ParkingEndpoints
from runtime.startup import describe, share_cores, start_engine
from runtime.telemetry import load_report

log = logging.getLogger(__name__)


@dataclass
class _Prefilling:
    destination: Optional[str]
    arrival_s: float
    skip_blocks: int = 0  # leading prompt blocks the decode worker already holds: not sent


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
        )

    def info(self) -> WorkerInfo:
        return describe(self.engine, self.worker_id, "prefill", None)

    async def prefill(self, request: PrefillRequest) -> Optional[PrefillResult]:
        """The prompt's first token and KV handoff, which leaves out the first `skip_blocks` blocks (the
        decode worker holds them already); None when the request was aborted meanwhile."""
        request_id = request.request_id
        outputs = self.loop.listen(request_id)
        try:
            self._requests[request_id] = _Prefilling(
                request.destination, time.monotonic(), request.skip_blocks
            )
            await self.parking.hold_async("queued", request_id)
            await self.loop.call(
                lambda: self.engine.add_request(
                    request_id, request.prompt_ids, request.params, hand_off_after_prefill=True
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
        return result

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

    def _on_output(self, output: RequestOutput) -> PrefillResult:
        self.parking.hold("prefill", output.request_id)
        request = self._requests.pop(output.request_id, None) or _Prefilling(None, time.monotonic())
        now = time.monotonic()
        prefill_s = self.loop.last_step_s
        kv_bytes, deliveries, sent_wall_s = 0, (), time.time()
        if output.handed_off:
            blocks = self.engine.detach_kv(output.request_id)
            skip = min(request.skip_blocks, len(blocks) - 1)
            # not sent; they stay in this worker's prefix cache
            self.engine.allocator.free(blocks[:skip])
            blocks = blocks[skip:]
            kv_bytes = len(blocks) * self.engine.layout.bytes_per_block
            self.sender.start(output.request_id, blocks, request.destination, self.kv_lease_s)
            delivery = self.sender.send_layers(output.request_id)
            deliveries = (delivery,) if delivery is not None else ()
        self._served += 1
        return PrefillResult(
            self.worker_id,
            output.new_token_ids[0],
            output.finish_reason,
            output.num_cached_prompt_tokens,
            queue_s=max(0.0, now - request.arrival_s - prefill_s),
            prefill_s=prefill_s,
            kv_bytes=kv_bytes,
            kv_sent_wall_s=sent_wall_s,
            deliveries=deliveries,
            kv_events=tuple(self.engine.allocator.drain_events()),
            first_token_logprobs=output.logprobs[0] if output.logprobs else None,
            prompt_logprobs=tuple(output.prompt_logprobs)
            if output.prompt_logprobs is not None
            else None,
        )
