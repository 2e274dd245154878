"""The whole system on a local Ray cluster (loopback only): router, prefill and decode actors, KV
transfer over both transports, token streaming, continuous batching, cancellation, bad input."""

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three rivers in Europe.",
]


@pytest.fixture(scope="module")
def expected(smollm_fp32, hf_smollm_fp32):
    """Greedy 32-token answers from the single-process engine, checked against HF transformers."""
    engine = LLMEngine(EngineConfig(kv_cache_bytes=32 << 20), loaded=smollm_fp32)
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    results = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0))
    for prompt, result in zip(prompts[:2], results):
        with torch.no_grad():
            reference = hf_smollm_fp32.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=2,
                pad_token_id=2,
            )
        hf_tokens = reference[0, len(prompt) :].tolist()
        assert result.token_ids == hf_tokens[: len(result.token_ids)] and len(hf_tokens) == len(
            result.token_ids
        )
    return {q: r for q, r in zip(QUESTIONS, results)}


@pytest.fixture(scope="module", params=["ray", "grpc"])
def disaggregated(request, harness):
    system = harness.start(transport=request.param)
    yield system
    system.stop()


def _chat_all(system, questions, **sampling):
    with ThreadPoolExecutor(len(questions)) as pool:
        return list(pool.map(lambda q: system.client().chat(q, **sampling), questions))


def test_greedy_outputs_equal_the_engine_and_hf(disaggregated, expected):
    completions = _chat_all(disaggregated, QUESTIONS, max_tokens=32, temperature=0)
    for question, completion in zip(QUESTIONS, completions):
        assert completion.token_ids == expected[question].token_ids
        assert completion.text == expected[question].text
        assert completion.finish_reason == expected[question].finish_reason
        assert completion.prefill_worker == "prefill-0" and completion.decode_worker == "decode-0"
        assert completion.usage.completion_tokens == len(completion.token_ids)
        assert completion.timings.kv_bytes > 0
    stats = disaggregated.wait_idle()
    assert all(w.kv_blocks_free == w.kv_blocks_total for w in stats.workers)


def test_streaming_is_real_and_ttft_is_what_the_client_saw(disaggregated):
    with disaggregated.client() as client:
        done = client.generate(
            client.request(
                "Tell me a long story about a dragon.",
                max_tokens=48,
                temperature=0,
                ignore_eos=True,
            )
        )
    finished_at = time.monotonic()
    client_ttft_s = done.first_token_at_s - done.sent_at_s
    assert done.usage.completion_tokens == 48
    # The first token reached us well before the decode of this request was over.
    assert finished_at - done.first_token_at_s > 20 * done.timings.tpot_s > 0
    assert abs(done.timings.ttft_s - client_ttft_s) < 0.05 + 0.2 * client_ttft_s


def test_tokens_queued_behind_a_stalled_router_leave_in_one_message_unchanged(
    disaggregated, harness, expected
):
    question = QUESTIONS[1]  # 32 tokens: most of them come out while the router stalls
    responses = []
    with disaggregated.client() as client:
        for response in client.stream(
            client.request(
                messages=[{"role": "user", "content": question}], max_tokens=32, temperature=0
            )
        ):
            responses.append(response)
            # decoding: the router's loop stalls while the decode worker goes on
            if len(responses) == 2:
                harness.loop.call_soon_threadsafe(time.sleep, 1.5)
    assert [t for r in responses for t in r.token_ids] == expected[question].token_ids
    assert "".join(r.text for r in responses) == expected[question].text
    # the backlog left together, not one message per step
    assert max(len(r.token_ids) for r in responses) > 4


def test_continuous_batching_admits_requests_into_a_running_batch(disaggregated):
    with ThreadPoolExecutor(17) as pool:
        long_run = pool.submit(
            lambda: disaggregated.client().generate(
                disaggregated.client().request(
                    "Count slowly.", max_tokens=160, temperature=0, ignore_eos=True
                )
            )
        )
        time.sleep(1.5)  # the long request is decoding by now
        assert not long_run.done()
        short_runs = [
            pool.submit(
                lambda i=i: disaggregated.client().generate(
                    disaggregated.client().request(
                        f"Say a word about {i}.", max_tokens=8, temperature=0, ignore_eos=True
                    )
                )
            )
            for i in range(16)
        ]
        shorts = [f.result() for f in short_runs]
        assert not long_run.done()  # every short request finished while the long one still ran
        assert long_run.result().usage.completion_tokens == 160
    assert all(s.usage.completion_tokens == 8 for s in shorts)
    decode_stats = next(w for w in disaggregated.wait_idle().workers if w.role == "decode")
    assert decode_stats.max_batch_size_seen >= 4


def test_client_cancel_frees_every_block(disaggregated):
    with disaggregated.client() as client:
        call = client.stream(
            client.request(
                "Write an essay about bridges.", max_tokens=400, temperature=0, ignore_eos=True
            )
        )
        for index, _ in enumerate(call):
            if index == 3:
                break
        call.cancel()
    stats = disaggregated.wait_idle(timeout_s=20)
    assert stats.requests_in_flight == 0
    assert all(w.kv_blocks_free == w.kv_blocks_total for w in stats.workers)
    busy = [w for w in stats.workers if w.running_requests or w.waiting_requests]
    assert not busy


BAD_REQUESTS = [
    (dict(prompt=""), "prompt.text"),
    (dict(), "prompt"),
    (dict(prompt="x" * (2 << 20)), "prompt.text"),
    # and the server's, what a worker's KV cache holds
    (dict(prompt="hello " * 9000), "the model's is 8192"),
    (dict(prompt="hi", max_tokens=0), "sampling.max_tokens"),
    (dict(prompt="hi", temperature=-0.5), "sampling.temperature"),
    (dict(prompt="hi", top_p=0.0), "sampling.top_p"),
    (dict(prompt="hi", top_p=1.5), "sampling.top_p"),
    (dict(token_ids=[1, 2, 10**6]), "prompt.token_ids"),
    (dict(messages=[{"role": "robot", "content": "hi"}]), "role"),
    (dict(prompt="hi", stop=[""]), "sampling.stop"),
]


def test_bad_requests_are_invalid_argument_naming_the_field(disaggregated, expected):
    with disaggregated.client() as client:
        for fields, needle in BAD_REQUESTS:
            fields = dict(fields)
            request = client.request(
                fields.pop("prompt", None),
                messages=fields.pop("messages", None),
                token_ids=fields.pop("token_ids", None),
                **fields,
            )
            with pytest.raises(grpc.RpcError) as failure:
                client.generate(request)
            assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
            assert needle in failure.value.details()
        unknown = client.request("hi")
        # field 101
        unknown.MergeFromString(unknown.SerializeToString() + bytes([0xA8, 0x06, 0x01]))
        with pytest.raises(grpc.RpcError) as failure:
            client.generate(unknown)
        assert (
            failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            and "unknown field" in failure.value.details()
        )
        good = client.chat(QUESTIONS[0], max_tokens=32, temperature=0)
        assert good.token_ids == expected[QUESTIONS[0]].token_ids


def test_two_by_two_spreads_load_and_completes_32_streams(harness, expected):
    system = harness.start(transport="ray", num_prefill=2, num_decode=2)
    try:
        questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(32)]
        completions = _chat_all(system, questions, max_tokens=12, temperature=0)
        for question, completion in zip(questions, completions):
            assert completion.token_ids == expected[question].token_ids[:12]
        stats = system.wait_idle()
        assert {w.worker_id for w in stats.workers} == {
            "prefill-0",
            "prefill-1",
            "decode-0",
            "decode-1",
        }
        assert all(w.requests_served > 0 for w in stats.workers)
        assert sum(w.requests_served for w in stats.workers if w.role == "decode") == 32
        assert all(w.kv_blocks_free == w.kv_blocks_total for w in stats.workers)
    finally:
        system.stop()


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_stream_interval_sends_decode_tokens_in_groups_and_changes_nothing_else(
    harness, expected, mode
):
    system = harness.start(mode=mode, stream_interval=4)
    try:
        question = QUESTIONS[1]  # 32 tokens, no stop strings
        with system.client() as client:
            responses = list(
                client.stream(
                    client.request(
                        messages=[{"role": "user", "content": question}],
                        max_tokens=32,
                        temperature=0,
                    )
                )
            )
        sizes = [len(r.token_ids) for r in responses]
        # Not held back: the first token (colocated); the prefill's token and the first decode
        # chunk, which acknowledges the KV (disaggregated).
        held_from = 2 if mode == "disaggregated" else 1
        assert max(sizes[:held_from]) < 4, sizes
        assert all(size >= 4 for size in sizes[held_from:-1]) and sum(sizes) == 32, sizes
        assert [t for r in responses for t in r.token_ids] == expected[question].token_ids
        assert "".join(r.text for r in responses) == expected[question].text
        assert responses[-1].usage.completion_tokens == 32
        assert all(w.kv_blocks_free == w.kv_blocks_total for w in system.wait_idle().workers)
    finally:
        system.stop()


def test_colocated_mode_gives_the_same_answers(harness, expected):
    system = harness.start(mode="colocated", num_decode=1)
    try:
        completions = _chat_all(system, QUESTIONS, max_tokens=32, temperature=0)
        for question, completion in zip(QUESTIONS, completions):
            assert completion.token_ids == expected[question].token_ids
            assert completion.decode_worker == "colocated-0" and completion.prefill_worker == ""
        stats = system.wait_idle()
        assert [w.role for w in stats.workers] == ["colocated"]
    finally:
        system.stop()


def test_the_only_decode_worker_dying_mid_stream_fails_the_request_at_once(harness):
    import ray

    system = harness.start(transport="ray")
    try:
        with system.client(timeout_s=60) as client:
            call = client.stream(
                client.request(
                    "Write an essay about rivers.", max_tokens=400, temperature=0, ignore_eos=True
                )
            )
            received = 0
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as failure:
                for _ in call:
                    received += 1
                    if received == 3:
                        ray.kill(system.system.router.decode_pool.workers[0].actor)
            assert (
                failure.value.code() == grpc.StatusCode.UNAVAILABLE
                and "no healthy decode worker" in failure.value.details()
            )
            assert time.monotonic() - started < 30
        stats = system.stats()
        assert "decode-0" not in [w.worker_id for w in stats.workers if w.state == "ready"]
        prefill = next(w for w in stats.workers if w.role == "prefill")
        # the prefill side frees its blocks by abort (or lease) too
        deadline = time.monotonic() + 40
        while prefill.kv_blocks_free != prefill.kv_blocks_total and time.monotonic() < deadline:
            time.sleep(0.5)
            prefill = next(w for w in system.stats().workers if w.role == "prefill")
        assert prefill.kv_blocks_free == prefill.kv_blocks_total
    finally:
        system.stop()


def test_a_decode_workers_token_stream_refuses_a_subscriber_without_its_secret(disaggregated):
    import ray

    from protocol.token_stream import OUTPUT_STREAM_METHOD

    address, _ = ray.get(
        disaggregated.system.router.decode_pool.workers[0].actor.output_address.remote()
    )
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream(OUTPUT_STREAM_METHOD)(
            b"", metadata=(("authorization", "a guess"),), timeout=10
        )
        with pytest.raises(grpc.RpcError) as failure:
            next(iter(call))
    assert failure.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with disaggregated.client() as client:  # the router's own subscription goes on
        answer = client.generate(
            client.request("Say hi.", max_tokens=4, temperature=0, ignore_eos=True)
        )
    assert answer.usage.completion_tokens == 4


@pytest.mark.parametrize(
    "transport,wire", [("grpc", "lossless"), ("ray", "int8")], ids=["grpc-lossless", "ray-int8"]
)
def test_kv_on_the_wire_compressed(harness, expected, transport, wire):
    """`--kv-wire lossless` gives the engine's greedy fp32 answers; a lossy mode (allowed) changes
    no prompt's first token, which the prefill worker samples before any KV moves, and finishes
    every answer. Both count in /metrics, with fewer bytes on the wire than the KV's own."""
    system = harness.start(transport=transport, kv_wire=wire, kv_wire_lossy=wire != "lossless")
    try:
        completions = _chat_all(system, QUESTIONS, max_tokens=32, temperature=0)
        for question, completion in zip(QUESTIONS, completions):
            want = expected[question].token_ids
            if wire == "lossless":
                assert completion.token_ids == want
            else:
                assert completion.token_ids[0] == want[0]
                assert len(completion.token_ids) == len(want) or completion.finish_reason == "stop"
        metrics = system.system.router._metrics.registry
        assert metrics.get_sample_value(
            "pdserve_kv_wire_total", {"mode": wire, "reason": "asked"}
        ) == len(QUESTIONS)
        raw = metrics.get_sample_value("pdserve_kv_wire_bytes_total", {"kind": "raw"})
        sent = metrics.get_sample_value("pdserve_kv_wire_bytes_total", {"kind": "wire"})
        assert 0 < sent < (0.95 if wire == "lossless" else 0.3) * raw
        stats = system.wait_idle()
        assert all(w.kv_blocks_free == w.kv_blocks_total for w in stats.workers)
    finally:
        system.stop()
