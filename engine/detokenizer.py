"""Incremental detokenization with stop strings. No torch: the router streams text with it.

Decoding each new token alone breaks words and multi-byte characters (a byte-level token can end in
the middle of a UTF-8 sequence). We decode a short window — the tokens since the last emitted text —
and emit only what the window adds once it no longer ends in U+FFFD, the replacement character a
partial UTF-8 sequence decodes to. Text that could still become a stop string is held back until it
can't; when a stop string appears, the text is cut before it and the sequence is finished.
"""

from __future__ import annotations

from typing import Optional, Sequence

from engine.tokenizer import Tokenizer

_PROMPT_CONTEXT_TOKENS = 4  # so the first output token decodes with its real leading space


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = ()):
        self._tokenizer = tokenizer
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = tuple(stop)
        self._holdback_chars = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""  # all output text so far, cut at a stop string if one was hit
        self._emitted_chars = 0
        self.stop_string: Optional[str] = None

    def add_token(self, token_id: int) -> str:
        """Feed one output token; returns the text that may be streamed now (possibly empty)."""
        if self.stop_string is not None:
            return ""
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        full_text = decode(self._ids[self._prefix_offset :], skip_special_tokens=True)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""  # an incomplete character or a token with no text yet
        search_from = max(0, len(self.text) - self._holdback_chars)
        self.text += full_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._check_stop(search_from)
        return self._take(final=self.stop_string is not None)

    def flush(self) -> str:
        """The held-back text, once the sequence has finished for any reason."""
        return self._take(final=True)

    def _check_stop(self, search_from: int) -> None:
        hits = [(self.text.find(s, search_from), s) for s in self._stop]
        hits = [(at, s) for at, s in hits if at >= 0]
        if hits:
            at, stop_string = min(hits)
            self.text = self.text[:at]
            self.stop_string = stop_string

    def _take(self, final: bool) -> str:
        end = len(self.text) if final else max(self._emitted_chars, len(self.text) - self._holdback_chars)
        chunk = self.text[self._emitted_chars : end]
        self._emitted_chars = end
        return chunk
