"""Runs an `LLMEngine` on its own thread and bridges it to asyncio callers (the Ray worker actors).

The engine, its allocator and anything else registered as a hook are touched only from the loop's
thread. Callers submit work with `call(fn)` (fn runs on the loop thread, the awaitable gets its
result) and receive outputs either per request, on an asyncio queue opened with
`listen(request_id)`, or all together on one channel opened with `open_channel()`: then each turn of
the loop delivers one list of `(request_id, item)` pairs, so a consumer pays one hand-off per step,
not one per request.

Each turn of the loop: run submitted calls -> run hooks (transport polls) -> one engine step ->
hand each output to `on_output` (still on the loop thread), then to the request's listener.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import queue
import threading
import time
from typing import Any, Callable, Iterator, Optional

from engine.llm_engine import LLMEngine, RequestOutput
from protocol.messages import WorkerCosts
from runtime.cores import CorePolicy, CoreShare, StreamProgress, decode_slack_s
from runtime.costs import CostMeter

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05  # with nothing to run, how long to sleep before polling hooks again


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        hooks: tuple[Callable[[], None], ...] = (),
        on_output: Optional[Callable[[RequestOutput], Any]] = None,
        expecting_events: Callable[[], bool] = lambda: False,
        busy_wait_s: float = 0.002,
        cores: Optional[CoreShare] = None,
        core_policy: CorePolicy = CorePolicy(),
    ):
        """`hooks` run on the loop thread before each step (transport polls); `on_output` turns each
        output into what is published; while `expecting_events()` (a transfer under way) the loop
        polls its hooks every `busy_wait_s` instead of sleeping. `cores`: this worker's share of the
        node's cores (its home cores held while it has work, idle ones borrowed per step).
        `core_policy`: the one `cores` shares by, whose TPOT budget its streams' slack in `costs`
        is reckoned against (lending or not, on any device)."""
        self.engine = engine
        self.cores = cores
        self._core_policy = core_policy
        self._hooks = hooks
        self._on_output = on_output
        self._busy_wait_s = busy_wait_s  # sleep between polls while hooks expect events (transfers)
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._mid_step_calls: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._listeners: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._listeners_lock = threading.Lock()
        self._channel: Optional[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = None
        self._channel_batch: list[tuple[str, Any]] = []  # loop thread only
        self._stopped = False
        self.expecting_events = expecting_events
        self.max_batch_size_seen = 0
        # duration of the latest engine step (the prefill time of its outputs)
        self.last_step_s = 0.0
        self.decode_steps = 0  # steps that decoded only (no prefill), and their total time
        self.decode_steps_s = 0.0
        # its steps' recent costs, and with them its streams' slack after its latest step: the
        # router's PD policy reads them (router/pd_policy.py); set on the loop thread, read anywhere
        self.meter = CostMeter(engine.scheduler.config.decode_interleave_tokens)
        self.costs: WorkerCosts = self.meter.costs()
        self._step_pauses_s = 0.0  # cores lent at layer boundaries of the step under way
        # Whether lending the cores was decided on since the streams' last token: once per token,
        # so no gap between two tokens is longer than one pause and one step
        self._lending_decided = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # -- asyncio side --------------------------------------------------------------------------

    def call(self, fn: Callable[[], Any], mid_step: bool = False) -> asyncio.Future:
        """Runs `fn` on the loop thread between two engine steps; with `mid_step`, also at a layer
        boundary of a step under way (for calls that only set free blocks aside, such as a KV
        reservation: a decode step is tens of milliseconds, and a prompt's TTFT waits for its
        reservation)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        (self._mid_step_calls if mid_step else self._calls).put((fn, loop, future))
        self._wake.set()
        return future

    def listen(self, request_id: str) -> asyncio.Queue:
        outputs: asyncio.Queue = asyncio.Queue()
        with self._listeners_lock:
            self._listeners[request_id] = (asyncio.get_running_loop(), outputs)
        return outputs

    def unlisten(self, request_id: str) -> None:
        with self._listeners_lock:
            self._listeners.pop(request_id, None)

    def open_channel(self) -> asyncio.Queue:
        """One queue for every request's items, delivered as a list per loop turn."""
        channel: asyncio.Queue = asyncio.Queue()
        self._channel = (asyncio.get_running_loop(), channel)
        return channel

    def close_channel(self, channel: asyncio.Queue) -> None:
        """Its subscriber went away: items stop piling up in it (unless another channel replaced
        it)."""
        current = self._channel
        if current is not None and current[1] is channel:
            self._channel = None

    def publish(self, request_id: str, item: Any) -> None:
        """Sends an item to a request's listener from the loop thread (outputs, errors, events)."""
        if self._channel is not None:
            self._channel_batch.append((request_id, item))
            return
        with self._listeners_lock:
            listener = self._listeners.get(request_id)
        if listener is not None:
            loop, outputs = listener
            loop.call_soon_threadsafe(outputs.put_nowait, item)

    def wake(self) -> None:
        """Any thread: the loop's hooks have news (a transport received something): it polls them
        now rather than at its next idle tick."""
        self._wake.set()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
        if self.cores is not None and not self._thread.is_alive():
            self.cores.close()

    # -- loop thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped:
            self._between_steps()
            if self.engine.has_unfinished():
                if self.cores is not None:
                    self.cores.busy()
                    # while lent, calls and transport polls still run
                    self._lend_asked_cores(self._between_steps)
                self._step()
            self._flush_channel()
            if not self.engine.has_unfinished():
                if self.cores is not None:
                    self.cores.idle()
                self._wake.wait(self._busy_wait_s if self.expecting_events() else _IDLE_WAIT_S)
                self._wake.clear()

    def _lend_asked_cores(self, meanwhile: Callable[[], None]) -> float:
        """Lends the home cores to a prefill that asks for them, within the decoding streams'
        slack (`runtime.cores.CoreShare.lend_within`), deciding at most once per token. The slack
        is worked out only when asked (a few flock calls). Returns the pause."""
        if self._lending_decided or not self.cores.asked():
            return 0.0
        self._lending_decided = True
        slack_s = self._decode_slack_s()
        return 0.0 if slack_s is None else self.cores.lend_within(slack_s, meanwhile)

    def _decode_slack_s(self) -> Optional[float]:
        """How long the next decode step may wait with every running stream that can still meet its
        share of the TPOT budget expected to (`runtime.cores.decode_slack_s`): None when the worker
        has prompt work of its own, no budget is set, or no stream can. A stream's clock starts when
        it started decoding here."""
        scheduler = self.engine.scheduler
        if scheduler.waiting or not scheduler.running or not self.decode_steps:
            return None
        if any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in scheduler.running):
            return None
        return self._streams_slack_s(
            scheduler.running, self.decode_steps_s / self.decode_steps, self.cores.policy
        )

    @staticmethod
    def _streams_slack_s(decoding: list, step_s: float, policy: CorePolicy) -> Optional[float]:
        now = time.monotonic()
        streams = [
            StreamProgress(
                len(seq.output_token_ids), seq.params.max_tokens, now - seq.arrival_time_s
            )
            for seq in decoding
        ]
        return decode_slack_s(streams, step_s, policy)

    def _measure(self) -> None:
        """After a step: its cost into the meter, and `costs` renewed. The slack is the decoding
        streams' alone, whatever prompts wait here (the router counts those against it), at the
        recent decode step: the batch has grown since the worker's quiet start, and a prompt's
        wait is judged against the steps to come."""
        engine = self.engine
        if engine.last_step_was_prefill:
            self.meter.prefill_step(engine.last_step_prompt_tokens, self.last_step_s)
            engine.scheduler.prefill_token_s = self.meter.prefill_token_s  # for its deadlines
        else:
            self.meter.decode_step(self.last_step_s)
        decoding = [
            seq
            for seq in engine.scheduler.running
            if seq.num_computed_tokens >= seq.num_prompt_tokens
        ]
        step_s = self.meter.decode_step_s
        if not decoding:
            slack_s = math.inf
        elif step_s is None:
            slack_s = 0.0  # no decode step yet to judge by
        else:
            slack_s = self._streams_slack_s(decoding, step_s, self._core_policy) or 0.0
        self.costs = self.meter.costs(max(0.0, slack_s))

    def _flush_channel(self) -> None:
        current = self._channel  # read once: another thread may close it meanwhile
        if current is not None and self._channel_batch:
            loop, channel = current
            batch, self._channel_batch = self._channel_batch, []
            loop.call_soon_threadsafe(channel.put_nowait, batch)

    def _between_steps(self) -> None:
        self._run_calls(self._calls)
        self._run_calls(self._mid_step_calls)
        for hook in self._hooks:
            try:
                hook()
            except Exception:  # a broken hook must not kill every request on this worker
                log.exception("engine loop hook %s failed", getattr(hook, "__name__", hook))

    @contextlib.contextmanager
    def _compute(self, batch) -> Iterator[Callable[[], None]]:
        """Wraps a step's forward pass: its cores (borrowed, asked for) and, between layers, the
        calls that may run mid-step. A decode step also lends its cores at a layer boundary to a
        prefill that asks for them (so the prefill need not wait for the step to end), within its
        streams' slack like a pause between steps."""
        cores = self.cores
        lends_mid_step = (
            cores is not None and not batch.is_prefill and cores.policy.tpot_budget_s is not None
        )
        step = cores.step(batch.is_prefill) if cores is not None else contextlib.nullcontext()
        with step as hook:

            def run_mid_step_calls() -> None:
                if not self._mid_step_calls.empty():
                    self._run_calls(self._mid_step_calls)

            def between_layers() -> None:
                if hook is not None:
                    hook()
                run_mid_step_calls()
                if lends_mid_step:  # while lent, the mid-step calls still run
                    self._step_pauses_s += self._lend_asked_cores(run_mid_step_calls)

            yield between_layers

    def _run_calls(self, calls: queue.SimpleQueue) -> None:
        while True:
            try:
                fn, loop, future = calls.get_nowait()
            except queue.Empty:
                return
            try:
                result, error = fn(), None
            except Exception as exc:  # handed back to the caller, who turns it into a status
                result, error = None, exc
            loop.call_soon_threadsafe(_settle, future, result, error)

    def _step(self) -> None:
        scheduler = self.engine.scheduler
        running = len(scheduler.running)
        self.max_batch_size_seen = max(self.max_batch_size_seen, running)
        started = time.monotonic()
        self._step_pauses_s = 0.0
        try:
            outputs = self.engine.step(self._compute)
        except Exception as error:
            log.exception("engine step failed; failing the requests in it")
            for request_id in [
                s.request_id
                for s in self.engine.scheduler.running + list(self.engine.scheduler.waiting)
            ]:
                self.engine.abort(request_id)
                self.publish(request_id, error)
            return
        if not self.engine.last_step_num_seqs:
            return  # nothing could be scheduled (no KV room yet): no step to count
        # its compute time: a pause lending the cores mid-step is not the step's
        self.last_step_s = time.monotonic() - started - self._step_pauses_s
        self._lending_decided = False
        if not self.engine.last_step_was_prefill:
            self.decode_steps += 1
            self.decode_steps_s += self.last_step_s
        self._measure()
        for output in outputs:
            try:
                item = self._on_output(output) if self._on_output else output
            except Exception as error:
                # e.g. a KV handoff that could not start: fail this request only
                log.exception("handling the output of request %s failed", output.request_id)
                self.engine.abort(output.request_id)
                item = error
            self.publish(output.request_id, item)


def _settle(future: asyncio.Future, result: Any, error: Optional[BaseException]) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
