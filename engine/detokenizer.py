"""Incremental detokenization with stop strings. No torch: the router streams text with it.

Decoding each new token alone breaks words and multi-byte characters (a byte-level token can end in
the middle of a UTF-8 sequence). We decode a short window — the tokens since the last emitted text —
and emit only what the window adds once it no longer ends in U+FFFD, the replacement character a
partial UTF-8 sequence decodes to. Text that could still become a stop string (a tail of the text
that begins one) is held back until it can't; when a stop string appears, the text is cut before it
and the sequence is finished. `flush()` releases whatever is held back, including a character the
output ended in the middle of (as U+FFFD, the way a full decode shows it).
"""

from __future__ import annotations

from typing import Optional, Sequence

from engine.tokenizer import Tokenizer

_PROMPT_CONTEXT_TOKENS = 4  # so the first output token decodes with its real leading space


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = ()
    ):
        self._tokenizer = tokenizer
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = tuple(s for s in stop if s)  # an empty stop string would match before any text
        self._max_stop_chars = max((len(s) for s in self._stop), default=0)
        self.text = ""  # all output text so far, cut at a stop string if one was hit
        self._emitted_chars = 0
        self.stop_string: Optional[str] = None

    def add_token(self, token_id: int) -> str:
        """Feed one output token; returns the text that may be streamed now (possibly empty)."""
        if self.stop_string is not None:
            return ""
        self._ids.append(token_id)
        new_text = self._decode_unread()
        if not new_text or new_text.endswith("\ufffd"):
            return ""  # a token with no text yet, or an incomplete character
        self._append(new_text)
        return self._take(final=self.stop_string is not None)

    def flush(self) -> str:
        """The held-back text, once the sequence has finished for any reason."""
        if self.stop_string is None:
            self._append(self._decode_unread())
        return self._take(final=True)

    def _decode_unread(self) -> str:
        decode = self._tokenizer.decode
        prefix_text = decode(
            self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=True
        )
        full_text = decode(self._ids[self._prefix_offset :], skip_special_tokens=True)
        return full_text[len(prefix_text) :]

    def _append(self, new_text: str) -> None:
        # A stop string not found before ends in the new text, so it starts at most max-1 characters
        # earlier.
        search_from = max(0, len(self.text) - self._max_stop_chars + 1)
        self.text += new_text
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        hits = [(at, s) for s in self._stop if (at := self.text.find(s, search_from)) >= 0]
        if hits:
            at, self.stop_string = min(hits)
            self.text = self.text[:at]

    def _take(self, final: bool) -> str:
        end = (
            len(self.text)
            if final
            else max(self._emitted_chars, len(self.text) - self._stop_prefix_chars())
        )
        chunk = self.text[self._emitted_chars : end]
        self._emitted_chars = end
        return chunk

    def _stop_prefix_chars(self) -> int:
        """The length of the longest tail of the text that is the start of a stop string."""
        for length in range(min(self._max_stop_chars - 1, len(self.text)), 0, -1):
            tail = self.text[-length:]
            if any(s.startswith(tail) for s in self._stop):
                return length
        return 0
