"""The OpenAI-compatible HTTP API of a live system (real Ray actors, loopback), driven by the
official `openai` client, against the gRPC path for the same greedy requests; and /metrics."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "test-data-key"
ADMIN_TOKEN = "test-admin-token"


@pytest.fixture(scope="module")
def served(harness):
    system = harness.start(
        num_prefill=1, num_decode=1, http_port=0, api_keys=(API_KEY,), admin_token=ADMIN_TOKEN
    )
    yield system
    system.stop()


@pytest.fixture(scope="module")
def client(served):
    return served.openai_client(API_KEY)


def grpc_client(served):
    from pdserve.client import PdserveClient

    return PdserveClient(port=served.port, timeout_s=120, api_key=API_KEY)


def http(served, method: str, path: str, body=None, headers=None) -> tuple[int, dict, bytes]:
    data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    request = urllib.request.Request(
        f"http://127.0.0.1:{served.system.http_port}{path}",
        data=data,
        method=method,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def metric_samples(served) -> dict:
    status, _, body = http(served, "GET", "/metrics")
    assert status == 200
    return {
        sample.name + json.dumps(sample.labels, sort_keys=True): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


def test_streamed_chat_equals_the_grpc_path(served, client):
    question = "Name three primary colors."
    chunks = list(
        client.chat.completions.create(
            model=served.config.model_name,
            messages=[{"role": "user", "content": question}],
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    reasons = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]

    with grpc_client(served) as grpc:
        reference = grpc.chat(question, max_tokens=24, temperature=0)
    assert text == reference.text and text
    assert reasons == [reference.finish_reason]
    assert usage.prompt_tokens == reference.usage.prompt_tokens > 5
    assert usage.completion_tokens == reference.usage.completion_tokens == len(reference.token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completion_of_token_ids_and_text_equal_the_grpc_path(served, client):
    with grpc_client(served) as grpc:
        reference = grpc.generate(
            grpc.request("The capital of France is", max_tokens=12, temperature=0, ignore_eos=True)
        )
        prompt_ids = list(
            grpc.generate(grpc.request("Once upon a time", max_tokens=1, temperature=0)).token_ids
        )
    whole = client.completions.create(
        model=served.config.model_name,
        prompt="The capital of France is",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert whole.choices[0].text == reference.text
    assert whole.choices[0].finish_reason == "length"
    assert (
        whole.usage.completion_tokens == 12
        and whole.usage.prompt_tokens == reference.usage.prompt_tokens
    )
    assert whole.object == "text_completion" and whole.model == served.config.model_name

    by_ids = client.completions.create(
        model=served.config.model_name,
        prompt=[1, 504, 3458] + prompt_ids,
        max_tokens=5,
        temperature=0,
    )
    assert by_ids.usage.prompt_tokens == 3 + len(prompt_ids)
    assert by_ids.choices[0].text


def test_non_streamed_chat_and_streamed_completion_agree(served, client):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hello."},
    ]
    whole = client.chat.completions.create(
        model=served.config.model_name, messages=messages, max_tokens=16, temperature=0
    )
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=served.config.model_name,
            messages=messages,
            max_tokens=16,
            temperature=0,
            stream=True,
        )
        if c.choices
    )
    assert (
        whole.choices[0].message.content == streamed
        and whole.choices[0].message.role == "assistant"
    )
    assert whole.usage.completion_tokens >= 1

    status, headers, body = http(
        served,
        "POST",
        "/v1/completions",
        {
            "model": served.config.model_name,
            "prompt": "Hello",
            "max_tokens": 4,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        },
        {"Authorization": f"Bearer {API_KEY}"},
    )
    events = [line.removeprefix("data: ") for line in body.decode().split("\n\n") if line]
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_bad_requests_get_400_in_the_openai_shape(served, client):
    model = served.config.model_name
    cases = [
        (dict(messages=[{"role": "user", "content": "hi"}], temperature=-1), "temperature"),
        (dict(messages=[{"role": "user", "content": "hi"}], top_p=0), "top_p"),
        (dict(messages=[{"role": "user", "content": "hi"}], n=17), "n"),
        (dict(messages=[], max_tokens=4), "messages"),
        (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
    ]
    for arguments, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=model, **arguments)
        assert caught.value.status_code == 400
        assert caught.value.body["param"] == param and param in caught.value.body["message"]
        assert caught.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["param"] == "model"


def test_models_health_and_unknown_routes(served, client):
    assert [m.id for m in client.models.list().data] == [served.config.model_name]
    assert http(served, "GET", "/health")[0] == 200
    status, _, body = http(served, "GET", "/v1/nothing-here")
    assert status == 404 and json.loads(body)["error"]["type"] == "not_found_error"


def test_metrics_count_each_request_and_show_the_pools(served, client):
    ttft_count = "pdserve_time_to_first_token_seconds_count{}"
    before = metric_samples(served)
    for expected in (1, 2):
        client.completions.create(
            model=served.config.model_name, prompt="One, two,", max_tokens=3, temperature=0
        )
        after = metric_samples(served)
        assert after[ttft_count] == before.get(ttft_count, 0) + expected
    assert (
        after['pdserve_requests_total{"outcome": "length"}']
        >= before['pdserve_requests_total{"outcome": "length"}'] + 2
    )
    assert after['pdserve_workers{"role": "decode", "state": "ready"}'] == 1
    assert after['pdserve_workers{"role": "prefill", "state": "ready"}'] == 1
    kv_bytes = after["pdserve_kv_transfer_bytes_count{}"]
    assert kv_bytes >= 2 and after["pdserve_kv_transfer_bytes_sum{}"] > 0
    gpu = [key for key in after if key.startswith("pdserve_worker_gpu_available")]
    assert len(gpu) == 2  # one per worker, 0 here; the info series says why
    assert any(key.startswith("pdserve_worker_gpu_info") and "GPU" in key for key in after)
    usage = [
        value
        for key, value in after.items()
        if key.startswith("pdserve_worker_kv_cache_usage_ratio")
    ]
    assert len(usage) == 2 and all(0.0 <= value <= 1.0 for value in usage)
    # the costs the PD policy reads: the prefill worker's rate per prompt token, and every worker's
    # slack, unbounded with nothing decoding any more
    rate = [v for k, v in after.items() if k.startswith("pdserve_worker_prefill_token_seconds")]
    assert len(rate) == 1 and 0 < rate[0] < 1, rate
    slack = [v for k, v in after.items() if k.startswith("pdserve_worker_decode_slack_seconds")]
    assert slack == [math.inf, math.inf], slack


# -- penalties, batched prompts, continuous usage, tokenize (issue #55) ---------------------------


def test_penalties_through_the_api_equal_the_single_process_engine(served, client, smollm_fp32):
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.sampling_params import SamplingParams

    prompt = "List the days of the week:"
    engine = LLMEngine(EngineConfig(kv_cache_bytes=32 << 20), loaded=smollm_fp32)
    ids = smollm_fp32.tokenizer.encode(prompt)
    params = SamplingParams(
        max_tokens=16,
        temperature=0.5,
        seed=11,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.25,
        min_p=0.05,
        logit_bias=((11, -5.0),),
        prompt_tokens=len(ids),
    )
    expected = engine.generate([ids], params)[0]
    plain = engine.generate([ids], SamplingParams(max_tokens=16, temperature=0.5, seed=11))[0]
    assert expected.token_ids != plain.token_ids  # the options change this stream
    got = client.completions.create(
        model=served.config.model_name,
        prompt=prompt,
        max_tokens=16,
        temperature=0.5,
        seed=11,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"11": -5.0},
        extra_body={"repetition_penalty": 1.25, "min_p": 0.05},
        logprobs=0,
    )
    assert got.choices[0].text == smollm_fp32.tokenizer.decode(expected.token_ids)
    assert len(got.choices[0].logprobs.token_logprobs) == len(expected.token_ids)


def post_json(served, path: str, body: dict) -> dict:
    status, _, reply = http(served, "POST", path, body, AUTH)
    assert status == 200, reply
    return json.loads(reply)


def test_logit_bias_bans_and_forces_a_token_and_min_tokens_holds_stops_back(served, client):
    model = served.config.model_name
    greedy = {"model": model, "prompt": "The capital of France is", "temperature": 0}
    with grpc_client(served) as grpc:
        plain = grpc.generate(
            grpc.request("The capital of France is", max_tokens=6, temperature=0)
        ).token_ids
    banned = plain[0]
    without = client.completions.create(
        **greedy, max_tokens=6, logit_bias={str(banned): -100}, extra_body={"ignore_eos": True}
    )
    assert (
        without.choices[0].text != client.completions.create(**greedy, max_tokens=6).choices[0].text
    )
    ids = post_json(
        served, "/tokenize", {"prompt": without.choices[0].text, "add_special_tokens": False}
    )
    assert banned not in ids["tokens"]
    forced = client.completions.create(**greedy, max_tokens=3, logit_bias={"28": 100})
    assert (
        forced.choices[0].text == post_json(served, "/detokenize", {"tokens": [28] * 3})["prompt"]
    )
    stops = {"stop_token_ids": [banned]}
    stopped = client.completions.create(**greedy, max_tokens=6, extra_body=stops)
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"
    held = client.completions.create(**greedy, max_tokens=6, extra_body={**stops, "min_tokens": 4})
    assert held.usage.completion_tokens >= 4


def test_a_batch_of_prompts_answers_as_single_requests_do(served, client):
    model = served.config.model_name
    prompts = ["One, two,", "The sky is", [504, 3458, 314], "Paris is the capital of"]
    options = {"max_tokens": 3, "temperature": 0.7, "seed": 4, "n": 2}
    batch = client.completions.create(model=model, prompt=prompts, **options)
    assert [c.index for c in batch.choices] == list(range(8))
    singles = [client.completions.create(model=model, prompt=p, **options) for p in prompts]
    for i, single in enumerate(singles):
        for j in range(2):
            assert batch.choices[i * 2 + j].text == single.choices[j].text
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)

    streamed: dict[int, str] = {}
    usage = []
    for chunk in client.completions.create(
        model=model,
        prompt=prompts,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        **options,
    ):
        usage.append(chunk.usage)
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {i: c.text for i, c in enumerate(batch.choices)}
    assert all(u is not None for u in usage)  # continuous: usage in every chunk
    assert usage[-1].completion_tokens == batch.usage.completion_tokens


def test_tokenize_detokenize_and_version(served):
    text = "Hello, world! Ça va?"
    reply = post_json(served, "/tokenize", {"prompt": text})
    assert reply["count"] == len(reply["tokens"]) > 3 and reply["max_model_len"] > 0
    back = post_json(served, "/detokenize", {"tokens": reply["tokens"]})
    assert back["prompt"].endswith(text)
    chat = post_json(served, "/tokenize", {"messages": [{"role": "user", "content": text}]})
    assert chat["count"] > reply["count"]
    status, _, body = http(served, "GET", "/version")
    assert status == 200 and json.loads(body)["version"]
    status, _, body = http(served, "POST", "/detokenize", {"tokens": [-1]}, AUTH)
    assert status == 400 and json.loads(body)["error"]["param"] == "tokens"


AUTH = {"Authorization": f"Bearer {API_KEY}"}
