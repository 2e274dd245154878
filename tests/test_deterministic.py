"""`--deterministic` (engine/deterministic.py): a row's result depends neither on the batch it
shares nor on whether its token was computed in a prefill or a decode step. Greedy tokens and the
logits' bits are compared: a prompt alone and batched with three others, prefilled whole and in
chunks, and a continuation decoded against the same tokens prefilled as a prompt. Then a served
system in bf16: a decode worker SIGKILLed mid-stream, a lone rerun, and prefill on the decode
worker (--pd-policy local) against the prefill worker (remote) all give the unfaulted streams."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import pytest
import torch

from engine.deterministic import DeterminismUnavailable, require
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams
from engine.weights import load_model
from router.pd_policy import PDPolicyConfig

TEXTS = [
    "Tell me a very short story about a cat who learns to fly.",
    "Hi",
    "Why is the sky blue? Answer in two sentences.",
    "Count from one to ten in French, then in German, then in Spanish.",
]
MAX_TOKENS = 64
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def _available(dtype: torch.dtype) -> None:
    """Skips, saying why, where this CPU has no batch-invariant kernels for `dtype`."""
    try:
        require(dtype, "cpu")
    except DeterminismUnavailable as error:
        pytest.skip(f"not run on this CPU: {error}")


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def alone(request):
    """The default model loaded deterministic in one dtype, the prompts, and the first prompt's
    greedy run alone: (engine factory, prompts, (tokens, logits rows))."""
    dtype = getattr(torch, request.param)
    _available(dtype)
    loaded = load_model("default", dtype, deterministic=True)
    prompts = [loaded.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in TEXTS]

    def engine(**config) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                dtype=request.param, deterministic=True, kv_cache_bytes=64 << 20, **config
            ),
            loaded=loaded,
        )

    return engine, prompts, _run(engine(), [prompts[0]])[0]


def _run(engine: LLMEngine, prompts, params: SamplingParams = GREEDY):
    """Each prompt's greedy tokens and the fp32 logits row each was sampled from, in order."""
    logits: dict[str, list[torch.Tensor]] = {}

    def recording(method, wants_row):
        def run(seqs, *args, **kwargs):
            out = method(seqs, *args, **kwargs)
            ids = [seq.request_id for i, seq in enumerate(seqs) if wants_row(i, seq, args)]
            for request_id, row in zip(ids, out, strict=True):
                logits.setdefault(request_id, []).append(row.clone())
            return out

        return run

    runner = engine.runner
    runner.prefill = recording(
        runner.prefill, lambda i, seq, args: seq.num_computed_tokens + args[0][i] == seq.num_tokens
    )
    runner.decode = recording(runner.decode, lambda i, seq, args: True)
    results = engine.generate(prompts, params)
    return [(r.token_ids, logits[r.request_id]) for r in results]


def _assert_identical(got, expected) -> None:
    (tokens, rows), (want_tokens, want_rows) = got, expected
    assert tokens == want_tokens
    assert len(rows) == len(want_rows) == len(tokens)
    for step, (row, want) in enumerate(zip(rows, want_rows)):
        assert torch.equal(row, want), f"logits differ at token {step}"


def test_a_prompt_batched_with_three_others_matches_it_alone(alone):
    engine, prompts, expected = alone
    assert len(expected[0]) == MAX_TOKENS
    _assert_identical(_run(engine(), prompts)[0], expected)


def test_a_prompt_prefilled_in_chunks_matches_it_prefilled_whole(alone):
    engine, prompts, expected = alone
    assert len(prompts[0]) > 2 * 16
    # 16-token chunks, nothing reused from a prefix cache
    chunked = engine(max_num_batched_tokens=16, enable_prefix_caching=False)
    _assert_identical(_run(chunked, [prompts[0]])[0], expected)


def test_generated_tokens_prefilled_as_a_prompt_continue_as_decoding_did(alone):
    """What a migrated stream does: prompt + the tokens sent so far prefilled on another worker."""
    engine, prompts, (tokens, rows) = alone
    sent = MAX_TOKENS // 2
    params = SamplingParams(max_tokens=MAX_TOKENS - sent, temperature=0, ignore_eos=True)
    got = _run(engine(enable_prefix_caching=False), [prompts[0] + tokens[:sent]], params)[0]
    _assert_identical(got, (tokens[sent:], rows[sent:]))


def test_where_no_batch_invariant_kernel_runs_the_error_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    with pytest.raises(DeterminismUnavailable, match="AVX512_BF16"):
        load_model("dummy:tiny", torch.bfloat16, deterministic=True)
    with pytest.raises(DeterminismUnavailable, match="CPU only"):
        require(torch.float32, "cuda")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    with pytest.raises(DeterminismUnavailable, match="AVX2 and FMA"):
        require(torch.float32, "cpu")


def test_serving_passes_deterministic_to_every_worker():
    from pdserve.cli import _serve_config, build_parser

    args = build_parser().parse_args(["serve", "--deterministic"])
    assert _serve_config(args).engine_config().deterministic
    assert not _serve_config(build_parser().parse_args(["serve"])).engine_config().deterministic


# -- serving -------------------------------------------------------------------------------------

SERVED_TOKENS = 48


class _Stream:
    """One greedy request streamed on a thread of its own: its tokens, or its gRPC error."""

    def __init__(self, system, text: str, request_id: str):
        self.tokens: list[int] = []
        self.prefill_worker = None  # from the final message: "" where its decode worker prefilled
        self.error = None
        self._thread = threading.Thread(target=self._run, args=(system, text, request_id))
        self._thread.start()

    def _run(self, system, text: str, request_id: str) -> None:
        import grpc

        with system.client(timeout_s=120) as client:
            request = client.request(
                messages=[{"role": "user", "content": text}],
                request_id=request_id,
                max_tokens=SERVED_TOKENS,
                temperature=0,
                ignore_eos=True,
            )
            try:
                for response in client.stream(request):
                    self.tokens += response.token_ids
                    if response.finish_reason:
                        self.prefill_worker = response.prefill_worker
            except grpc.RpcError as error:
                self.error = error

    def result(self) -> list[int]:
        self._thread.join(150)
        assert not self._thread.is_alive(), "the request hung"
        assert self.error is None, self.error
        return self.tokens


def _streams(system, label: str, texts=TEXTS) -> list[_Stream]:
    return [_Stream(system, text, f"{label}-{i}") for i, text in enumerate(texts)]


def _sigkill_decode_worker_of(system, stream: _Stream, request_id: str) -> str:
    """SIGKILLs the process of the decode worker streaming `request_id` once it sent 5 tokens."""
    import ray

    deadline = time.monotonic() + 60
    while len(stream.tokens) < 5:
        assert time.monotonic() < deadline and stream._thread.is_alive(), "never reached decode"
        time.sleep(0.005)
    victim = system.system.router.route_of(request_id).decode
    pid = ray.get(victim.actor.__ray_call__.remote(lambda _: os.getpid()), timeout=30)
    os.kill(pid, signal.SIGKILL)
    return victim.worker_id


def test_served_bf16_streams_survive_a_sigkill_a_rerun_and_local_prefill_identically(harness):
    _available(torch.bfloat16)
    common = dict(dtype="bfloat16", deterministic=True, transport="grpc", num_prefill=1)
    remote = harness.start(pd_policy="remote", num_decode=2, **common)
    try:
        streams = _streams(remote, "reference")
        reference = [s.result() for s in streams]
        assert all(len(tokens) == SERVED_TOKENS for tokens in reference)
        assert all(s.prefill_worker for s in streams)  # prefilled on the prefill worker
        migrations_before = remote.system.router.stats().migrations
        faulted = _streams(remote, "faulted")
        _sigkill_decode_worker_of(remote, faulted[0], "faulted-0")
        assert [s.result() for s in faulted] == reference
        assert remote.system.router.stats().migrations > migrations_before
        assert _streams(remote, "lone", TEXTS[:1])[0].result() == reference[0]
        # the same system prefilling on its decode workers (the router's policy swapped between
        # requests): a local prefill gives the remote one's tokens
        router = remote.system.router
        router.config = dataclasses.replace(router.config, pd=PDPolicyConfig("local"))
        streams = _streams(remote, "local")
        assert [s.result() for s in streams] == reference
        assert not any(s.prefill_worker for s in streams)  # prefilled on the decode worker
    finally:
        remote.stop()
