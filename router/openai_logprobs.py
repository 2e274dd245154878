"""Logprobs in OpenAI's two wire shapes, as vLLM writes them.

Completions (legacy): `{tokens, token_logprobs, top_logprobs, text_offset}`, where each position's
`top_logprobs` is a `{token text: logprob}` dict holding the sampled (or prompt) token first and
then the top N alternatives (N + 1 entries at most), `None` for the first prompt token, and
`text_offset` is where each token's text starts (a streamed chunk starts at the length of the text
streamed before it).
Chat: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`.
A token's text is the token decoded alone (a partial UTF-8 character shows as U+FFFD, as in vLLM).
"""

from __future__ import annotations

from typing import Optional, Sequence

from engine.sampling_params import TokenLogprobs
from engine.tokenizer import Tokenizer

LOGPROB_FLOOR = -9999.0  # what -inf is written as (JSON has no infinity), as OpenAI and vLLM do

# a token id and its logprobs (None: the first prompt token)
Entry = tuple[int, Optional[TokenLogprobs]]


class TokenTexts:
    """Each token id's text decoded alone, remembered (one per vocabulary entry at most)."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text


def _floor(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def completion_logprobs(
    entries: Sequence[Entry], texts: TokenTexts, num_top: int, text_offset: int = 0
) -> dict:
    """The legacy completions' logprobs object of `entries`, the first token's text starting at
    `text_offset`."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, value in entries:
        text = texts(token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if value is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_floor(value.logprob))
        ranked = [(token_id, value.logprob), *((t, lp) for t, lp in value.top if t != token_id)][
            : num_top + 1
        ]
        top_logprobs.append({texts(t): _floor(lp) for t, lp in ranked})
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def chat_logprobs(entries: Sequence[Entry], texts: TokenTexts, num_top: int) -> dict:
    return {
        "content": [
            _chat_entry(token_id, value.logprob, texts, value.top[:num_top])
            for token_id, value in entries
        ]
    }


def _chat_entry(token_id: int, logprob: float, texts: TokenTexts, top=None) -> dict:
    text = texts(token_id)
    entry = {
        "token": text,
        "logprob": _floor(logprob),
        "bytes": list(text.encode("utf-8", errors="replace")),
    }
    if top is not None:
        entry["top_logprobs"] = [_chat_entry(t, lp, texts) for t, lp in top]
    return entry
