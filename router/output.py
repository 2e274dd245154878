"""What the router streams to a front end for one request: items of tokens and text, the last with
the request's finish reason, usage and timings; the progress it keeps to build them (tokens streamed
so far, which a migration re-prefills, the incremental detokenizer, the timestamps); and `Output`,
which turns a worker's tokens into the next item, noting inter-token latency, tokens, first tokens
and TPOTs as it goes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import TokenLogprobs
from protocol.messages import PrefillResult


@dataclass
class StreamItem:
    """One message to the client: new tokens and text; `final` carries finish reason, usage,
    timings."""

    token_ids: list[int]
    text: str
    final: Optional["FinalInfo"] = None
    # one per token of `token_ids`, when the request asked
    logprobs: Optional[list[TokenLogprobs]] = None
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None  # on the first item, when asked


def typed_logprobs(values) -> Optional[list[Optional[TokenLogprobs]]]:
    """Logprobs as a worker sent them (plain tuples, or msgpack's lists) as `TokenLogprobs`."""
    if values is None:
        return None
    return [None if value is None else TokenLogprobs.from_wire(value) for value in values]


@dataclass
class FinalInfo:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    ttft_s: float
    tpot_s: float
    queue_s: float
    prefill_s: float
    kv_bytes: int
    kv_transfer_s: float
    e2e_s: float
    prefill_worker: str = ""
    decode_worker: str = ""
    decode_step_s: float = 0.0  # the decode worker's mean engine decode step; 0: none reported
    pd_decision: str = ""  # where its last attempt prefilled and why (router/pd_policy.py)
    # its last handoff's wire mode and why (router/kv_wire.py), and the bytes sent; "": none
    kv_wire: str = ""
    kv_wire_bytes: int = 0


@dataclass
class Progress:
    start_s: float
    prompt_tokens: int
    detok: IncrementalDetokenizer
    stop_token_ids: frozenset
    # streamed so far (a migration re-prefills them)
    token_ids: list[int] = field(default_factory=list)
    first_token_s: Optional[float] = None
    last_item_s: Optional[float] = None
    completion_tokens: int = 0
    prefill: Optional[PrefillResult] = None
    kv_transfer_s: float = 0.0
    cached_prompt_tokens: int = 0
    pd_decision: str = ""  # its latest attempt's, e.g. "local (link)"; colocated: none
    kv_wire: str = ""  # its latest handoff's wire mode and why, e.g. "lossless (faster)"
    # the decode worker's mean engine decode step for it, with its last chunk
    decode_step_s: Optional[float] = None

    def text_for(self, token_ids, finish_reason: Optional[str]) -> str:
        text = ""
        for index, token in enumerate(token_ids):
            last = index == len(token_ids) - 1
            if last and finish_reason == "stop" and token in self.stop_token_ids:
                continue  # the engine ends on this token without emitting it as text
            text += self.detok.add_token(token)
        return text + (self.detok.flush() if finish_reason else "")


class Output:
    """Builds a request's stream items. `stats` is the router's `RouterStats` (first tokens and
    TPOTs are the autoscaler's signals), `metrics` its `RouterMetrics`."""

    def __init__(self, stats, metrics):
        self._stats = stats
        self._metrics = metrics

    def item(
        self,
        progress: Progress,
        token_ids,
        finish_reason: Optional[str],
        decode_worker_id: str,
        logprobs=None,
        prompt_logprobs=None,
    ) -> StreamItem:
        """The next item of tokens as a worker sent them (plain logprob tuples); it carries `final`
        when the request ends with them, or when the router saw a stop string in their text."""
        now = time.monotonic()
        if progress.first_token_s is None and token_ids:
            progress.first_token_s = now
        if token_ids:
            if progress.last_item_s is not None:
                self._metrics.itl.observe(now - progress.last_item_s)
            progress.last_item_s = now
            self._metrics.generation_tokens.inc(len(token_ids))
        progress.completion_tokens += len(token_ids)
        progress.token_ids.extend(token_ids)
        item = StreamItem(
            list(token_ids),
            progress.text_for(token_ids, finish_reason),
            logprobs=typed_logprobs(logprobs),
            prompt_logprobs=typed_logprobs(prompt_logprobs),
        )
        if progress.detok.stop_string is not None and finish_reason is None:
            # the router saw the stop string first; the worker is aborted as the request ends
            finish_reason = "stop"
        if finish_reason is not None:
            item.final = self.final(progress, finish_reason, now, decode_worker_id)
        return item

    def final(
        self, progress: Progress, finish_reason: str, now: float, decode_worker_id: str
    ) -> FinalInfo:
        first = progress.first_token_s or now
        ttft_s = first - progress.start_s
        tokens = progress.completion_tokens
        if tokens > 1:
            self._stats.tpot(now, (now - first) / (tokens - 1))
        if progress.prefill is None:  # colocated: the first token came from the one worker
            self._stats.first_token(now, ttft_s, 0.0)
        prefill = progress.prefill
        return FinalInfo(
            finish_reason=finish_reason,
            prompt_tokens=progress.prompt_tokens,
            completion_tokens=tokens,
            cached_prompt_tokens=progress.cached_prompt_tokens,
            ttft_s=ttft_s,
            tpot_s=(now - first) / (tokens - 1) if tokens > 1 else 0.0,
            queue_s=prefill.queue_s if prefill else 0.0,
            prefill_s=prefill.prefill_s if prefill else 0.0,
            kv_bytes=prefill.kv_bytes if prefill else 0,
            kv_transfer_s=progress.kv_transfer_s,
            e2e_s=now - progress.start_s,
            prefill_worker=prefill.worker_id if prefill else "",
            decode_worker=decode_worker_id,
            decode_step_s=progress.decode_step_s or 0.0,
            pd_decision=progress.pd_decision,
            kv_wire=progress.kv_wire,
            kv_wire_bytes=prefill.kv_wire_bytes if prefill else 0,
        )
