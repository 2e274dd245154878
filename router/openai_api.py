"""The OpenAI wire format: request bodies of `/v1/completions` and `/v1/chat/completions` turned
into the public `GenerateRequest` (then validated like every gRPC request), and our stream items
turned into OpenAI response objects and SSE chunks.

Errors are `ApiError`s carrying the HTTP status and OpenAI's error shape
(`error.message/type/param`), with `param` naming the offending field as the client spelled it.
Unknown fields are refused, as OpenAI does; known fields we do not implement are accepted only at
their neutral value (for example `suffix: ""`), otherwise refused with a message saying so.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from engine.sampling_params import MAX_LOGPROBS
from pdserve_proto import pdserve_pb2 as pb
from router.choices import MAX_CHOICES, Choices
from router.openai_logprobs import Entry, TokenTexts, chat_logprobs, completion_logprobs
from router.openai_tools import ToolCallStream, ToolChoice, parse_calls, read_tools
from router.output import FinalInfo, StreamItem

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    409: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}

# Accepted only at these (neutral) values: the engine implements nothing else for them.
_NEUTRAL = {
    "suffix": ("",),
    "parallel_tool_calls": (True, False),
    "functions": ([],),
    "function_call": ("none",),
}
# per endpoint (chat?): the other's feature
_NEUTRAL_IN = {
    False: {"top_logprobs": (0,), "tools": ([],), "tool_choice": ("none",)},
    True: {"echo": (False,)},
}
# numbers passed on as they are (SamplingParams checks their ranges): OpenAI's and vLLM's
PENALTY_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
# vLLM's structured-output extensions (both endpoints) and OpenAI's chat `response_format`
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice")
_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "user",
    "ignore_eos",
    "stop_token_ids",
    "logprobs",
    "top_logprobs",
    "echo",
    "tools",
    "tool_choice",
    "n",
    "best_of",
    *PENALTY_FIELDS,
    "logit_bias",
    "min_tokens",
    *GUIDED_FIELDS,
    *_NEUTRAL,
}
COMPLETION_FIELDS = frozenset(_COMMON | {"prompt"})
CHAT_FIELDS = frozenset(_COMMON | {"messages", "max_completion_tokens", "response_format"})
CHAT_MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})
MAX_PROMPTS = 256  # prompts in one completion request (each counted by the admission limits)
CHAT_ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None
    ):
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {
            "error": {
                "message": str(self),
                "type": ERROR_TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param)


@dataclass(frozen=True)
class ParsedRequest:
    """An OpenAI request as a `GenerateRequest` plus how the client wants the answer."""

    request: "pb.GenerateRequest"
    chat: bool
    stream: bool
    include_usage: bool
    max_tokens_param: str  # the name the client used, for error messages
    # Logprobs asked: completions' `logprobs=N`, chat's `top_logprobs` with `logprobs: true`; None:
    # not.
    logprobs: Optional[int] = None
    # completions: the prompt's text (and with logprobs, its tokens') before the answer
    echo: bool = False
    # echo with max_tokens 0: the prompt scored, the one token generated is dropped
    echo_only: bool = False
    # the field that asked for a grammar (response_format, guided_json, ...), for error messages
    guided_param: Optional[str] = None
    tool_choice: Optional[ToolChoice] = None  # chat with tools: how calls are read from the answer
    choices: Choices = Choices()  # n and best_of (router/choices.py)
    # completions with an array of prompts: the requests of the prompts after the first
    batch: tuple["pb.GenerateRequest", ...] = ()
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk

    @property
    def requests(self) -> tuple["pb.GenerateRequest", ...]:
        """One request per prompt (only completions have more than one)."""
        return (self.request, *self.batch)


def parse_body(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ApiError(400, f"request body is not valid UTF-8 (byte {error.start})") from error
    try:
        body = json.loads(text)
    except json.JSONDecodeError as error:
        raise ApiError(
            400,
            f"request body is not valid JSON: {error.msg} at line {error.lineno} column "
            f"{error.colno}",
        ) from error
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


def _has_lone_surrogate(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def parse_request(body: dict, chat: bool, served_model: str, request_id: str) -> ParsedRequest:
    # JSON's "\\ud800" escapes decode to text that no UTF-8 encoder takes
    if _has_lone_surrogate(body):
        raise ApiError(
            400,
            "request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff): not valid "
            "Unicode",
        )
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise invalid(unknown[0], "unrecognized request argument")
    for name, neutral in {**_NEUTRAL, **_NEUTRAL_IN[chat]}.items():
        if name in body and not _is_neutral(body[name], neutral):
            raise invalid(
                name,
                f"only {json.dumps(neutral[0])} is supported, got {json.dumps(body[name])[:40]}",
            )
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "is required (a string; GET /v1/models lists them)")
    if model != served_model:
        raise ApiError(
            404,
            f"The model `{model}` does not exist; this server serves `{served_model}`",
            "model",
            "model_not_found",
        )

    request = pb.GenerateRequest(request_id=request_id)
    tool_choice = None
    guided_param = _guided(body, request.sampling.guided, chat)
    if chat:
        _chat_prompt(body.get("messages"), request)
        tools = read_tools(body, invalid)
        tool_choice = tools.choice
        if tools.tools is not None:
            request.chat.tools_json = json.dumps(tools.tools, ensure_ascii=False)
        if tools.schema is not None:
            if guided_param is not None:
                raise invalid(guided_param, "cannot be combined with tool_choice forcing a call")
            request.sampling.guided.json_schema = json.dumps(tools.schema, ensure_ascii=False)
            guided_param = "tool_choice"
    else:
        prompts = _completion_prompts(body.get("prompt"))
        _set_prompt(request, prompts[0])
    max_tokens_param = (
        "max_completion_tokens"
        if chat and body.get("max_completion_tokens") is not None
        else "max_tokens"
    )
    echo = False if chat else _typed(body, "echo", bool, False)
    echo_only = (
        echo and body.get("max_tokens") == 0 and not isinstance(body.get("max_tokens"), bool)
    )
    if echo_only:  # as vLLM: one token is generated (the prefill's), and dropped from the answer
        body = {**body, "max_tokens": 1}
    _sampling(body, request.sampling, max_tokens_param)
    logprobs = _chat_logprobs(body) if chat else _completion_logprobs(body)
    if logprobs is not None:
        request.sampling.logprobs = logprobs
        if echo:
            request.sampling.prompt_logprobs = logprobs
    stream = _typed(body, "stream", bool, False)
    options = body.get("stream_options")
    include_usage = continuous_usage = False
    if options is not None:
        if not stream:
            raise invalid("stream_options", "is only allowed when stream is true")
        if not isinstance(options, dict) or set(options) - {
            "include_usage",
            "continuous_usage_stats",
        }:
            raise invalid(
                "stream_options",
                "must be an object with include_usage (bool) and continuous_usage_stats (bool)",
            )
        include_usage = _typed(
            options, "include_usage", bool, False, "stream_options.include_usage"
        )
        # vLLM's: usage in every chunk too (with include_usage, as vLLM)
        continuous_usage = include_usage and _typed(
            options,
            "continuous_usage_stats",
            bool,
            False,
            "stream_options.continuous_usage_stats",
        )
    _typed(body, "user", str, None)
    choices = _choices(body, stream)
    batch = []
    for prompt in [] if chat else prompts[1:]:  # the same request but for its prompt
        other = pb.GenerateRequest()
        other.CopyFrom(request)
        other.ClearField("prompt")
        _set_prompt(other, prompt)
        batch.append(other)
    return ParsedRequest(
        request,
        chat,
        stream,
        include_usage,
        max_tokens_param,
        logprobs,
        echo,
        echo_only,
        guided_param,
        tool_choice,
        choices,
        tuple(batch),
        continuous_usage,
    )


def _choices(body: dict, stream: bool) -> Choices:
    """`n` and `best_of` (default n), each 1..MAX_CHOICES; best_of > n is not streamed (as vLLM)."""
    n = _typed(body, "n", int, 1)
    best_of = _typed(body, "best_of", int, n)
    for name, value in (("n", n), ("best_of", best_of)):
        if not 1 <= value <= MAX_CHOICES:
            raise invalid(name, f"must be in [1, {MAX_CHOICES}], got {value}")
    if best_of < n:
        raise invalid("best_of", f"must be >= n ({n}), got {best_of}")
    if best_of > n and stream:
        raise invalid("best_of", f"cannot exceed n ({n}) when streaming, got {best_of}")
    return Choices(n, best_of)


def _guided(body: dict, guided: "pb.Guided", chat: bool) -> Optional[str]:
    """Fills `guided` from response_format (chat) or vLLM's guided_* fields; returns the field
    used."""
    asked = [name for name in GUIDED_FIELDS if body.get(name) is not None]
    response_format = body.get("response_format") if chat else None
    if response_format is not None and response_format != {"type": "text"}:
        asked.insert(0, "response_format")
    if len(asked) > 1:
        raise invalid(asked[1], f"cannot be combined with {asked[0]}")
    if not asked:
        return None
    name = asked[0]
    value = body[name]
    if name == "response_format":
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "json_object":
            guided.json_schema = '{"type": "object"}'
        elif kind == "json_schema":
            spec = value.get("json_schema")
            schema = spec.get("schema", {"type": "object"}) if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise invalid(
                    "response_format.json_schema",
                    "must be an object {name, schema: a JSON schema object}",
                )
            guided.json_schema = json.dumps(schema, ensure_ascii=False)
        else:
            raise invalid(
                name,
                "must be {type: 'text'}, {type: 'json_object'} or {type: 'json_schema', "
                "json_schema: {name, schema}}",
            )
    elif name == "guided_json":
        if isinstance(value, str):
            guided.json_schema = value
        elif isinstance(value, dict):
            guided.json_schema = json.dumps(value, ensure_ascii=False)
        else:
            raise invalid(name, "must be a JSON schema (an object, or its JSON text)")
    elif name == "guided_regex":
        guided.regex = _typed(body, name, str, "")
    else:
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise invalid(name, "must be a non-empty array of strings")
        guided.choice.choices.extend(value)
    return name


def _completion_logprobs(body: dict) -> Optional[int]:
    """`logprobs`: how many alternatives per token (0..20), or null for none."""
    value = body.get("logprobs")
    if value is None:
        return None
    if not _KINDS[int][1](value) or not 0 <= value <= MAX_LOGPROBS:
        raise invalid(
            "logprobs",
            f"must be an integer in [0, {MAX_LOGPROBS}] or null, got {json.dumps(value)[:40]}",
        )
    return value


def _chat_logprobs(body: dict) -> Optional[int]:
    """`logprobs: true` and `top_logprobs` (0..20, default 0): the alternatives per token; None
    without logprobs."""
    asked = _typed(body, "logprobs", bool, False)
    top = body.get("top_logprobs")
    if top is not None and (not _KINDS[int][1](top) or not 0 <= top <= MAX_LOGPROBS):
        raise invalid(
            "top_logprobs",
            f"must be an integer in [0, {MAX_LOGPROBS}] or null, got {json.dumps(top)[:40]}",
        )
    if top and not asked:
        raise invalid("top_logprobs", "requires logprobs to be true")
    return (top or 0) if asked else None


_KINDS = {
    bool: ("a boolean", lambda v: isinstance(v, bool)),
    int: ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    float: (
        "a finite number",
        lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
    ),
    str: ("a string", lambda v: isinstance(v, str)),
}


def _typed(body: dict, name: str, kind: type, default, param: Optional[str] = None):
    """`body[name]` if it has JSON type `kind`, `default` if absent or null, else an error naming
    it."""
    value = body.get(name)
    if value is None:
        return default
    spelled, matches = _KINDS[kind]
    if not matches(value):
        raise invalid(param or name, f"must be {spelled}, got {json.dumps(value)[:40]}")
    return value


def _is_neutral(value: Any, allowed: tuple) -> bool:
    return value is None or any(type(value) is type(v) and value == v for v in allowed)


def _completion_prompts(prompt: Any) -> list:
    """The prompts of a completion: a string, an array of token ids, or an array of either (a batch,
    answered as one response with each prompt's choices)."""
    if prompt is None:
        raise invalid("prompt", "is required")
    batch = (
        prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)
        else [prompt]
    )
    if len(batch) > MAX_PROMPTS:
        raise invalid("prompt", f"holds {len(batch)} prompts; at most {MAX_PROMPTS} per request")
    for index, one in enumerate(batch):
        where = "prompt" if len(batch) == 1 else f"prompt[{index}]"
        if isinstance(one, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in one
        ):
            if any(t < 0 or t >= 2**32 for t in one):
                raise invalid("prompt", f"{where}: token ids must be non-negative")
        elif not isinstance(one, str):
            raise invalid(
                "prompt",
                f"{where}: must be a string or an array of token ids (or an array of those)",
            )
    return batch


def _set_prompt(request: "pb.GenerateRequest", prompt) -> None:
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)


def _chat_prompt(messages: Any, request: "pb.GenerateRequest") -> None:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "is required: a non-empty array of {role, content}")
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise invalid(where, "must be an object with role and content")
        extra = set(message) - CHAT_MESSAGE_FIELDS
        if extra:
            raise invalid(f"{where}.{sorted(extra)[0]}", "is not supported")
        role = message.get("role")
        if not isinstance(role, str):
            raise invalid(f"{where}.role", "is required (a string)")
        added = request.chat.messages.add(
            role=CHAT_ROLE_ALIASES.get(role, role),
            content=content_text(message.get("content"), where),
        )
        calls = message.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise invalid(f"{where}.tool_calls", "is an assistant's array of calls")
            added.tool_calls_json = json.dumps(calls, ensure_ascii=False)
        for name in ("tool_call_id", "name"):
            value = _typed(message, name, str, "", f"{where}.{name}")
            setattr(added, name, value)


def content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for index, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise invalid(
                    f"{where}.content[{index}]",
                    "only parts of {type: 'text', text: string} are supported",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(f"{where}.content", "must be a string or an array of text parts")


def _sampling(body: dict, sampling: "pb.SamplingParams", max_tokens_param: str) -> None:
    max_tokens = _typed(body, max_tokens_param, int, None)
    if max_tokens is not None:
        if max_tokens < 1:
            zero = (
                " (0 only with echo: true, to score the prompt)"
                if max_tokens == 0 and "prompt" in body
                else ""
            )
            raise invalid(max_tokens_param, f"must be >= 1{zero}, got {max_tokens}")
        sampling.max_tokens = min(max_tokens, 2**32 - 1)
    for name in ("temperature", "top_p"):
        value = _typed(body, name, float, None)
        if value is not None:
            if not 0 <= value <= 1e6:
                raise invalid(name, f"is out of range: {value}")
            setattr(sampling, name, value)
    top_k = _typed(body, "top_k", int, None)
    if top_k is not None and top_k not in (-1, 0):  # vLLM's spelling of "no top-k"
        if top_k < 0:
            raise invalid("top_k", f"must be >= 1, or -1/0 for none; got {top_k}")
        sampling.top_k = min(top_k, 2**32 - 1)
    seed = _typed(body, "seed", int, None)
    if seed is not None:
        if not 0 <= seed < 2**63:
            raise invalid("seed", f"must be in [0, 2**63), got {seed}")
        sampling.seed = seed
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("stop", "must be a string or an array of strings")
    sampling.stop.extend(stops)
    stop_token_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_token_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in stop_token_ids
    ):
        raise invalid("stop_token_ids", "must be an array of non-negative token ids")
    sampling.stop_token_ids.extend(stop_token_ids)
    sampling.ignore_eos = _typed(body, "ignore_eos", bool, False)
    for name in PENALTY_FIELDS:
        value = _typed(body, name, float, None)
        if value is not None:
            setattr(sampling, name, value)
    min_tokens = _typed(body, "min_tokens", int, None)
    if min_tokens is not None:
        if not 0 <= min_tokens < 2**32:
            raise invalid("min_tokens", f"must be >= 0, got {min_tokens}")
        sampling.min_tokens = min_tokens
    _logit_bias(body.get("logit_bias"), sampling)


def _logit_bias(value: Any, sampling: "pb.SamplingParams") -> None:
    """OpenAI's `{"token id": bias}`: the ids as strings (or numbers), biases in [-100, 100]."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise invalid("logit_bias", "must be an object mapping token ids to biases")
    for key, bias in value.items():
        try:
            token_id = int(key)
        except ValueError:
            token_id = -1
        if not 0 <= token_id < 2**32:
            raise invalid("logit_bias", f"keys must be token ids (integers >= 0), got {key!r}")
        if not _KINDS[float][1](bias):
            raise invalid(
                "logit_bias", f"values must be numbers, got {json.dumps(bias)[:40]} for {key}"
            )
        sampling.logit_bias[token_id] = bias


def openai_param(field: str, parsed: ParsedRequest) -> str:
    """A validator field name (`sampling.top_p`, `prompt.chat.messages[0].role`) as the OpenAI
    client spells it."""
    if field.startswith("sampling.guided") and parsed.guided_param is not None:
        return parsed.guided_param
    if field.startswith("prompt.chat.tools"):
        return "tools"
    if field.startswith("sampling."):
        name = field.removeprefix("sampling.")
        return parsed.max_tokens_param if name == "max_tokens" else name
    if field.startswith("prompt.chat."):
        return field.removeprefix("prompt.chat.")
    if field.startswith("prompt"):
        return "messages" if parsed.chat else "prompt"
    return field


# -- responses ---------------------------------------------------------------------------------


def usage_body(finals: Sequence[FinalInfo], per_prompt: int = 1) -> dict:
    """Usage of the choices that ended with `finals`, in index order, `per_prompt` choices to each
    prompt: each prompt counted once, their tokens summed."""
    prompt_tokens = sum(final.prompt_tokens for final in finals[::per_prompt])
    completion_tokens = sum(final.completion_tokens for final in finals)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": finals[0].cached_prompt_tokens},
    }


def finish_reason(final: FinalInfo) -> str:
    return "length" if final.finish_reason == "length" else "stop"


@dataclass
class ResponseShape:
    """Builds one request's response objects: the non-streaming body and the SSE chunks (each
    choice's, by its index). `texts` and `prompt_ids` serve logprobs and echo; `prompt_text` is what
    echo returns."""

    parsed: ParsedRequest
    model: str
    request_id: str
    texts: Optional[TokenTexts] = None
    prompt_ids: Sequence[Sequence[int]] = ((),)  # per prompt (a batch of completions has several)
    prompt_text: Sequence[str] = ("",)
    created: int = 0
    # per choice: text streamed so far (where its next chunk's text_offset starts), its tool calls
    _streamed_chars: dict[int, int] = field(default_factory=dict)
    _tool_streams: dict[int, ToolCallStream] = field(default_factory=dict)
    _sent_tokens: dict[int, int] = field(default_factory=dict)  # per choice (continuous usage)

    def __post_init__(self) -> None:
        self.created = int(time.time())
        self.id = ("chatcmpl-" if self.parsed.chat else "cmpl-") + self.request_id

    def _envelope(self, chunk: bool) -> dict:
        kind = ("chat.completion" if self.parsed.chat else "text_completion") + (
            ".chunk" if chunk and self.parsed.chat else ""
        )
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _prompt_of(self, index: int) -> int:
        return index // self.parsed.choices.best_of

    def _answer(
        self, items: Sequence[StreamItem], opening: bool, prompt: int = 0
    ) -> tuple[str, list[Entry]]:
        """The items' text and logprob entries; the opening one of an echo with the prompt's before
        them."""
        text = "".join(item.text for item in items)
        entries = [
            entry
            for item in items
            if item.logprobs is not None
            for entry in zip(item.token_ids, item.logprobs)
        ]
        if self.parsed.echo_only:
            text, entries = "", []
        if self.parsed.echo and opening:
            prompt_logprobs = next(
                (item.prompt_logprobs for item in items if item.prompt_logprobs is not None), None
            )
            text = self.prompt_text[prompt] + text
            entries = [*zip(self.prompt_ids[prompt], prompt_logprobs or ()), *entries]
        return text, entries

    def _logprobs(self, entries: list[Entry], text_offset: int = 0) -> Optional[dict]:
        if self.parsed.logprobs is None:
            return None
        if self.parsed.chat:
            return chat_logprobs(entries, self.texts, self.parsed.logprobs)
        return completion_logprobs(entries, self.texts, self.parsed.logprobs, text_offset)

    def _choice(
        self,
        index: int,
        text: Optional[str],
        reason: Optional[str],
        chunk: bool,
        first: bool = False,
        logprobs: Optional[dict] = None,
        tool_calls: Optional[list] = None,
    ) -> dict:
        if not self.parsed.chat:
            return {
                "index": index,
                "text": text or "",
                "logprobs": logprobs,
                "finish_reason": reason,
            }
        if tool_calls and reason == "stop" and self.parsed.tool_choice.mode != "named":
            reason = "tool_calls"  # as OpenAI: a forced named call finishes with "stop"
        if chunk:
            delta: dict = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        message: dict = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}

    def full(self, choices: Sequence[Sequence[StreamItem]]) -> dict:
        """The whole answer: each choice's stream items (the last one final), in index order."""
        bodies = []
        for index, items in enumerate(choices):
            # after best_of's choosing, n per prompt
            text, entries = self._answer(items, True, index // self.parsed.choices.n)
            calls = None
            if self.parsed.tool_choice is not None:
                text, calls = parse_calls(text, self.parsed.tool_choice)
            reason = finish_reason(items[-1].final)
            logprobs = self._logprobs(entries)
            bodies.append(
                self._choice(index, text, reason, False, logprobs=logprobs, tool_calls=calls)
            )
        finals = [items[-1].final for items in choices]
        usage = usage_body(finals, self.parsed.choices.n)
        return {**self._envelope(False), "choices": bodies, "usage": usage}

    def chunk(self, items: Sequence[StreamItem], first: bool = False, index: int = 0) -> dict:
        """One SSE chunk of choice `index`'s items since its last one sent (their text, and logprobs
        of all their tokens)."""
        final = items[-1].final if items else None
        text, entries = self._answer(items, first, self._prompt_of(index))
        streamed_chars = self._streamed_chars.get(index, 0)
        logprobs = (
            self._logprobs(entries, streamed_chars)
            if entries or (first and self.parsed.echo)
            else None
        )
        self._streamed_chars[index] = streamed_chars + len(text)
        calls = None
        if self.parsed.tool_choice is not None:
            tools = self._tool_streams.setdefault(index, ToolCallStream(self.parsed.tool_choice))
            text, calls = tools.feed(text, final is not None)
        reason = finish_reason(final) if final else None
        body = {
            **self._envelope(True),
            "choices": [self._choice(index, text, reason, True, first, logprobs, calls)],
        }
        if self.parsed.continuous_usage:
            sent = self._sent_tokens.get(index, 0) + sum(len(item.token_ids) for item in items)
            self._sent_tokens[index] = sent
            prompt_tokens = len(self.prompt_ids[self._prompt_of(index)])
            body["usage"] = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": sent,
                "total_tokens": prompt_tokens + sent,
            }
        elif self.parsed.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, finals: Sequence[FinalInfo]) -> dict:
        """`finals` in index order."""
        usage = usage_body(finals, self.parsed.choices.n)
        return {**self._envelope(True), "choices": [], "usage": usage}


def sse(body: dict, dumps: Callable[[Any], str] = json.dumps) -> bytes:
    return f"data: {dumps(body, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"
