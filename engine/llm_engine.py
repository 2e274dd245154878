"""The single-process engine: continuous batching over a paged KV cache, text in, text out.

    engine = LLMEngine(EngineConfig(model="default"))
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=8, temperature=0))
    while engine.has_unfinished():
        for output in engine.step(): ...

`step()` is the whole loop: schedule -> run the model -> sample -> update sequences -> collect
outputs. The disaggregated workers reuse its parts (scheduler, model runner, sampler) rather than
this class.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterator, Optional, Sequence as Seq, Union

import torch

from engine import kernels
from engine.block_manager import BlockAllocator
from engine.config import EngineConfig
from engine.cuda_graphs import decode_graphs_for
from engine.detokenizer import IncrementalDetokenizer
from engine.dtypes import resolve_device
from engine.guided import BatchMasks, GrammarCompiler, GrammarError, consume
from engine.kv_cache import KVLayout, PagedKVCache, auto_kv_cache_bytes
from engine.model_runner import ModelRunner
from engine.penalties import apply_penalties
from engine.sampling import SamplingParams, TokenLogprobs, logprobs_of, mask_rows, sample
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import FinishReason, Sequence
from engine.weights import LoadedModel, load_model


class RequestError(ValueError):
    """A request the engine cannot serve as given (the message names the problem)."""


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: Optional[str] = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    handed_off: bool = False  # prefill done, KV held for export (see `export_kv`)
    # One per new token when its params ask for logprobs, else None.
    logprobs: Optional[list[TokenLogprobs]] = None
    # With the first output token when its params ask for prompt logprobs: one per prompt token, the
    # first None (nothing comes before it).
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None


@dataclass
class CompletedRequest:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: Optional[str] = None


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: Optional[LoadedModel] = None):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        device = resolve_device(config.device)
        self.loaded = loaded or load_model(
            config.model, config.torch_dtype, device, deterministic=config.deterministic
        )
        if config.deterministic and not self.loaded.model.batch_invariant:
            raise ValueError("a deterministic engine needs a model loaded with deterministic=True")
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.layout = KVLayout.for_model(
            self.model_config, config.block_size_tokens, config.torch_dtype
        )
        kv_cache_bytes = (
            config.kv_cache_bytes
            if config.kv_cache_bytes is not None
            else auto_kv_cache_bytes(device)
        )
        num_blocks = PagedKVCache.num_blocks_for_bytes(self.layout, kv_cache_bytes)
        use_graphs = config.cuda_graphs and torch.device(device).type == "cuda"
        # With CUDA graphs, one block past the allocator's is the sink padding rows write to.
        self.kv_cache = PagedKVCache(self.layout, num_blocks + use_graphs, device)
        self.allocator = BlockAllocator(
            num_blocks, config.block_size_tokens, config.enable_prefix_caching
        )
        # The longest sequence (prompt + output) this engine serves: the model's context, unless its
        # KV cache holds fewer tokens (a sequence alone must always fit, or it would preempt itself
        # for ever).
        self.max_model_len = min(
            self.model_config.max_context_tokens, num_blocks * config.block_size_tokens
        )
        self.scheduler = Scheduler(config.scheduler(torch.device(device).type), self.allocator)
        self.runner = ModelRunner(self.loaded.model, self.kv_cache)
        if use_graphs:
            self.runner.graphs = decode_graphs_for(
                self.loaded.model,
                self.kv_cache,
                config.max_num_seqs,
                self.max_model_len,
                sink_block=num_blocks,
            )
        self.eos_token_ids = (
            frozenset(self.tokenizer.special.eos_token_ids) if self.tokenizer else frozenset()
        )
        self._seqs: dict[str, Sequence] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._held: dict[str, Sequence] = {}
        self._masks: Optional[BatchMasks] = None  # built with the first guided request
        self.last_step_was_prefill = False  # prefilled, KV kept until the handoff is released
        self.last_step_prompt_tokens = 0  # prompt tokens its latest step computed
        # sequences in its latest step (0: nothing could be scheduled, e.g. no KV room yet)
        self.last_step_num_seqs = 0

    # -- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Union[str, Seq[int]],
        params: SamplingParams,
        hand_off_after_prefill: bool = False,
        ttft_deadline_s: Optional[float] = None,
    ) -> None:
        """`ttft_deadline_s`: when its first token is due (`time.monotonic()`), which orders the
        waiting prompts (`Scheduler.prefill_order`); None: first come, first served."""
        if request_id in self._seqs or request_id in self._held:
            raise RequestError(f"request_id {request_id!r} is already in use")
        kernels.refresh()  # no request reaches a kernel that killed a worker of this node
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer; send prompt token ids")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = list(prompt)
        self.validate_prompt(prompt_ids)
        self.validate_params(params)
        seq = Sequence(
            request_id,
            prompt_ids,
            params.with_seed(),
            arrival_time_s=time.monotonic(),
            hand_off_after_prefill=hand_off_after_prefill,
            ttft_deadline_s=ttft_deadline_s,
            matcher=self._matcher(params, prompt_ids),
        )
        self._seqs[request_id] = seq
        if self._needs_text(params):
            self._detokenizers[request_id] = IncrementalDetokenizer(
                self.tokenizer, prompt_ids, params.stop
            )
        self.scheduler.add(seq)

    def _matcher(self, params: SamplingParams, prompt_ids: list[int], *sampled: int):
        """A guided request's grammar matcher, advanced over its output so far: the tokens of a
        re-prefilled prompt past the request's own (a migrated request's) and any `sampled` here."""
        if params.guided is None:
            return None
        if self.tokenizer is None:
            raise RequestError("guided decoding needs the model's tokenizer; this model has none")
        if self._masks is None:
            compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
            self._masks = BatchMasks(compiler, torch.get_num_threads())
        try:
            return self._masks.compiler.matcher(
                params.guided, params.guided.output_so_far(prompt_ids) + list(sampled)
            )
        except GrammarError as error:
            raise RequestError(f"guided: {error}") from error

    def _needs_text(self, params: SamplingParams) -> bool:
        return self.tokenizer is not None and (self.config.detokenize or bool(params.stop))

    def validate_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise RequestError("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"prompt has {len(prompt_ids)} tokens; this engine serves {self.max_model_len} "
                f"tokens of context (the model's {self.model_config.max_context_tokens}, its KV "
                f"cache's {self.allocator.num_blocks * self.config.block_size_tokens}): prompt "
                "plus at least one output token"
            )

    def validate_params(self, params: SamplingParams) -> None:
        """The token ids its params name (the penalties' masks index the vocabulary by them)."""
        vocab = self.model_config.vocab_size
        ids = [*params.stop_token_ids, *(token_id for token_id, _ in params.logit_bias)]
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} in the sampling params is outside [0, {vocab})")

    def abort(self, request_id: str) -> bool:
        """Stops a request wherever it is (queued, running or held for handoff) and frees its
        blocks."""
        if self.release_kv(request_id):
            return True
        seq = self._seqs.pop(request_id, None)
        self._detokenizers.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, FinishReason.ABORT)
        return True

    # -- KV handoff, prefill side: the blocks stay ours until the receiver is done with them ------

    def export_kv(self, request_id: str, layers: slice = slice(None)) -> torch.Tensor:
        """The prompt's KV of a handed-off request, `[layers, 2, blocks, block, kv_heads,
        head_dim]`."""
        seq = self._held[request_id]
        return self.kv_cache.export_blocks(
            seq.block_ids[: self.allocator.blocks_needed(seq.num_prompt_tokens)], layers
        )

    def release_kv(self, request_id: str) -> bool:
        """Frees a handed-off request's blocks (the receiver acknowledged, or its lease expired)."""
        seq = self._held.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq, FinishReason.ABORT)
        return seq is not None

    def detach_kv(self, request_id: str) -> list[int]:
        """Hands a held request's prompt blocks (and their references) over to the caller, e.g. a
        `kvtransfer` sender, which must free them through `allocator` when it is done."""
        seq = self._held.pop(request_id)
        return seq.block_ids[: self.allocator.blocks_needed(seq.num_prompt_tokens)]

    @property
    def held_request_ids(self) -> list[str]:
        return list(self._held)

    # -- KV handoff, decode side ---------------------------------------------------------------

    def start_decode(
        self,
        request_id: str,
        prompt_ids: Seq[int],
        first_token_id: int,
        params: SamplingParams,
        block_ids: list[int],
    ) -> None:
        """Admits a request whose prompt KV sits in `block_ids` (whose references pass to the
        engine) and whose first token was sampled elsewhere; it joins the running batch at the next
        step."""
        if request_id in self._seqs:
            raise RequestError(f"request_id {request_id!r} is already in use")
        kernels.refresh()
        if len(block_ids) < self.allocator.blocks_needed(len(prompt_ids)):
            raise RequestError(
                f"{len(block_ids)} KV blocks cannot hold a prompt of {len(prompt_ids)} tokens"
            )
        self.validate_params(params)
        seq = Sequence(
            request_id,
            list(prompt_ids),
            params,
            output_token_ids=[first_token_id],
            block_ids=list(block_ids),
            num_computed_tokens=len(prompt_ids),
            arrival_time_s=time.monotonic(),
            matcher=self._matcher(params, list(prompt_ids), first_token_id),
        )
        self._seqs[request_id] = seq
        # later prompts find it
        self.allocator.register_computed(seq.prompt_token_ids, seq.block_ids, len(prompt_ids))
        if self._needs_text(params):
            detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params.stop)
            detok.add_token(first_token_id)  # its text was streamed by the prefill side
            self._detokenizers[request_id] = detok
        self.scheduler.add_running(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop ------------------------------------------------------------------------------

    def step(
        self,
        compute: Callable[[ScheduledBatch], ContextManager] = lambda batch: (
            contextlib.nullcontext()
        ),
    ) -> list[RequestOutput]:
        """One scheduled batch. `compute(batch)` wraps its forward pass and sampling, and may give a
        callable the model runs between layers (serving workers size their threads there:
        runtime/cores.py)."""
        batch = self.scheduler.schedule()
        self.last_step_num_seqs = 0 if batch is None else len(batch.seqs)
        if batch is None:
            return []
        self.last_step_was_prefill = batch.is_prefill
        self.last_step_prompt_tokens = sum(batch.num_new_tokens) if batch.is_prefill else 0
        model = self.loaded.model
        with compute(batch) as between_layers:
            model.between_layers = between_layers
            try:
                if batch.is_prefill:
                    every_position = [seq.wants_prompt_logprobs for seq in batch.seqs]
                    if any(every_position):
                        logits = self.runner.prefill(
                            batch.seqs, batch.num_new_tokens, every_position
                        )
                        logits = self._score_prompts(batch, logits, every_position)
                    else:
                        logits = self.runner.prefill(batch.seqs, batch.num_new_tokens)
                    sampled_seqs = self.scheduler.after_prefill(batch)
                else:
                    logits = self.runner.decode(batch.seqs)
                    self.scheduler.after_decode(batch)
                    sampled_seqs = batch.seqs
            finally:
                model.between_layers = None
            guided = [row for row, seq in enumerate(sampled_seqs) if seq.matcher is not None]
            if guided:
                matchers = [sampled_seqs[row].matcher for row in guided]
                logits = mask_rows(logits, guided, self._masks.compute(matchers))
            if any(seq.params.processes_logits for seq in sampled_seqs):
                logits = apply_penalties(logits, sampled_seqs, self.eos_token_ids)
            tokens = sample(
                logits, [s.params for s in sampled_seqs], [s.num_tokens for s in sampled_seqs]
            )
            for row in guided:
                consume(sampled_seqs[row].matcher, tokens[row])
            logprobs = _sampled_logprobs(logits, sampled_seqs, tokens)
        return [
            self._append_token(seq, token, batch, token_logprobs)
            for seq, token, token_logprobs in zip(sampled_seqs, tokens, logprobs)
        ]

    def _score_prompts(
        self, batch: ScheduledBatch, logits: torch.Tensor, every_position: list[bool]
    ) -> torch.Tensor:
        """A prefill whose `every_position` sequences got logits at every position of their chunk:
        their prompt tokens' logprobs are taken here (the logits at position p score token p + 1);
        returns the rows to sample from, one per sequence whose prompt this chunk completes. Before
        `after_prefill`."""
        sample_rows, row = [], 0
        for seq, chunk, every in zip(batch.seqs, batch.num_new_tokens, every_position):
            begin, end = seq.num_computed_tokens, seq.num_computed_tokens + chunk
            if every:
                # positions whose next token is a prompt token
                scored = min(end, seq.num_prompt_tokens - 1) - begin
                if scored > 0:
                    seq.prompt_logprobs += logprobs_of(
                        logits[row : row + scored],
                        seq.prompt_token_ids[begin + 1 : end + 1][:scored],
                        [seq.params.prompt_logprobs] * scored,
                    )
                row += chunk
                if end == seq.num_tokens:
                    sample_rows.append(row - 1)
            elif end == seq.num_tokens:
                sample_rows.append(row)
                row += 1
        return logits[sample_rows]

    def _append_token(
        self,
        seq: Sequence,
        token: int,
        batch: ScheduledBatch,
        token_logprobs: Optional[TokenLogprobs] = None,
    ) -> RequestOutput:
        seq.output_token_ids.append(token)
        reason = self.finish_reason(seq, token)
        detok = self._detokenizers.get(seq.request_id)
        text = ""
        if detok is not None and not (
            reason is FinishReason.STOP and self._is_stop_token(seq, token)
        ):
            text = detok.add_token(token)
            if detok.stop_string is not None:
                reason = FinishReason.STOP
        output = RequestOutput(
            seq.request_id,
            [token],
            text,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=len(seq.output_token_ids),
            num_cached_prompt_tokens=seq.num_cached_prompt_tokens,
            logprobs=None if token_logprobs is None else [token_logprobs],
        )
        if seq.params.prompt_logprobs is not None and len(seq.output_token_ids) == 1:
            output.prompt_logprobs, seq.prompt_logprobs = [None, *seq.prompt_logprobs], []
        if reason is None and batch.is_prefill:
            if seq.hand_off_after_prefill:
                self._held[seq.request_id] = self._seqs.pop(seq.request_id)
                self._detokenizers.pop(seq.request_id, None)
                output.handed_off = True
            else:
                self.scheduler.add_running(seq)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            output.finished, output.finish_reason = True, reason.value
            if detok is not None:
                output.new_text += detok.flush()
            del self._seqs[seq.request_id]
            self._detokenizers.pop(seq.request_id, None)
        return output

    def _is_stop_token(self, seq: Sequence, token: int) -> bool:
        return token in seq.params.stop_token_ids or (
            token in self.eos_token_ids and not seq.params.ignore_eos
        )

    def finish_reason(self, seq: Sequence, token: int) -> Optional[FinishReason]:
        if self._is_stop_token(seq, token):
            return FinishReason.STOP
        if (
            len(seq.output_token_ids) >= seq.params.max_tokens
            or seq.num_tokens >= self.max_model_len
        ):
            return FinishReason.LENGTH
        return None

    # -- conveniences --------------------------------------------------------------------------

    def generate(
        self, prompts: Seq[Union[str, Seq[int]]], params: SamplingParams
    ) -> list[CompletedRequest]:
        """Runs the prompts as one continuous batch to completion."""
        results: dict[str, CompletedRequest] = {}
        for index, prompt in enumerate(prompts):
            request_id = f"generate-{index}-{os.urandom(4).hex()}"
            self.add_request(request_id, prompt, params)
            results[request_id] = CompletedRequest(
                request_id, self._seqs[request_id].prompt_token_ids
            )
        for output in self.run_until_done():
            done = results[output.request_id]
            done.token_ids += output.new_token_ids
            done.text += output.new_text
            done.finish_reason = output.finish_reason
        return list(results.values())

    def run_until_done(self) -> Iterator[RequestOutput]:
        while self.has_unfinished():
            yield from self.step()


def _sampled_logprobs(
    logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]
) -> list[Optional[TokenLogprobs]]:
    """The sampled tokens' logprobs, computed only for the rows whose params ask for them."""
    rows = [row for row, seq in enumerate(seqs) if seq.params.logprobs is not None]
    if not rows:
        return [None] * len(seqs)
    picked = logits if len(rows) == len(seqs) else logits[rows]
    values = logprobs_of(
        picked, [tokens[row] for row in rows], [seqs[row].params.logprobs for row in rows]
    )
    result: list[Optional[TokenLogprobs]] = [None] * len(seqs)
    for row, value in zip(rows, values):
        result[row] = value
    return result
