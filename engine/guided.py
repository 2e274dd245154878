"""Structured outputs: a request's `GuidedDecoding` (a JSON schema, a regex or a list of choices)
compiled by llguidance into a grammar over our own vocabulary, one matcher per request, and the
batch's token masks. No torch: the router checks specs with it (`check`); `engine.sampling` applies
the masks.

llguidance's view of the vocabulary is built from our `tokenizers.Tokenizer` (its JSON form, as the
library's own HF helper does), so nothing is read from a hub. A matcher allows EOS once the grammar
accepts, and only EOS once nothing else can follow, so a finished answer ends.

JSON is compiled without free whitespace (`, ` and `: ` as separators, as Python's `json.dumps`
writes): with any amount allowed, a small model decoding greedily can fill max_tokens with newlines.
A schema's own `x-guidance` options override this.
"""

from __future__ import annotations

import json
import logging
from typing import Optional, Sequence

import llguidance
import llguidance.numpy as llguidance_np
import numpy as np

from engine.sampling_params import GuidedDecoding
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A spec llguidance cannot compile (the message says why)."""


def grammar_of(spec: GuidedDecoding) -> str:
    """The llguidance grammar of a spec (not yet checked against a vocabulary)."""
    if spec.json_schema is not None:
        try:
            schema = json.loads(spec.json_schema)
        except json.JSONDecodeError as error:
            raise GrammarError(f"the JSON schema is not valid JSON: {error}") from error
        if not isinstance(schema, dict):
            raise GrammarError("the JSON schema must be a JSON object")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except (
            Exception
        ) as error:  # ValueError, or what the library raises on values it cannot read
            raise GrammarError(f"the JSON schema cannot be compiled: {error}") from error
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    # Lark string literals take JSON's escapes, so any choice text is spelled exactly.
    return llguidance.LLMatcher.grammar_from_lark(
        "start: " + " | ".join(json.dumps(choice) for choice in spec.choice)
    )


def check(spec: GuidedDecoding) -> None:
    """Raises GrammarError naming the problem when the spec cannot guide decoding. Checked without a
    vocabulary (a fraction of a millisecond; the same errors as with one), so the router builds
    none."""
    grammar = grammar_of(spec)
    try:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    except Exception as error:  # the library refuses what it cannot even read, e.g. a NaN
        raise GrammarError(f"the grammar cannot be compiled: {error}") from error
    if is_error:
        raise GrammarError(_message(messages[0]))


class GrammarCompiler:
    """llguidance's tokenizer for one vocabulary (built once: about 0.25 s for 49k tokens) and the
    matchers of requests. `vocab_size` is the model's (its logits may be wider than the
    tokenizer)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: Optional[int] = None):
        self.vocab_size = vocab_size or tokenizer.vocab_size
        self.eos_token_ids = tuple(tokenizer.special.eos_token_ids)
        self.ll_tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(),
            n_vocab=self.vocab_size,
            eos_token=list(self.eos_token_ids) or None,
        )

    def matcher(
        self, spec: GuidedDecoding, output_so_far: Sequence[int] = ()
    ) -> llguidance.LLMatcher:
        """A fresh matcher advanced over tokens already output (a migrated request's)."""
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar_of(spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(_message(matcher.get_error()))
        if output_so_far and not matcher.consume_tokens(list(output_so_far)):
            raise GrammarError(
                f"the {len(output_so_far)} tokens already output do not match the grammar: "
                f"{_message(matcher.get_error())}"
            )
        return matcher


class BatchMasks:
    """The allowed-token bitmasks of a batch's guided rows, computed in parallel on `threads`
    threads (llguidance drops the GIL), into a buffer reused step after step."""

    def __init__(self, compiler: GrammarCompiler, threads: int = 1):
        self.compiler = compiler
        self.words = (compiler.vocab_size + 31) // 32
        self._executor = llguidance.LLExecutor(max(1, threads))
        self._buffer = np.zeros((0, self.words), dtype=np.int32)

    def compute(self, matchers: Sequence[llguidance.LLMatcher]) -> np.ndarray:
        """Bool [len(matchers), vocab]: the tokens each matcher allows next. A matcher in an error
        state (it cannot happen when only allowed tokens are sampled) allows only EOS, so its
        request ends."""
        rows = len(matchers)
        if self._buffer.shape[0] < rows:
            self._buffer = np.zeros((rows, self.words), dtype=np.int32)
        bitmask = self._buffer[:rows]
        if rows == 1:
            llguidance_np.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            llguidance_np.fill_next_token_bitmask_par(
                self._executor, [(m, row) for row, m in enumerate(matchers)], bitmask
            )
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
        allowed = allowed[:, : self.compiler.vocab_size].view(np.bool_)
        for row, matcher in enumerate(matchers):
            if matcher.is_error() or not allowed[row].any():
                log.warning(
                    "a grammar matcher failed (%s); ending its request", matcher.get_error()
                )
                allowed[row] = False
                allowed[row, list(self.compiler.eos_token_ids)] = True
        return allowed


def consume(matcher: llguidance.LLMatcher, token_id: int) -> None:
    if not matcher.consume_token(token_id) and not matcher.is_stopped():
        log.warning("grammar matcher refused token %d: %s", token_id, matcher.get_error())


def _message(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip(" ^")]
    return " ".join(lines)[:500] if lines else "invalid grammar"
