"""Logprobs (issue #33): the engine's, and end to end through a real disaggregated system on both KV
transports, by gRPC and by the official `openai` client (completions and chat, streamed and not,
echo and prompt scoring), across a decode worker killed mid-stream; and the 400s of bad logprobs
arguments.

The reference values: the log-softmax (fp32) of the logits the single-process engine sampled each
token from, captured from its model runner; for prompt tokens, a direct fp32 forward pass of HF
transformers. Everything runs in fp32 (the harness pins it)."""

from __future__ import annotations

import threading
import time

import openai
import pytest
import torch

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams, TokenLogprobs

TOL = 1e-4
PROMPT = "The three largest cities of France are"
QUESTION = "Name three rivers in Europe."


def _capturing_engine(loaded, **config) -> tuple[LLMEngine, list[torch.Tensor]]:
    """A single-process engine whose model runner's logits (what each token is sampled from) are
    kept."""
    engine = LLMEngine(EngineConfig(kv_cache_bytes=32 << 20, **config), loaded=loaded)
    captured: list[torch.Tensor] = []
    for name in ("prefill", "decode"):
        original = getattr(engine.runner, name)

        def run(*args, _original=original, **kwargs):
            logits = _original(*args, **kwargs)
            captured.append(logits.clone())
            return logits

        setattr(engine.runner, name, run)
    return engine, captured


def _reference(loaded, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens of the single-process engine and, per token, the log-softmax it was sampled
    from."""
    engine, captured = _capturing_engine(loaded)
    result = engine.generate(
        [prompt_ids], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    )[0]
    rows = torch.log_softmax(torch.cat(captured), dim=-1)
    assert rows.shape[0] == len(result.token_ids)
    return result.token_ids, rows


def _hf_prompt_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """Row p: the log-softmax that scores token p + 1 (a direct fp32 forward pass of HF
    transformers)."""
    with torch.no_grad():
        logits = hf(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long)
        ).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def _assert_matches(value: TokenLogprobs, row: torch.Tensor, token_id: int, num_top: int) -> None:
    assert value.token_id == token_id
    assert abs(value.logprob - row[token_id].item()) < TOL
    assert len(value.top) == num_top
    ref_values, ref_ids = row.topk(num_top)
    for (got_id, got), ref, ref_id in zip(value.top, ref_values.tolist(), ref_ids.tolist()):
        assert abs(got - ref) < TOL
        # the token named has that logprob (ties may swap ids)
        assert abs(row[got_id].item() - got) < TOL
    assert [lp for _, lp in value.top] == sorted((lp for _, lp in value.top), reverse=True)


# -- the engine ------------------------------------------------------------------------------------


def test_engine_logprobs_are_the_log_softmax_of_the_logits_it_sampled_from(smollm_fp32):
    engine, captured = _capturing_engine(smollm_fp32)
    prompts = [engine.tokenizer.encode(p) for p in (PROMPT, "Once upon a time", "1, 2, 3,")]
    asks = [
        SamplingParams(max_tokens=6, temperature=0, logprobs=5),
        SamplingParams(max_tokens=6, temperature=0),
        SamplingParams(max_tokens=6, temperature=0.9, seed=7, logprobs=0),
    ]
    for index, (prompt, params) in enumerate(zip(prompts, asks)):
        engine.add_request(f"r{index}", prompt, params)
    rows_of = {f"r{i}": [] for i in range(3)}
    tokens_of = {f"r{i}": [] for i in range(3)}
    logprobs_of = {f"r{i}": [] for i in range(3)}
    while engine.has_unfinished():
        before = len(captured)
        outputs = engine.step()
        logits = captured[before]
        for row, output in enumerate(outputs):  # one logits row per sampled sequence, in order
            rows_of[output.request_id].append(torch.log_softmax(logits[row], dim=-1))
            tokens_of[output.request_id] += output.new_token_ids
            logprobs_of[output.request_id].append(output.logprobs)
    assert all(lp is None for lp in logprobs_of["r1"])  # not asked: not computed
    for request_id, num_top in (("r0", 5), ("r2", 0)):
        for row, token, value in zip(
            rows_of[request_id], tokens_of[request_id], logprobs_of[request_id]
        ):
            assert value is not None and len(value) == 1
            _assert_matches(value[0], row, token, num_top)
    # Asking for logprobs changes no token (the default path samples the same logits).
    plain = LLMEngine(EngineConfig(kv_cache_bytes=32 << 20), loaded=smollm_fp32)
    for request_id, prompt, params in zip(
        ("r0", "r2"), (prompts[0], prompts[2]), (asks[0], asks[2])
    ):
        again = plain.generate(
            [prompt], SamplingParams(max_tokens=6, temperature=params.temperature, seed=params.seed)
        )[0]
        assert again.token_ids == tokens_of[request_id]


@pytest.mark.slow
def test_engine_prompt_logprobs_equal_a_direct_forward_pass_chunked_and_past_the_prefix_cache(
    smollm_fp32, hf_smollm_fp32
):
    # Chunks of 5 tokens: the prompt's logprobs are assembled across prefill steps.
    engine = LLMEngine(
        EngineConfig(kv_cache_bytes=32 << 20, max_num_batched_tokens=5), loaded=smollm_fp32
    )
    prompt = engine.tokenizer.encode(PROMPT + " Paris, Marseille and Lyon. " * 3)
    reference = _hf_prompt_logprobs(hf_smollm_fp32, prompt)
    # the prompt's blocks are now cached
    engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0))
    for _ in range(2):  # the cached prefix must not skip the positions prompt logprobs need
        engine.add_request(
            "scored", prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
        )
        outputs = list(engine.run_until_done())
        scored = outputs[0].prompt_logprobs
        assert outputs[0].num_cached_prompt_tokens == 0 and outputs[1].prompt_logprobs is None
        assert len(scored) == len(prompt) and scored[0] is None
        for position, value in enumerate(scored[1:]):
            _assert_matches(value, reference[position], prompt[position + 1], 3)
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks


# -- the wire and the OpenAI shapes ----------------------------------------------------------------


def test_token_chunks_carry_logprobs_over_the_wire_and_when_joined():
    from protocol.token_stream import TokenChunk, decode_chunks, encode_chunks
    from router.output import typed_logprobs
    from router.token_stream import joined

    first = TokenChunk("r", (5,), logprobs=(TokenLogprobs(5, -0.5, ((5, -0.5), (9, -1.5))),))
    last = TokenChunk("r", (6,), "length", logprobs=(TokenLogprobs(6, -0.25),))
    (got_first, got_last), _, _ = decode_chunks(encode_chunks([first, last]))
    assert (got_first, got_last) == (first, last)
    both = joined(got_first, got_last)
    assert both.token_ids == (5, 6) and typed_logprobs(both.logprobs) == [
        *first.logprobs,
        *last.logprobs,
    ]
    assert joined(TokenChunk("r", (1,)), TokenChunk("r", (2,))).logprobs is None


def test_openai_shapes_as_vllm_writes_them():
    from router.openai_logprobs import TokenTexts, chat_logprobs, completion_logprobs

    class Letters:
        def decode(self, ids):
            return f"t{ids[0]}"

    texts = TokenTexts(Letters())
    # sampled, but not among the top 2
    sampled = TokenLogprobs(7, -3.0, ((1, -0.1), (2, -0.5), (7, -3.0)))
    assert completion_logprobs([(5, None), (7, sampled)], texts, 2, text_offset=10) == {
        "tokens": ["t5", "t7"],
        "token_logprobs": [None, -3.0],
        "top_logprobs": [None, {"t7": -3.0, "t1": -0.1, "t2": -0.5}],
        "text_offset": [10, 12],
    }
    assert completion_logprobs([(7, sampled)], texts, 0)["top_logprobs"] == [{"t7": -3.0}]
    assert chat_logprobs([(7, TokenLogprobs(7, float("-inf"), ((1, -0.1),)))], texts, 1) == {
        "content": [
            {
                "token": "t7",
                "logprob": -9999.0,
                "bytes": [116, 55],
                "top_logprobs": [{"token": "t1", "logprob": -0.1, "bytes": [116, 49]}],
            }
        ]
    }


# -- a real system --------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["ray", "grpc"])
def system(request, harness):
    # The grpc system has a second decode worker: a migration test kills the first one mid-stream.
    running = harness.start(
        transport=request.param,
        num_prefill=1,
        num_decode=1 if request.param == "ray" else 2,
        http_port=0,
    )
    running.transport = request.param
    yield running
    running.stop()


@pytest.fixture(scope="module")
def openai_client(system):
    return system.openai_client()


@pytest.fixture(scope="module")
def tokenizer(smollm_fp32):
    return smollm_fp32.tokenizer


def _typed(pb_logprob) -> TokenLogprobs:
    return TokenLogprobs(
        pb_logprob.token_id,
        pb_logprob.logprob,
        tuple((t.token_id, t.logprob) for t in pb_logprob.top),
    )


def test_grpc_logprobs_of_the_first_token_and_the_later_ones_equal_the_engine(
    system, smollm_fp32, hf_smollm_fp32, tokenizer
):
    prompt = tokenizer.encode(PROMPT)
    tokens, rows = _reference(smollm_fp32, prompt, 12)
    with system.client() as client:
        responses = list(
            client.stream(
                client.request(
                    token_ids=prompt,
                    max_tokens=12,
                    temperature=0,
                    ignore_eos=True,
                    logprobs=4,
                    prompt_logprobs=2,
                )
            )
        )
    # The first message is the prefill worker's: its first token, that token's logprobs and the
    # prompt's.
    first = responses[0]
    assert (
        len(first.token_ids) == 1
        and len(first.logprobs) == 1
        and len(first.prompt_logprobs) == len(prompt)
    )
    assert all(not r.prompt_logprobs for r in responses[1:])
    got_tokens = [t for r in responses for t in r.token_ids]
    got = [_typed(lp) for r in responses for lp in r.logprobs]
    assert got_tokens == tokens and len(got) == len(tokens)
    for value, row, token in zip(got, rows, tokens):
        _assert_matches(value, row, token, 4)
    assert responses[-1].prefill_worker.startswith("prefill") and responses[
        -1
    ].decode_worker.startswith("decode")
    reference = _hf_prompt_logprobs(hf_smollm_fp32, prompt)
    assert first.prompt_logprobs[0].token_id == prompt[0] and not first.prompt_logprobs[0].HasField(
        "logprob"
    )
    for position, value in enumerate(first.prompt_logprobs[1:]):
        _assert_matches(_typed(value), reference[position], prompt[position + 1], 2)
    # Not asked: nothing computed, nothing sent.
    with system.client() as client:
        plain = client.generate(
            client.request(token_ids=prompt, max_tokens=4, temperature=0, ignore_eos=True)
        )
    assert plain.token_ids == tokens[:4] and not plain.logprobs and not plain.prompt_logprobs
    system.wait_idle()


def test_openai_completions_logprobs_streamed_and_not(
    system, openai_client, smollm_fp32, tokenizer
):
    prompt = tokenizer.encode(PROMPT)
    tokens, rows = _reference(smollm_fp32, prompt, 10)
    args = dict(
        model=system.config.model_name,
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    whole = openai_client.completions.create(**args)
    logprobs = whole.choices[0].logprobs
    assert logprobs.tokens == [tokenizer.decode([t]) for t in tokens]
    for value, row, token in zip(logprobs.token_logprobs, rows, tokens):
        assert abs(value - row[token].item()) < TOL
    for top, row in zip(logprobs.top_logprobs, rows):
        assert len(top) == 3  # greedy: the sampled token is the first of the top 3
        ref_values, ref_ids = row.topk(3)
        assert [tokenizer.decode([t]) for t in ref_ids.tolist()] == list(top)
        assert max(abs(a - b) for a, b in zip(top.values(), ref_values.tolist())) < TOL
    offsets = [0]
    for token_text in logprobs.tokens[:-1]:
        offsets.append(offsets[-1] + len(token_text))
    assert logprobs.text_offset == offsets
    assert whole.choices[0].text == tokenizer.decode(tokens)

    chunks = list(openai_client.completions.create(**args, stream=True))
    streamed = [c.choices[0] for c in chunks if c.choices and c.choices[0].logprobs is not None]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [t for c in streamed for t in c.logprobs.tokens] == logprobs.tokens
    assert (
        max(
            abs(a - b)
            for a, b in zip(
                [v for c in streamed for v in c.logprobs.token_logprobs], logprobs.token_logprobs
            )
        )
        < TOL
    )
    assert [list(d) for c in streamed for d in c.logprobs.top_logprobs] == [
        list(d) for d in logprobs.top_logprobs
    ]
    # A chunk's offsets start where the text streamed before it ended.
    sent = 0
    for chunk in chunks:
        choice = chunk.choices[0]
        if choice.logprobs is not None:
            assert choice.logprobs.text_offset[0] == sent
        sent += len(choice.text)


def test_openai_echo_scores_the_prompt_as_a_direct_forward_pass(
    system, openai_client, hf_smollm_fp32, tokenizer
):
    """lm-evaluation-harness's loglikelihood request: echo, max_tokens 0, logprobs."""
    prompt = tokenizer.encode(PROMPT)
    reference = _hf_prompt_logprobs(hf_smollm_fp32, prompt)
    args = dict(
        model=system.config.model_name,
        prompt=PROMPT,
        max_tokens=0,
        echo=True,
        logprobs=1,
        temperature=0,
    )
    for stream in (False, True):
        if stream:
            chunks = [c for c in openai_client.completions.create(**args, stream=True) if c.choices]
            assert len(chunks) == 1  # the prompt, scored, and the end
            choice = chunks[0].choices[0]
        else:
            response = openai_client.completions.create(**args)
            choice = response.choices[0]
            assert response.usage.prompt_tokens == len(prompt)
        assert choice.text == PROMPT and choice.finish_reason == "length"
        logprobs = choice.logprobs
        assert logprobs.tokens == [tokenizer.decode([t]) for t in prompt]
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        for position, (value, top) in enumerate(
            zip(logprobs.token_logprobs[1:], logprobs.top_logprobs[1:])
        ):
            assert abs(value - reference[position, prompt[position + 1]].item()) < TOL
            assert tokenizer.decode([prompt[position + 1]]) in top and len(top) <= 2
        assert logprobs.text_offset[0] == 0
    # echo with a completion: the prompt's text and logprobs, then the answer's.
    response = openai_client.completions.create(**{**args, "max_tokens": 3})
    choice = response.choices[0]
    assert choice.text.startswith(PROMPT) and len(choice.logprobs.tokens) == len(prompt) + 3
    assert choice.logprobs.token_logprobs[0] is None and all(
        v is not None for v in choice.logprobs.token_logprobs[1:]
    )
    system.wait_idle()


def test_openai_chat_logprobs_streamed_and_not(system, openai_client, smollm_fp32, tokenizer):
    prompt = tokenizer.encode_chat([{"role": "user", "content": QUESTION}])
    tokens, rows = _reference(smollm_fp32, prompt, 12)
    args = dict(
        model=system.config.model_name,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    whole = openai_client.chat.completions.create(**args)
    content = whole.choices[0].logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in tokens]
    for entry, row, token in zip(content, rows, tokens):
        assert abs(entry.logprob - row[token].item()) < TOL
        assert entry.bytes == list(entry.token.encode("utf-8", errors="replace"))
        ref_values, ref_ids = row.topk(2)
        assert [t.token for t in entry.top_logprobs] == [
            tokenizer.decode([t]) for t in ref_ids.tolist()
        ]
        assert (
            max(abs(t.logprob - v) for t, v in zip(entry.top_logprobs, ref_values.tolist())) < TOL
        )
    chunks = list(openai_client.chat.completions.create(**args, stream=True))
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in streamed] == [
        (e.token, [t.token for t in e.top_logprobs]) for e in content
    ]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, content)) < TOL
    # logprobs: true alone: each token's own, no alternatives.
    bare = openai_client.chat.completions.create(**{**args, "top_logprobs": None, "max_tokens": 3})
    assert [e.top_logprobs for e in bare.choices[0].logprobs.content] == [[], [], []]
    plain = openai_client.chat.completions.create(
        **{**args, "logprobs": None, "top_logprobs": None, "max_tokens": 3}
    )
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize(
    "chat, extra, param",
    [
        (True, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (True, {"top_logprobs": 3}, "top_logprobs"),
        (True, {"logprobs": 2}, "logprobs"),
        (False, {"logprobs": "yes"}, "logprobs"),
        (False, {"logprobs": 21}, "logprobs"),
        (False, {"max_tokens": 0}, "max_tokens"),
        (False, {"top_logprobs": 2}, "top_logprobs"),
        (True, {"echo": True}, "echo"),
        (True, {"n": 17}, "n"),
    ],
)
@pytest.mark.parametrize("system", ["ray"], indirect=True)  # the same HTTP front end on both
def test_bad_logprobs_arguments_are_400s_naming_the_field(
    system, openai_client, chat, extra, param
):
    with pytest.raises(openai.BadRequestError) as caught:
        if chat:
            openai_client.chat.completions.create(
                model=system.config.model_name,
                max_tokens=2,
                messages=[{"role": "user", "content": "hi"}],
                extra_body=extra,
            )
        else:
            openai_client.completions.create(
                model=system.config.model_name, prompt="hi", max_tokens=2, extra_body=extra
            )
    error = caught.value.body
    assert error["param"] == param and error["message"].startswith(f"{param}:")


@pytest.mark.parametrize("system", ["grpc"], indirect=True)  # it has the second decode worker
def test_logprobs_survive_a_decode_worker_killed_mid_stream(system, smollm_fp32, tokenizer):
    """The request is re-prefilled as prompt + tokens so far on the other decode worker: the
    logprobs of the tokens already streamed are neither lost nor sent again, and the later ones
    continue."""
    import ray

    prompt = tokenizer.encode(PROMPT)
    max_tokens = 40
    tokens, rows = _reference(smollm_fp32, prompt, max_tokens)
    request_id = "logprobs-migrated"
    responses, errors = [], []

    def run():
        with system.client() as client:
            try:
                responses.extend(
                    client.stream(
                        client.request(
                            token_ids=prompt,
                            request_id=request_id,
                            max_tokens=max_tokens,
                            temperature=0,
                            ignore_eos=True,
                            logprobs=2,
                        )
                    )
                )
            except Exception as error:  # noqa: BLE001 - reported below
                errors.append(error)

    router = system.system.router
    migrations = router.stats().migrations
    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 60
    while sum(len(r.token_ids) for r in responses) < 5:
        assert time.monotonic() < deadline and thread.is_alive(), "the request never reached decode"
        time.sleep(0.005)
    ray.kill(router.route_of(request_id).decode.actor, no_restart=True)
    thread.join(120)
    assert not errors and not thread.is_alive()
    assert router.stats().migrations == migrations + 1
    got_tokens = [t for r in responses for t in r.token_ids]
    got = [_typed(lp) for r in responses for lp in r.logprobs]
    assert got_tokens == tokens and len(got) == max_tokens
    for value, row, token in zip(got, rows, tokens):
        _assert_matches(value, row, token, 2)
