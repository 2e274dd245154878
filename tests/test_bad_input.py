"""Bad input over both APIs, table-driven: each case gets the right status and a message naming the
problem, and a well-formed request served right after still returns the exact expected output."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest

from pdserve.client import PdserveClient
from pdserve_proto import pdserve_pb2 as pb

API_KEY = "data-key-1"
ADMIN_TOKEN = "admin-token-1"
GOOD_PROMPT = "Count from one to five:"


@pytest.fixture(scope="module")
def served(harness):
    system = harness.start(
        num_prefill=1,
        num_decode=1,
        http_port=0,
        api_keys=(API_KEY,),
        admin_token=ADMIN_TOKEN,
        max_in_flight=64,
    )
    yield system
    system.stop()


@pytest.fixture(scope="module")
def expected(served):
    with PdserveClient(port=served.port, api_key=API_KEY, timeout_s=60) as client:
        return client.generate(
            client.request(GOOD_PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
        ).text


def _post(
    served, path: str, body, content_type: str = "application/json", key=API_KEY
) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": content_type}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(
        f"http://127.0.0.1:{served.system.http_port}{path}", data=data, headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _chat(**fields) -> dict:
    return {
        "model": "MODEL",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        **fields,
    }


def _completion(**fields) -> dict:
    return {"model": "MODEL", "prompt": "hi", "max_tokens": 4, **fields}


# (name, path, body, content type, key, expected status, words the message must contain)
HTTP_CASES = [
    ("empty prompt", "/v1/completions", _completion(prompt=""), None, API_KEY, 400, "prompt"),
    (
        "oversize prompt",
        "/v1/completions",
        _completion(prompt="word " * 40000),
        None,
        API_KEY,
        400,
        "prompt",
    ),
    (
        "prompt of wrong type",
        "/v1/completions",
        _completion(prompt={"text": "hi"}),
        None,
        API_KEY,
        400,
        "prompt",
    ),
    (
        "batch with an empty prompt",
        "/v1/completions",
        _completion(prompt=["a", ""]),
        None,
        API_KEY,
        400,
        "prompt[1]",
    ),
    (
        "presence_penalty out of range",
        "/v1/completions",
        _completion(presence_penalty=2.5),
        None,
        API_KEY,
        400,
        "presence_penalty: must be in [-2, 2]",
    ),
    (
        "logit_bias out of range",
        "/v1/chat/completions",
        _chat(logit_bias={"5": 101}),
        None,
        API_KEY,
        400,
        "[-100, 100]",
    ),
    (
        "negative max_tokens",
        "/v1/completions",
        _completion(max_tokens=-3),
        None,
        API_KEY,
        400,
        "max_tokens",
    ),
    (
        "max_tokens as string",
        "/v1/completions",
        _completion(max_tokens="10"),
        None,
        API_KEY,
        400,
        "max_tokens",
    ),
    (
        "absurd temperature",
        "/v1/chat/completions",
        _chat(temperature=1e9),
        None,
        API_KEY,
        400,
        "temperature",
    ),
    (
        "negative temperature",
        "/v1/chat/completions",
        _chat(temperature=-0.5),
        None,
        API_KEY,
        400,
        "temperature",
    ),
    ("top_p above 1", "/v1/chat/completions", _chat(top_p=1.5), None, API_KEY, 400, "top_p"),
    ("negative top_k", "/v1/chat/completions", _chat(top_k=-7), None, API_KEY, 400, "top_k"),
    ("negative seed", "/v1/chat/completions", _chat(seed=-1), None, API_KEY, 400, "seed"),
    ("stop of wrong type", "/v1/chat/completions", _chat(stop=[1, 2]), None, API_KEY, 400, "stop"),
    ("n above 16", "/v1/chat/completions", _chat(n=17), None, API_KEY, 400, "n"),
    (
        "unknown field",
        "/v1/chat/completions",
        _chat(temprature=0.5),
        None,
        API_KEY,
        400,
        "temprature",
    ),
    ("no messages", "/v1/chat/completions", _chat(messages=[]), None, API_KEY, 400, "messages"),
    (
        "unknown role",
        "/v1/chat/completions",
        _chat(messages=[{"role": "robot", "content": "x"}]),
        None,
        API_KEY,
        400,
        "role",
    ),
    (
        "stream_options without stream",
        "/v1/chat/completions",
        _chat(stream_options={"include_usage": True}),
        None,
        API_KEY,
        400,
        "stream_options",
    ),
    (
        "token id outside the vocabulary",
        "/v1/completions",
        _completion(prompt=[1, 2, 10**8]),
        None,
        API_KEY,
        400,
        "vocabulary",
    ),
    (
        "malformed JSON",
        "/v1/chat/completions",
        b'{"model": "x", "messages": [',
        None,
        API_KEY,
        400,
        "JSON",
    ),
    (
        "invalid UTF-8",
        "/v1/chat/completions",
        b'{"model": "\xff\xfe"}',
        None,
        API_KEY,
        400,
        "UTF-8",
    ),
    ("JSON that is not an object", "/v1/chat/completions", b"[1, 2]", None, API_KEY, 400, "object"),
    (
        "wrong content type",
        "/v1/chat/completions",
        _chat(),
        "text/plain",
        API_KEY,
        415,
        "Content-Type",
    ),
    ("unknown model", "/v1/chat/completions", _chat(model="gpt-5"), None, API_KEY, 404, "gpt-5"),
    ("missing API key", "/v1/chat/completions", _chat(), None, None, 401, "credentials"),
    ("wrong API key", "/v1/chat/completions", _chat(), None, "nope", 401, "invalid API key"),
    (
        "admin call with a data-plane key",
        "/admin/scale",
        {"decode": 1},
        None,
        API_KEY,
        403,
        "admin token",
    ),
    ("admin call with no key", "/admin/scale", {"decode": 1}, None, None, 401, "credentials"),
    (
        "admin call with a bad size",
        "/admin/scale",
        {"decode": -2},
        None,
        ADMIN_TOKEN,
        400,
        "decode",
    ),
    (
        "body too large",
        "/v1/completions",
        b'{"prompt": "' + b"a" * (9 << 20) + b'"}',
        None,
        API_KEY,
        413,
        "larger",
    ),
]


@pytest.mark.parametrize(
    "name,path,body,content_type,key,status,words", HTTP_CASES, ids=[c[0] for c in HTTP_CASES]
)
def test_http_bad_input(served, expected, name, path, body, content_type, key, status, words):
    if isinstance(body, dict) and body.get("model") == "MODEL":
        body = {**body, "model": served.config.model_name}
    got_status, reply = _post(served, path, body, content_type or "application/json", key)
    assert got_status == status, reply
    error = reply["error"]
    assert words in error["message"] and error["type"]
    assert set(error) == {"message", "type", "param", "code"}
    _still_serves(served, expected)


def _grpc_request(**changes) -> "pb.GenerateRequest":
    request = PdserveClient.request("hi", max_tokens=4)
    for name, value in changes.items():
        if name == "sampling":
            request.sampling.CopyFrom(value)
        else:
            setattr(request, name, value)
    return request


def _with_unknown_field() -> "pb.GenerateRequest":
    request = PdserveClient.request("hi", max_tokens=4)
    # field 111, varint 1
    return pb.GenerateRequest.FromString(request.SerializeToString() + b"\xf8\x06\x01")


# (name, request, key, expected code, words)
GRPC_CASES = [
    ("no prompt", pb.GenerateRequest(), API_KEY, grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    ("empty text", _grpc_request(text=""), API_KEY, grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (
        "oversize text",
        _grpc_request(text="word " * 300000),
        API_KEY,
        grpc.StatusCode.INVALID_ARGUMENT,
        "prompt",
    ),
    (
        "temperature absurd",
        _grpc_request(sampling=pb.SamplingParams(temperature=1e9)),
        API_KEY,
        grpc.StatusCode.INVALID_ARGUMENT,
        "temperature",
    ),
    (
        "top_p zero",
        _grpc_request(sampling=pb.SamplingParams(top_p=0.0)),
        API_KEY,
        grpc.StatusCode.INVALID_ARGUMENT,
        "top_p",
    ),
    (
        "max_tokens zero",
        _grpc_request(sampling=pb.SamplingParams(max_tokens=0)),
        API_KEY,
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_tokens",
    ),
    (
        "unknown field",
        _with_unknown_field(),
        API_KEY,
        grpc.StatusCode.INVALID_ARGUMENT,
        "unknown field",
    ),
    (
        "request id too long",
        _grpc_request(request_id="x" * 500),
        API_KEY,
        grpc.StatusCode.INVALID_ARGUMENT,
        "request_id",
    ),
    ("missing API key", _grpc_request(), None, grpc.StatusCode.UNAUTHENTICATED, "credentials"),
    ("wrong API key", _grpc_request(), "nope", grpc.StatusCode.UNAUTHENTICATED, "invalid API key"),
]


@pytest.mark.parametrize("name,request_,key,code,words", GRPC_CASES, ids=[c[0] for c in GRPC_CASES])
def test_grpc_bad_input(served, expected, name, request_, key, code, words):
    with PdserveClient(port=served.port, api_key=key, timeout_s=60) as client:
        with pytest.raises(grpc.RpcError) as failure:
            client.generate(request_)
    assert failure.value.code() == code
    assert words in failure.value.details()
    _still_serves(served, expected)


def test_grpc_scale_needs_the_admin_token(served):
    with PdserveClient(port=served.port, api_key=API_KEY) as client:
        with pytest.raises(grpc.RpcError) as failure:
            client.scale(decode=1)
    assert (
        failure.value.code() == grpc.StatusCode.PERMISSION_DENIED
        and "admin token" in failure.value.details()
    )
    with PdserveClient(port=served.port, api_key=ADMIN_TOKEN) as admin:
        assert admin.scale(decode=1).decode == 1


def test_a_public_bind_without_keys_refuses_to_start():
    from pdserve.system import ServeConfig

    with pytest.raises(ValueError, match="--insecure"):
        ServeConfig(host="0.0.0.0")
    with pytest.raises(ValueError, match="admin token"):
        ServeConfig(host="0.0.0.0", api_keys=("k",))
    assert ServeConfig(host="0.0.0.0", insecure=True).host == "0.0.0.0"
    assert ServeConfig(host="0.0.0.0", api_keys=("k",), admin_token="t").credentials.configured


def test_a_stream_interval_below_one_refuses_to_start():
    from pdserve.system import ServeConfig

    with pytest.raises(ValueError, match="--stream-interval"):
        ServeConfig(stream_interval=0)


def test_a_dummy_model_without_a_tokenizer_refuses_to_start():
    from pdserve.system import ServeConfig

    with pytest.raises(ValueError, match="--tokenizer"):
        ServeConfig(model="dummy:smollm2-135m")
    assert ServeConfig(model="dummy:smollm2-135m", tokenizer="default").tokenizer == "default"


def test_a_chat_template_that_does_not_compile_or_names_no_file_refuses_to_start(tmp_path):
    from pdserve.system import ServeConfig

    with pytest.raises(ValueError, match="--chat-template.*does not compile"):
        ServeConfig(chat_template="{% for m in messages %}")
    with pytest.raises(ValueError, match="neither a file nor a template"):
        ServeConfig(chat_template=str(tmp_path / "missing.jinja"))
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert ServeConfig(chat_template=str(template)).chat_template_text == template.read_text()


def _still_serves(served, expected: str) -> None:
    status, reply = _post(
        served,
        "/v1/completions",
        {
            "model": served.config.model_name,
            "prompt": GOOD_PROMPT,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert status == 200 and reply["choices"][0]["text"] == expected
