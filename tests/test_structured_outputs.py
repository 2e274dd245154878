"""Structured outputs and tool calls (issue #33): grammars compiled by llguidance over our own
vocabulary, the mask applied where each token is sampled (the first on the prefill worker, the rest
on the decode worker), through a real 1P+1D system on both KV transports with the official `openai`
client: JSON schema answers that validate for every seed (one of them across a decode worker killed
mid-stream), choices and regexes that hold, bad specs that are 400s, and a tool call round trip.

Everything runs in fp32 (the harness pins it), so seeded and greedy answers are token-identical
across batch shapes and migration."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from engine.guided import GrammarError, check
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import GuidedDecoding, SamplingParams
from router.openai_tools import ToolCallStream, ToolChoice

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "cities": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "cities"],
    "additionalProperties": False,
}
QUESTION = "Describe a person who travels, as JSON with their name, age and cities."
CHOICES = ["Paris", "Berlin", "Madrid", 'a city "elsewhere"']
CODE = r"[A-Z]{3}-[0-9]{2,4}"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
# A Hermes / Qwen-style template with a tool format (the default model's has none).
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions:\n<tools>\n"
    "{%- for tool in tools %}{{ tool | tojson }}\n{%- endfor %}</tools>\n"
    'Call one as <tool_call>\n{"name": <name>, "arguments": <args>}\n</tool_call><|im_end|>\n'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls is defined %}"
    "<|im_start|>assistant\n{%- for call in message.tool_calls %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


# -- the engine ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(smollm_fp32):
    return LLMEngine(EngineConfig(kv_cache_bytes=32 << 20), loaded=smollm_fp32)


def _chat(engine, text: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}])


@pytest.mark.timeout(120)
def test_engine_json_answers_validate_greedy_is_deterministic_and_seeds_reproduce(engine):
    guided = GuidedDecoding(json_schema=json.dumps(PERSON))
    prompt = _chat(engine, QUESTION)
    greedy = SamplingParams(max_tokens=80, temperature=0, guided=guided)
    first, again = engine.generate([prompt, prompt], greedy)
    assert first.token_ids == again.token_ids and first.finish_reason == "stop"
    jsonschema.validate(json.loads(first.text), PERSON)
    seeded = {
        f"seed-{seed}": SamplingParams(max_tokens=80, temperature=1.0, seed=seed, guided=guided)
        for seed in range(4)
    }
    for request_id, params in seeded.items():
        engine.add_request(request_id, prompt, params)
    together: dict[str, list[int]] = {request_id: [] for request_id in seeded}
    texts = dict.fromkeys(seeded, "")
    for output in engine.run_until_done():
        together[output.request_id] += output.new_token_ids
        texts[output.request_id] += output.new_text
    for text in texts.values():
        jsonschema.validate(json.loads(text), PERSON)
    # a seed alone samples what it sampled in the batch
    assert engine.generate([prompt], seeded["seed-2"])[0].token_ids == together["seed-2"]
    assert len({tuple(tokens) for tokens in together.values()}) > 1  # the seeds do sample


@pytest.mark.timeout(120)
def test_engine_resumes_a_grammar_over_the_tokens_already_output(engine):
    """A migrated request is re-prefilled as prompt + output so far; its grammar starts from
    there."""
    prompt = _chat(engine, QUESTION)
    guided = GuidedDecoding(json_schema=json.dumps(PERSON), prompt_tokens=len(prompt))
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=7, guided=guided)
    whole = engine.generate([prompt], params)[0]
    cut = 6
    rest = engine.generate(
        [prompt + whole.token_ids[:cut]], SamplingParams(**{**_fields(params), "max_tokens": 34})
    )[0]
    assert whole.token_ids[:cut] + rest.token_ids == whole.token_ids


def _fields(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in params.__dataclass_fields__}


@pytest.mark.timeout(120)
def test_engine_choice_and_regex_hold_eos_ends_them_and_max_tokens_cuts(engine):
    prompt = _chat(engine, "Which city?")
    for seed in range(3):
        choice = engine.generate(
            [prompt],
            SamplingParams(
                max_tokens=20,
                temperature=1.0,
                seed=seed,
                guided=GuidedDecoding(choice=tuple(CHOICES)),
            ),
        )[0]
        assert choice.text in CHOICES and choice.finish_reason == "stop"
        code = engine.generate(
            [prompt],
            SamplingParams(
                max_tokens=20, temperature=1.0, seed=seed, guided=GuidedDecoding(regex=CODE)
            ),
        )[0]
        assert re.fullmatch(CODE, code.text), code.text
    cut = engine.generate(
        [prompt],
        SamplingParams(
            max_tokens=3, temperature=0, guided=GuidedDecoding(json_schema=json.dumps(PERSON))
        ),
    )[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 3


@pytest.mark.timeout(120)
def test_engine_free_requests_batched_with_guided_ones_are_token_identical(engine):
    free = SamplingParams(max_tokens=24, temperature=0)
    prompt = _chat(engine, "Name three rivers in Europe.")
    alone = engine.generate([prompt], free)[0].token_ids
    engine.add_request(
        "guided",
        _chat(engine, QUESTION),
        SamplingParams(max_tokens=24, temperature=0, guided=GuidedDecoding(json_schema="{}")),
    )
    engine.add_request("free", prompt, free)
    tokens = [
        t for out in engine.run_until_done() if out.request_id == "free" for t in out.new_token_ids
    ]
    assert tokens == alone


def test_the_check_names_what_is_wrong():
    for spec, words in [
        (GuidedDecoding(json_schema='{"type": "nonsense"}'), "nonsense"),
        (GuidedDecoding(json_schema="[1]"), "object"),
        (GuidedDecoding(json_schema="{not json"), "not valid JSON"),
        (GuidedDecoding(regex="a(b"), "unclosed group"),
    ]:
        with pytest.raises(GrammarError, match=words):
            check(spec)
    check(GuidedDecoding(choice=("a", 'b"c', "ü\n")))
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecoding(regex="a", choice=("b",))


def test_streamed_tool_calls_hold_back_a_call_and_send_named_arguments_as_they_come():
    auto = ToolCallStream(ToolChoice("auto"))
    sent = [
        auto.feed(piece, False)
        for piece in ["Sure. <tool", '_call>\n{"name": "f", ', '"arguments": {"x": 1}}']
    ]
    assert [text for text, _ in sent] == ["Sure. ", "", ""]
    text, calls = auto.feed("\n</tool_call>", True)
    assert (
        text == ""
        and calls[0]["index"] == 0
        and calls[0]["function"]
        == {
            "name": "f",
            "arguments": '{"x": 1}',
        }
    )
    plain = ToolCallStream(ToolChoice("auto"))
    assert plain.feed("a < b", False) == ("a < b", []) and plain.feed("", True) == ("", [])
    named = ToolCallStream(ToolChoice("named", name="f"))
    (_, first), (_, second) = named.feed('{"x"', False), named.feed(": 1}", True)
    assert first[0]["function"] == {"name": "f", "arguments": '{"x"'} and first[0]["id"]
    assert second == [{"index": 0, "function": {"arguments": ": 1}"}}]


# -- a real system --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(smollm_fp32):
    return smollm_fp32.tokenizer


@pytest.fixture(scope="module", params=["ray", "grpc"])
def system(request, harness):
    # The grpc system has a second decode worker: one test kills the first one mid-stream.
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
def client(system):
    return system.openai_client()


def _person_chat(system, client, seed: int, **extra):
    return client.chat.completions.create(
        model=system.config.model_name,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=100,
        temperature=1.0,
        seed=seed,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON},
        },
        **extra,
    )


@pytest.mark.timeout(180)
def test_json_schema_answers_validate_for_10_seeds(system, client):
    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(lambda seed: _person_chat(system, client, seed), range(10)))
    for answer in answers:
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert len({a.choices[0].message.content for a in answers}) > 1
    # streamed, and reproducible by its seed
    chunks = list(_person_chat(system, client, 3, stream=True))
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks)
        == answers[3].choices[0].message.content
    )
    object_answer = client.chat.completions.create(
        model=system.config.model_name,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=100,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(object_answer.choices[0].message.content), dict)
    assert system.wait_idle().requests_in_flight == 0


@pytest.mark.timeout(180)
def test_guided_choice_and_regex_hold_for_every_seed(system, client):
    def complete(seed: int, **guided):
        return client.completions.create(
            model=system.config.model_name,
            prompt="The best city to visit is",
            max_tokens=16,
            temperature=1.0,
            seed=seed,
            extra_body=guided,
        ).choices[0]

    with ThreadPoolExecutor(20) as pool:
        choices = list(pool.map(lambda s: complete(s, guided_choice=CHOICES), range(10)))
        codes = list(pool.map(lambda s: complete(s, guided_regex=CODE), range(10)))
    assert all(c.text in CHOICES and c.finish_reason == "stop" for c in choices)
    assert all(re.fullmatch(CODE, c.text) and c.finish_reason == "stop" for c in codes)
    chat = client.chat.completions.create(
        model=system.config.model_name,
        messages=[{"role": "user", "content": "Pick a city."}],
        max_tokens=16,
        temperature=0,
        extra_body={"guided_choice": CHOICES},
    )
    assert chat.choices[0].message.content in CHOICES


@pytest.mark.parametrize(
    "extra, param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex"),
        ({"extra_body": {"guided_json": "{bad"}}, "guided_json"),
        ({"extra_body": {"guided_choice": []}}, "guided_choice"),
        ({"extra_body": {"guided_choice": ["a"], "guided_regex": "a"}}, "guided_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
    ],
)
@pytest.mark.parametrize("system", ["ray"], indirect=True)  # the same HTTP front end on both
def test_bad_specs_are_400s_naming_the_field_and_disturb_nothing(system, client, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=system.config.model_name,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            **extra,
        )
    assert caught.value.body["param"] == param, caught.value.body
    assert system.stats().requests_in_flight == 0


@pytest.mark.timeout(120)
def test_grpc_guided_requests_and_their_invalid_argument(system):
    import grpc

    from pdserve_proto import pdserve_pb2 as pb

    with system.client() as grpc_client:
        chosen = grpc_client.generate(
            grpc_client.request(
                "The best city to visit is",
                max_tokens=16,
                temperature=0,
                guided=pb.Guided(choice=pb.GuidedChoice(choices=CHOICES)),
            )
        )
        assert chosen.text in CHOICES and chosen.finish_reason == "stop"
        with pytest.raises(grpc.RpcError) as caught:
            grpc_client.generate(
                grpc_client.request("hi", max_tokens=4, guided=pb.Guided(regex="a(b"))
            )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("sampling.guided.regex:")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("system", ["grpc"], indirect=True)  # it has the second decode worker
def test_a_json_answer_survives_its_decode_worker_killed_mid_stream(system, client):
    """Re-prefilled as prompt + tokens so far on the other decode worker, the grammar resumes from
    the tokens already sent: the answer validates and equals the one of the same seed never
    interrupted."""
    import ray

    reference = _person_chat(system, client, 11).choices[0].message.content
    request_id = "guided-migrated"
    router = system.system.router
    migrations = router.stats().migrations
    pieces, errors = [], []

    def run():
        try:
            stream = _person_chat(
                system, client, 11, stream=True, extra_headers={"X-Request-Id": request_id}
            )
            pieces.extend(c.choices[0].delta.content or "" for c in stream)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 60
    while len(pieces) < 6:
        assert time.monotonic() < deadline and thread.is_alive(), "the request never reached decode"
        time.sleep(0.002)
    ray.kill(router.route_of(request_id).decode.actor, no_restart=True)
    thread.join(120)
    assert not errors and not thread.is_alive()
    assert router.stats().migrations == migrations + 1
    text = "".join(pieces)
    jsonschema.validate(json.loads(text), PERSON)
    assert text == reference


@pytest.mark.timeout(180)
@pytest.mark.parametrize("system", ["ray"], indirect=True)  # the same HTTP front end on both
def test_a_tool_call_round_trip(system, client):
    """The default template has no tool format: a named call is forced by its parameters' schema,
    and the assistant's call and the tool's answer go back in the conversation."""
    model = system.config.model_name
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    answer = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[WEATHER],
        tool_choice=named,
        max_tokens=40,
        temperature=0,
    )
    message = answer.choices[0].message
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and call.id and message.content is None
    assert set(json.loads(call.function.arguments)) == {"city"}
    streamed = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[WEATHER],
        tool_choice=named,
        max_tokens=40,
        temperature=0,
        stream=True,
    )
    deltas = [d for chunk in streamed for d in chunk.choices[0].delta.tool_calls or ()]
    assert deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    required = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=40,
        temperature=0,
    )
    assert required.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in required.choices[0].message.tool_calls] == [
        "get_weather"
    ] * len(required.choices[0].message.tool_calls)
    follow_up = client.chat.completions.create(
        model=model,
        messages=[
            *messages,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny", "celsius": 21}'},
        ],
        tools=[WEATHER],
        max_tokens=12,
        temperature=0,
    )
    assert follow_up.choices[0].message.content and not follow_up.choices[0].message.tool_calls


@pytest.mark.timeout(180)
@pytest.mark.parametrize("system", ["ray"], indirect=True)  # the same HTTP front end on both
def test_auto_tool_calls_in_a_hermes_template_are_parsed(system, client):
    """With a template that has a tool format, "auto" reads the model's `<tool_call>` out of its
    answer (the 135M model rarely writes one unasked, so a regex makes it write one here)."""
    tokenizer = system.system.router.tokenizer
    original = tokenizer.chat_template
    tokenizer.use_chat_template(HERMES_TEMPLATE)
    try:
        call_format = (
            r'Let me check\. <tool_call>\n\{"name": "get_weather", "arguments": '
            r'\{"city": "[A-Z][a-z]{2,9}"\}\}\n</tool_call>'
        )
        ask = dict(
            model=system.config.model_name,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[WEATHER],
            max_tokens=60,
            temperature=0,
            extra_body={"guided_regex": call_format},
        )
        answer = client.chat.completions.create(**ask)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
        # the tools reached the template: the prompt is longer by their description
        assert answer.usage.prompt_tokens > 60
        chunks = list(client.chat.completions.create(**ask, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        calls = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
        assert (
            text.strip() == "Let me check."
            and calls[0].function.arguments == call.function.arguments
        )
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        back = client.chat.completions.create(
            model=system.config.model_name,
            messages=[
                *ask["messages"],
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
            ],
            tools=[WEATHER],
            max_tokens=8,
            temperature=0,
        )
        assert back.usage.prompt_tokens > answer.usage.prompt_tokens
    finally:
        tokenizer.use_chat_template(original)
