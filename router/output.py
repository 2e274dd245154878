"""What the router streams to a front end for one request: items of tokens and text, the last with the
request's finish reason, usage and timings; and the progress it keeps to build them (tokens streamed so
far, which a migration re-prefills, the incremental detokenizer, the timestamps)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import TokenLogprobs
from protocol.messages import PrefillResult


@dataclass
class StreamItem:
    """One message to the client: new tokens and text; `final` carries finish reason, usage, timings."""

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

    def text_for(self, token_ids, finish_reason: Optional[str]) -> str:
        text = ""
        for index, token in enumerate(token_ids):
            last = index == len(token_ids) - 1
            if last and finish_reason == "stop" and token in self.stop_token_ids:
                continue  # the engine ends on this token without emitting it as text
            text += self.detok.add_token(token)
        return text + (self.detok.flush() if finish_reason else "")
