"""`n > 1` and `best_of` (issue #33) through a real 1P+1D system with the official `openai` client:
each choice is reproducible alone with its derived seed (`seed + i`), the prompt's KV is prefilled
once and its full blocks reused by choices 1.. on choice 0's decode worker, one of two (the router's
prefix-hit counters show it),
usage counts the prompt once and the choices' tokens summed, streamed choices carry their index,
best_of keeps the choices of the highest cumulative logprob, and bad values are 400s naming the
parameter.

Everything runs in fp32 (the harness pins it), so seeded and greedy answers are token-identical
across batch shapes."""

from __future__ import annotations

import collections
import dataclasses

import openai
import pytest

from router.choices import MAX_CHOICES

# long enough for several full 16-token blocks, and a partial one
PROMPT = (
    "A list of the ten most visited museums of Europe, with the city each is in and the year it "
    "opened to the public, written as a numbered list:"
)


@pytest.fixture(scope="module")
def system(harness):
    # Two decode workers: without the pin, prefix routing would weigh choice 0's running stream
    # against the prompt it holds and send choices 1.. to the idle worker, which holds nothing.
    running = harness.start(transport="ray", num_prefill=1, num_decode=2, http_port=0)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(system):
    return system.openai_client()


def _complete(system, client, prompt: str = PROMPT, **extra):
    return client.completions.create(
        model=system.config.model_name, prompt=prompt, **{"max_tokens": 8, **extra}
    )


def _long_stream(system, client, **extra):
    """Three streamed choices of 400 tokens each: long enough to be stopped while all three run."""
    return _complete(
        system,
        client,
        n=3,
        temperature=1.0,
        max_tokens=400,
        stream=True,
        extra_body={"ignore_eos": True},
        **extra,
    )


def _assert_nothing_held(system) -> None:
    """Nothing in flight and every worker's KV blocks free again."""
    settled = system.wait_idle()
    assert settled.requests_in_flight == 0
    assert all(w.kv_blocks_free == w.kv_blocks_total for w in settled.workers)


def _prefix_hits(system) -> dict[str, float]:
    """The router's prefix-hit tokens by pool, and the KV bytes the decode pool did not receive."""
    from prometheus_client.parser import text_string_to_metric_families

    text = system.system.router.render_metrics().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pdserve_prefix_cache_hit_tokens_total":
                values[sample.labels["pool"]] = sample.value
            elif sample.name == "pdserve_kv_reused_bytes_total":
                values["bytes"] = sample.value
    return values


@pytest.mark.timeout(120)
def test_n4_seeded_choices_are_each_reproducible_alone_and_share_the_prompts_kv(system, client):
    prompt = "Seeded choices. " + PROMPT  # a prompt no other test sent: choice 0 finds no cache
    num_prompt_tokens = len(system.system.router.tokenizer.encode(prompt))
    full_blocks_tokens = (num_prompt_tokens // 16) * 16
    assert full_blocks_tokens >= 32
    before = _prefix_hits(system)
    answer = _complete(system, client, prompt, n=4, temperature=0.8, seed=11)
    after = _prefix_hits(system)
    assert [choice.index for choice in answer.choices] == [0, 1, 2, 3]
    # choices 1..3 found the prompt's full blocks on both workers: computed once, held once
    for pool in ("prefill", "decode"):
        assert after.get(pool, 0) - before.get(pool, 0) >= 3 * full_blocks_tokens, (pool, after)
    assert after["bytes"] > before.get("bytes", 0)
    singles = [
        _complete(system, client, prompt, temperature=0.8, seed=11 + index) for index in range(4)
    ]
    assert [c.text for c in answer.choices] == [s.choices[0].text for s in singles]
    assert [c.finish_reason for c in answer.choices] == [
        s.choices[0].finish_reason for s in singles
    ]
    assert len({c.text for c in answer.choices}) > 1  # the derived seeds do sample
    assert answer.usage.prompt_tokens == num_prompt_tokens
    assert answer.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert answer.usage.total_tokens == num_prompt_tokens + answer.usage.completion_tokens
    assert system.wait_idle().requests_in_flight == 0  # every choice's KV freed


@pytest.mark.timeout(120)
def test_streamed_n2_carries_both_indices_and_the_texts_of_the_whole_answer(system, client):
    whole = client.chat.completions.create(
        model=system.config.model_name,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=8,
        temperature=1.0,
        seed=5,
        n=2,
    )
    chunks = list(
        client.chat.completions.create(
            model=system.config.model_name,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=8,
            temperature=1.0,
            seed=5,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts, reasons = ["", ""], [None, None]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert texts == [c.message.content for c in whole.choices]
    assert reasons == [c.finish_reason for c in whole.choices]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.timeout(120)
def test_greedy_n3_gives_three_copies_of_the_engines_greedy_answer(system, client, smollm_fp32):
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.sampling_params import SamplingParams

    answer = _complete(
        system, client, n=3, temperature=0, max_tokens=10, extra_body={"ignore_eos": True}
    )
    engine = LLMEngine(EngineConfig(kv_cache_bytes=32 << 20), loaded=smollm_fp32)
    greedy = engine.generate(
        [engine.tokenizer.encode(PROMPT)],
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
    )[0]
    assert [c.text for c in answer.choices] == [greedy.text] * 3
    assert answer.usage.completion_tokens == 30


@pytest.mark.timeout(120)
def test_best_of_returns_the_choices_of_the_highest_cumulative_logprob(system, client):
    answer = _complete(system, client, n=2, best_of=4, temperature=1.0, seed=21)
    assert [c.index for c in answer.choices] == [0, 1]
    assert all(c.logprobs is None for c in answer.choices)  # not asked: sampled, not returned
    singles = [
        _complete(system, client, temperature=1.0, seed=21 + index, logprobs=0).choices[0]
        for index in range(4)
    ]
    ranked = sorted(singles, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    assert [c.text for c in answer.choices] == [c.text for c in ranked[:2]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "extra, param",
    [
        ({"n": 0}, "n"),
        ({"n": MAX_CHOICES + 1}, "n"),
        ({"n": 2.5}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"best_of": MAX_CHOICES + 1}, "best_of"),
        ({"n": 2, "best_of": 3, "stream": True}, "best_of"),
    ],
)
def test_bad_n_and_best_of_are_400s_naming_the_parameter(system, client, extra, param):
    with pytest.raises(openai.BadRequestError) as raised:
        _complete(system, client, **extra)
    assert raised.value.status_code == 400
    assert raised.value.body["param"] == param, raised.value.body


@pytest.mark.timeout(120)
def test_a_client_that_goes_away_aborts_every_choice(system, client):
    stream = _long_stream(system, client)
    seen = set()
    for chunk in stream:
        seen.add(chunk.choices[0].index)
        if len(seen) == 3:  # all three choices are running
            break
    stream.close()
    _assert_nothing_held(system)


def test_an_abort_by_request_id_ends_every_choice(system, client):
    stream = _long_stream(system, client, extra_headers={"X-Request-Id": "abort-every-choice"})
    chunks, finished, aborted = collections.Counter(), set(), False
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        chunks[choice.index] += 1
        if choice.finish_reason is not None:
            finished.add(choice.index)
        if len(chunks) == 3 and not aborted:  # all three choices are running: abort by the id
            with system.client() as grpc_client:
                assert grpc_client.abort("abort-every-choice")
            aborted = True
    # every choice ended, long before its 400 tokens
    assert finished == {0, 1, 2} and max(chunks.values()) < 200, chunks
    _assert_nothing_held(system)


@pytest.mark.timeout(120)
def test_a_choice_that_fails_fails_the_whole_response_and_frees_every_choice(system, client):
    router = system.system.router
    original = router.config
    # room for two requests in flight: choice 2 of 3 is refused as overloaded
    limits = dataclasses.replace(original.limits, max_in_flight=2)
    router.config = dataclasses.replace(original, limits=limits)
    try:
        with pytest.raises(openai.RateLimitError) as raised:
            _complete(system, client, n=3, temperature=1.0, max_tokens=50)
        assert "--max-in-flight" in raised.value.body["message"]
    finally:
        router.config = original
    _assert_nothing_held(system)
