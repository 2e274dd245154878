"""The parsers under hypothesis (bounded examples): OpenAI request bodies (the pure parser, then
over HTTP), `GenerateRequest` (the validator, then over gRPC) and the KV wire header decoder. Any
input gives the module's typed client error (a 4xx / INVALID_ARGUMENT naming the field, a
`KVTransferError`) or a valid request that is then served; never another exception, a 5xx, INTERNAL
or a stuck server."""

from __future__ import annotations

import dataclasses
import http.client
import json
import typing
import uuid

import grpc
import msgpack
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, example, given, settings, strategies as st

from engine.tokenizer import load_tokenizer
from kvtransfer.errors import KVTransferError, WireFormatError
from kvtransfer.wire import KVGroupHeader, group_payload_bytes
from pdserve_proto import pdserve_pb2 as pb, pdserve_pb2_grpc as pb_grpc
from router.openai_api import (
    _NEUTRAL,
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    ApiError,
    openai_param,
    parse_body,
    parse_request,
)
from router.validation import RequestValidationError, ValidationLimits, validate
from tests.kv_ends import FP32

PURE = settings(
    max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
OVER_THE_WIRE = settings(PURE, max_examples=100)
SERVED_MAX_TOKENS = 3  # a valid fuzzed request is served, but cheaply

# -- strategies ------------------------------------------------------------------------------------

# Lone surrogates are legal in JSON ("\ud800") though not in UTF-8; control and format characters
# too.
WILD_TEXT = st.text(
    st.characters(categories=["L", "N", "P", "S", "Z", "Cc", "Cf", "Cs"]), max_size=24
) | st.sampled_from(
    [
        "",
        " ",
        "\x00",
        "\x1d",
        "\ud800",
        "a\udfffb",
        "<|im_start|>",
        "<|im_end|>",
        "{{ raise_exception('x') }}",
        "\u2028",
        "user",
        "assistant",
        "system",
        "developer",
        "text",
    ]
)
NUMBERS = (
    st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.sampled_from(
        [0, 1, -1, 2, 3, 2**31, 2**32, 2**32 - 1, 2**63, 2**64, 0.0, -0.0, 0.5, 1.0, 1e6, 1e309]
    )
)
SCALARS = st.none() | st.booleans() | NUMBERS | WILD_TEXT
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(WILD_TEXT, inner, max_size=4),
    max_leaves=10,
)
FIELD_VALUES = JSON_VALUES | st.sampled_from(
    [
        None,
        True,
        False,
        0,
        1,
        4,
        -1,
        0.0,
        0.7,
        1.0,
        "",
        "stop",
        ["\n", "."],
        [2, 3],
        [],
        {},
        {"type": "text"},
        {"include_usage": True},
        {"include_usage": "yes"},
        "none",
    ]
)


def _mostly(
    plausible: st.SearchStrategy, wild: st.SearchStrategy = FIELD_VALUES
) -> st.SearchStrategy:
    """`plausible` 4 times in 5, else `wild`, so that most inputs get past the first field
    checked."""
    return st.integers(0, 4).flatmap(lambda i: wild if i == 4 else plausible)


U32 = st.integers(min_value=0, max_value=2**32 - 1)
VOCAB = 49152  # the default model's (SmolLM2); the `limits` fixture checks it
PROMPTS = _mostly(
    WILD_TEXT | st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
    st.lists(st.integers(-2, 2**33), max_size=6) | st.lists(WILD_TEXT, max_size=2) | JSON_VALUES,
)
TEXT_PART = st.fixed_dictionaries(
    {"type": st.just("text") | JSON_VALUES, "text": WILD_TEXT | JSON_VALUES}
)
CONTENT = _mostly(WILD_TEXT, st.lists(TEXT_PART, max_size=2) | JSON_VALUES)
MESSAGE = _mostly(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "developer"]), "content": CONTENT},
        optional={"name": WILD_TEXT},
    ),
    st.fixed_dictionaries(
        {"role": st.sampled_from(["tool", ""]) | JSON_VALUES, "content": CONTENT},
        optional={"name": JSON_VALUES, "tool_calls": JSON_VALUES},
    )
    | JSON_VALUES,
)
MESSAGES = _mostly(
    st.lists(MESSAGE, min_size=1, max_size=3), st.lists(MESSAGE, max_size=3) | JSON_VALUES
)
SMALL_INTS = st.integers(min_value=-2, max_value=40) | st.sampled_from([2**31, 2**32, 2**63, 2**64])
PLAUSIBLE = {
    **{name: st.sampled_from([None, *values]) for name, values in _NEUTRAL.items()},
    "max_tokens": SMALL_INTS,
    "max_completion_tokens": SMALL_INTS,
    "top_k": SMALL_INTS,
    "temperature": st.floats(min_value=-0.5, max_value=3) | st.sampled_from([0, 1, 1e6, 1e7]),
    "top_p": st.floats(min_value=-0.5, max_value=1.5) | st.sampled_from([0, 1, 1e-30]),
    "seed": st.integers(min_value=-1, max_value=2**64),
    "stream": st.booleans(),
    "stream_options": st.sampled_from(
        [None, {"include_usage": True}, {"include_usage": False}, {"continuous_usage_stats": True}]
    ),
    "stop": WILD_TEXT | st.lists(WILD_TEXT, max_size=3),
    "stop_token_ids": st.lists(st.integers(-1, 2**32), max_size=3),
    "user": WILD_TEXT,
    "ignore_eos": st.booleans(),
    "response_format": st.sampled_from([None, {"type": "text"}, {"type": "json_object"}]),
}


@st.composite
def openai_bodies(draw, chat: bool, model: str) -> dict:
    """Bodies with OpenAI's structure (a few known fields, mostly plausible values, sometimes wild
    ones, sometimes an unknown field), or any JSON object."""
    if draw(st.integers(0, 9)) == 9:
        return draw(st.dictionaries(WILD_TEXT, JSON_VALUES, max_size=5))
    body = {
        "model": draw(_mostly(st.just(model))),
        **({"messages": draw(MESSAGES)} if chat else {"prompt": draw(PROMPTS)}),
    }
    if draw(st.integers(0, 19)) == 19:
        body.pop("model")
    known = sorted((CHAT_FIELDS if chat else COMPLETION_FIELDS) - {"model", "messages", "prompt"})
    for name in draw(st.lists(st.sampled_from(known), max_size=5, unique=True)):
        body[name] = draw(_mostly(PLAUSIBLE.get(name, FIELD_VALUES)))
    if draw(st.integers(0, 19)) == 19:
        body[draw(WILD_TEXT)] = draw(FIELD_VALUES)
    return body


def json_bytes(value) -> bytes:
    return json.dumps(value).encode()  # NaN and Infinity as Python writes them (not strict JSON)


RAW_BODIES = (
    st.binary(max_size=64)
    | JSON_VALUES.map(json_bytes)
    | st.sampled_from(
        [
            b"",
            b"{",
            b"null",
            b"[]",
            b'{"model": 1}',
            b"\xff\xfe{}",
            b'{"a": 1} trailing',
            b'"text"',
            b"{}" * 3,
            '{"prompt": "\u00e9"}'.encode("latin-1"),
        ]
    )
)

PROTO_TEXT = st.text(max_size=24) | st.sampled_from(
    ["", "\x00", "\x1d", "<|im_start|>", "{{ raise_exception('x') }}", "user"]
)
# An unknown field (number 99, varint) appended to a serialized message.
UNKNOWN_FIELD = bytes([0x98, 0x06, 0x01])


@st.composite
def generate_requests(draw) -> "pb.GenerateRequest":
    """Any `GenerateRequest` the protobuf types allow, each field mostly plausible, sometimes wild,
    with now and then an unknown field (top level or in `sampling`)."""
    token_ids = st.lists(_mostly(st.integers(0, VOCAB - 1), U32), max_size=6)
    sampling = pb.SamplingParams(
        stop=draw(st.lists(PROTO_TEXT, max_size=2)),
        stop_token_ids=draw(_mostly(st.lists(st.integers(0, VOCAB - 1), max_size=2), token_ids)),
        ignore_eos=draw(st.booleans()),
    )
    optional = {
        "max_tokens": _mostly(st.integers(0, 40), U32),
        "top_k": _mostly(st.integers(0, 100), U32),
        "temperature": _mostly(st.floats(0, 2, width=32), st.floats(width=32)),
        "top_p": _mostly(st.floats(0, 1, width=32), st.floats(width=32)),
        "seed": st.integers(min_value=0, max_value=2**64 - 1),
    }
    for name, values in optional.items():
        value = draw(st.none() | values)
        if value is not None:
            setattr(sampling, name, value)
    if draw(st.integers(0, 19)) == 19:
        sampling = pb.SamplingParams.FromString(sampling.SerializeToString() + UNKNOWN_FIELD)
    request_id = _mostly(
        st.just("") | st.text("abcdef0123456789-_.:", max_size=40),
        PROTO_TEXT | st.text(min_size=120, max_size=140),
    )
    request = pb.GenerateRequest(request_id=draw(request_id), sampling=sampling)
    kind = draw(st.sampled_from(["text", "text", "token_ids", "chat", "chat", "none"]))
    if kind == "text":
        request.text = draw(PROTO_TEXT)
    elif kind == "token_ids":
        request.token_ids.ids.extend(draw(token_ids))
    elif kind == "chat":
        role = _mostly(
            st.sampled_from(["user", "system", "assistant"]),
            st.sampled_from(["developer", "", "tool"]) | PROTO_TEXT,
        )
        request.chat.messages.extend(
            pb.ChatMessage(role=draw(role), content=draw(PROTO_TEXT))
            for _ in range(draw(st.integers(0, 3)))
        )
    if draw(st.integers(0, 19)) == 19:
        request = pb.GenerateRequest.FromString(request.SerializeToString() + UNKNOWN_FIELD)
    return request


# -- what the parsers must answer ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


@pytest.fixture(scope="module")
def limits(tokenizer):
    assert tokenizer.vocab_size == VOCAB
    return ValidationLimits(max_context_tokens=2048, vocab_size=tokenizer.vocab_size)


def expected_openai(body, chat: bool, model: str, tokenizer, limits):
    """(status, parsed, validated) as the front door must answer `body`: a 4xx, or 200 with the
    request."""
    try:
        parsed = parse_request(body, chat, model, uuid.uuid4().hex)
    except ApiError as error:
        assert 400 <= error.status < 500 and str(error), error
        return error.status, None, None
    try:
        validated = validate(parsed.request, tokenizer, limits)
    except RequestValidationError as error:
        assert error.field and error.reason and openai_param(error.field, parsed), error
        return 400, parsed, None
    return 200, parsed, validated


def expected_grpc(request, tokenizer, limits):
    """The validated request, or None where the validator refuses it (naming the field)."""
    try:
        return validate(request, tokenizer, limits)
    except RequestValidationError as error:
        assert error.field and error.reason and str(error).startswith(error.field), error
        return None


def check_valid(validated, limits) -> None:
    """What an accepted request must be: a prompt of in-vocabulary tokens, room for its output, an
    id."""
    assert validated.prompt_ids, "accepted a prompt that tokenizes to no tokens"
    assert all(0 <= t < limits.vocab_size for t in validated.prompt_ids)
    assert 1 <= validated.params.max_tokens <= limits.max_context_tokens - len(validated.prompt_ids)
    assert validated.request_id and len(validated.request_id) <= 128


def servable(validated) -> bool:
    """Accepted by the validator and worth serving; one with no prompt tokens must be refused
    (check_valid)."""
    return validated is not None and bool(validated.prompt_ids)


# -- the pure parsers ------------------------------------------------------------------------------


@PURE
@given(raw=RAW_BODIES)
def test_any_body_bytes_give_a_json_object_or_a_400(raw):
    try:
        body = parse_body(raw)
    except ApiError as error:
        assert error.status == 400 and str(error)
        return
    assert isinstance(body, dict)


@PURE
@given(case=st.booleans().flatmap(lambda chat: st.tuples(st.just(chat), openai_bodies(chat, "m"))))
# found by this test (UnicodeEncodeError; HTTP 500)
@example(case=(False, {"model": "m", "prompt": "a\ud800b"}))
def test_any_openai_body_gives_a_client_error_or_a_valid_request(case, tokenizer, limits):
    chat, body = case
    status, parsed, validated = expected_openai(body, chat, "m", tokenizer, limits)
    if status == 200:
        assert parsed.chat == chat
        check_valid(validated, limits)


@PURE
@given(request=generate_requests())
# found by this test: no tokens (then UNAVAILABLE from the worker)
@example(request=pb.GenerateRequest(text="\x1d"))
def test_any_generate_request_gives_a_validation_error_or_a_valid_request(
    request, tokenizer, limits
):
    validated = expected_grpc(request, tokenizer, limits)
    if validated is not None:
        check_valid(validated, limits)


# -- the KV wire header decoder --------------------------------------------------------------------

VALID_HEADER = KVGroupHeader(
    request_id="r1",
    sender_id="prefill-0",
    sender_epoch=7,
    layout=FP32,
    layer_start=1,
    layer_stop=3,
    num_blocks=2,
    payload_bytes=group_payload_bytes(FP32, 2, 2),
    checksum=123,
)
MSGPACK_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)


def _decodes_typed(data: bytes) -> None:
    try:
        header = KVGroupHeader.decode(data, FP32)
    except KVTransferError:
        return
    # Accepted: every field has its exact type (4.0 or True for an int would flow into tensor
    # shapes).
    for name, kind in typing.get_type_hints(KVGroupHeader).items():
        assert type(getattr(header, name)) is kind, f"{name}={getattr(header, name)!r}"
    for field in dataclasses.fields(FP32):
        assert type(getattr(header.layout, field.name)) is type(getattr(FP32, field.name)), (
            header.layout
        )
    assert header.layout == FP32 and KVGroupHeader.decode(header.encode(), FP32) == header


@PURE
@given(data=st.binary(max_size=256) | MSGPACK_VALUES.map(msgpack.packb))
def test_any_bytes_give_a_kv_header_or_a_typed_kv_error(data):
    _decodes_typed(data)


@PURE
@given(data=st.data())
def test_mutated_valid_headers_give_a_kv_header_or_a_typed_kv_error(data):
    fields = msgpack.unpackb(VALID_HEADER.encode())
    for _ in range(data.draw(st.integers(1, 3))):
        how = data.draw(st.sampled_from(["replace", "delete", "add", "layout_item"]))
        name = data.draw(st.sampled_from(sorted(fields) or ["version"]))
        if how == "replace":
            fields[name] = data.draw(
                MSGPACK_VALUES | st.sampled_from([2, 1, 0, -1, 2.0, True, "2", 2**64 - 1, None])
            )
        elif how == "delete":
            fields.pop(name, None)
        elif how == "add":
            fields[data.draw(st.text(max_size=8))] = data.draw(MSGPACK_VALUES)
        elif isinstance(fields.get("layout"), list) and fields["layout"]:
            layout = list(fields["layout"])
            index = data.draw(st.integers(0, len(layout) - 1))
            as_float = float(layout[index]) if isinstance(layout[index], int) else 0.0
            layout[index] = data.draw(
                MSGPACK_VALUES | st.sampled_from([as_float, True, "bfloat16", "float32", 4, 2])
            )
            fields["layout"] = layout
    encoded = msgpack.packb(fields)
    _decodes_typed(encoded)
    cut = data.draw(st.integers(0, len(encoded)))
    flip = data.draw(st.integers(0, max(0, len(encoded) - 1)))
    _decodes_typed(encoded[:cut])  # truncated
    if encoded:
        _decodes_typed(
            encoded[:flip]
            + bytes([encoded[flip] ^ data.draw(st.integers(1, 255))])
            + encoded[flip + 1 :]
        )


def test_the_unmutated_header_decodes():
    assert KVGroupHeader.decode(VALID_HEADER.encode(), FP32) == VALID_HEADER


@pytest.mark.parametrize("index", range(4))
def test_a_layout_number_sent_as_a_float_is_refused(index):
    """Found by the mutation fuzz: 4.0 == 4, so a float passes the layout comparison unless typed.
    The receiver refuses it with an error naming the field, rather than converting it."""
    fields = msgpack.unpackb(VALID_HEADER.encode())
    name = dataclasses.fields(FP32)[index].name
    sent = float(fields["layout"][index])
    assert sent == getattr(FP32, name)  # equal to ours: only its type is wrong
    fields["layout"][index] = sent
    with pytest.raises(
        WireFormatError, match=rf"field 'layout\.{name}' must be int, got float {sent!r}"
    ):
        KVGroupHeader.decode(msgpack.packb(fields), FP32)


# -- over the wire: one live system ----------------------------------------------------------------


@pytest.fixture(scope="module")
def served(harness):
    system = harness.start(num_prefill=1, num_decode=1, http_port=0)
    yield system
    system.stop()


@pytest.fixture(scope="module")
def channel(served):
    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.GenerationStub(channel)


def post(served, path: str, raw: bytes, content_type) -> tuple[int, dict, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", served.system.http_port, timeout=60)
    try:
        headers = {"Content-Type": content_type} if content_type is not None else {}
        connection.request("POST", path, body=raw, headers=headers)
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def _cheap(body: dict, parsed) -> dict:
    return {**body, parsed.max_tokens_param: SERVED_MAX_TOKENS}


def check_http(
    served, chat: bool, raw: bytes, content_type="application/json", expected=None
) -> None:
    """POSTs `raw`; the answer is `expected` (when known) and never a 5xx; a 200 is a whole
    answer."""
    status, headers, answer = post(
        served, "/v1/chat/completions" if chat else "/v1/completions", raw, content_type
    )
    assert status < 500, (status, raw[:300], answer[:500])
    if expected is not None:
        assert status == expected, (raw[:300], answer[:500])
    if status != 200:
        assert json.loads(answer)["error"]["message"]
    elif headers.get("Content-Type", "").startswith("text/event-stream"):
        events = [e.removeprefix("data: ") for e in answer.decode().split("\n\n") if e]
        assert events[-1] == "[DONE]", answer[-500:]
        assert all("error" not in json.loads(e) for e in events[:-1]), answer[-500:]
    else:
        assert json.loads(answer)["choices"][0]["finish_reason"] in ("stop", "length")


def check_http_body(served, chat: bool, body: dict) -> None:
    """`body` sent as JSON: the status the parser gives locally (a valid one is served, with few
    tokens)."""
    router, model = served.system.router, served.config.model_name
    try:
        status, parsed, validated = expected_openai(
            body, chat, model, router.tokenizer, served.system.limits
        )
        if status == 200:
            body = _cheap(body, parsed)
            status, parsed, validated = expected_openai(
                body, chat, model, router.tokenizer, served.system.limits
            )
        expected = 400 if status == 200 and not servable(validated) else status
    except AssertionError:
        raise
    except Exception:  # the parser itself fails: the server must still answer with a 4xx
        expected = None
    check_http(served, chat, json_bytes(body), expected=expected)


@OVER_THE_WIRE
@given(chat=st.booleans(), data=st.data())
def test_fuzzed_http_bodies_get_a_4xx_or_are_served(served, chat, data):
    check_http_body(served, chat, data.draw(openai_bodies(chat, served.config.model_name)))


@OVER_THE_WIRE
@given(
    chat=st.booleans(),
    raw=RAW_BODIES,
    content_type=st.sampled_from(
        ["application/json"] * 4 + [None, "text/plain", "application/x-www-form-urlencoded"]
    ),
)
def test_fuzzed_http_bytes_and_content_types_get_a_4xx(served, chat, raw, content_type):
    check_http(
        served,
        chat,
        raw,
        content_type,
        expected=None if content_type == "application/json" else 415,
    )


# Inputs the fuzz found or that sit on an edge, always sent (the fuzz may not draw them every run).
# Lone surrogates are valid JSON ("\ud800") but not encodable as UTF-8: found by the fuzz (HTTP
# 500).
EDGE_BODIES = {
    "surrogate-prompt": (False, {"prompt": "a\ud800b"}),
    "surrogate-content": (True, {"messages": [{"role": "user", "content": "\udfff"}]}),
    "surrogate-content-part": (
        True,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
    ),
    "surrogate-role": (True, {"messages": [{"role": "\ud800", "content": "hi"}]}),
    "surrogate-stop": (False, {"prompt": "hi", "stop": ["\ud800"]}),
    # refused too: the body is not valid Unicode
    "surrogate-user": (False, {"prompt": "hi", "user": "\ud800"}),
    "max-tokens-2**64": (False, {"prompt": "hi", "max_tokens": 2**64}),
    "temperature-nan": (False, {"prompt": "hi", "temperature": float("nan")}),
    "seed-2**64": (False, {"prompt": "hi", "seed": 2**64}),
    "token-id-2**32": (False, {"prompt": [2**32]}),
    "template-injection": (
        True,
        {"messages": [{"role": "user", "content": "{{ raise_exception('x') }}"}]},
    ),
    # found by the fuzz: tokenizes to nothing (HTTP 503 from the worker)
    "no-tokens": (False, {"prompt": "\x1d"}),
}


@pytest.mark.parametrize("chat, fields", EDGE_BODIES.values(), ids=EDGE_BODIES.keys())
def test_edge_bodies_get_a_4xx_or_are_served(served, chat, fields):
    check_http_body(served, chat, {"model": served.config.model_name, **fields})


def check_grpc(served, stub, request: "pb.GenerateRequest") -> None:
    """INVALID_ARGUMENT exactly when the validator refuses it locally; otherwise served (few
    tokens)."""
    validated = expected_grpc(request, served.system.router.tokenizer, served.system.limits)
    validated = validated if servable(validated) else None
    # a copy: hypothesis may show the original
    request = pb.GenerateRequest.FromString(request.SerializeToString())
    if validated is not None:
        request.sampling.max_tokens = SERVED_MAX_TOKENS
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
    try:
        responses = list(stub.Generate(request, timeout=60))
    except grpc.RpcError as error:
        assert validated is None, (error.code(), error.details(), request)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (
            error.code(),
            error.details(),
            request,
        )
        return
    assert validated is not None, request
    assert responses[-1].finish_reason in ("stop", "length")
    assert 1 <= sum(len(r.token_ids) for r in responses) <= SERVED_MAX_TOKENS


@OVER_THE_WIRE
@given(request=generate_requests())
def test_fuzzed_grpc_requests_get_invalid_argument_or_are_served(served, stub, request):
    check_grpc(served, stub, request)


def test_a_prompt_of_no_tokens_gets_invalid_argument(served, stub):
    check_grpc(
        served, stub, pb.GenerateRequest(text="\x1d", sampling=pb.SamplingParams(max_tokens=2))
    )


@st.composite
def mutated_bytes(draw) -> bytes:
    """A serialized `GenerateRequest` truncated, with a byte changed or inserted, or any bytes."""
    raw = draw(generate_requests()).SerializeToString()
    how = draw(st.sampled_from(["truncate", "change", "insert", "any"]))
    at = draw(st.integers(0, len(raw)))
    if how == "truncate":
        return raw[:at]
    if how == "change" and raw:
        at = min(at, len(raw) - 1)
        return raw[:at] + bytes([raw[at] ^ draw(st.integers(1, 255))]) + raw[at + 1 :]
    if how == "insert":
        return raw[:at] + draw(st.binary(min_size=1, max_size=4)) + raw[at:]
    return draw(st.binary(max_size=48))


@OVER_THE_WIRE
@given(raw=mutated_bytes())
def test_fuzzed_grpc_bytes_get_invalid_argument_or_are_served(served, channel, stub, raw):
    try:
        request = pb.GenerateRequest.FromString(raw)
    except DecodeError:
        # not a GenerateRequest at all (corrupt wire format, a string that is not UTF-8)
        generate = channel.unary_stream("/pdserve.v1.Generation/Generate")  # bytes as they are
        with pytest.raises(grpc.RpcError) as refused:
            list(generate(raw, timeout=60))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (
            raw,
            refused.value.details(),
        )
        return
    check_grpc(served, stub, request)


def test_the_server_still_serves_after_the_fuzz(served, stub):
    """Runs after the fuzz (file order): nothing is left running or holding KV, and both doors
    answer."""
    stats = served.wait_idle()
    assert stats.requests_in_flight == 0 and all(
        w.kv_blocks_free == w.kv_blocks_total for w in stats.workers
    )
    assert all(w.state == "ready" for w in stats.workers) and len(stats.workers) == 2
    sampling = pb.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    request = pb.GenerateRequest(text="The capital of France is", sampling=sampling)
    assert sum(len(r.token_ids) for r in stub.Generate(request, timeout=60)) == 4
    body = {
        "model": served.config.model_name,
        "prompt": "Hello",
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
    status, _, answer = post(served, "/v1/completions", json_bytes(body), "application/json")
    assert status == 200 and json.loads(answer)["usage"]["completion_tokens"] == 4
