"""Turning a public `GenerateRequest` into a validated internal request, or a
`RequestValidationError` that names the field and the limit (the router sends it as
INVALID_ARGUMENT)."""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass

from google.protobuf.unknown_fields import UnknownFieldSet

from engine.guided import GrammarError, check as check_grammar
from engine.sampling_params import GuidedDecoding, SamplingParams
from engine.tokenizer import Tokenizer

MAX_REQUEST_ID_CHARS = 128
CHAT_ROLES = ("system", "user", "assistant", "tool")


class RequestValidationError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


@dataclass(frozen=True)
class ValidationLimits:
    # served: the model's context, or less where a worker's KV cache holds less
    max_context_tokens: int
    vocab_size: int
    max_prompt_bytes: int = 1 << 20
    max_tokens_default: int = 16
    model_context_tokens: int = 0  # the model's own context (0: the same as max_context_tokens)

    def describe_context(self) -> str:
        model = self.model_context_tokens
        if not model or model == self.max_context_tokens:
            return f"the model's context is {self.max_context_tokens} tokens"
        return (
            f"this server's context is {self.max_context_tokens} tokens (the model's is {model}; "
            f"a worker's KV cache holds {self.max_context_tokens}: see --kv-cache-mib)"
        )


@dataclass(frozen=True)
class ValidatedRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


def _check_no_unknown_fields(message, path: str) -> None:
    unknown = UnknownFieldSet(message)
    if len(unknown):
        raise RequestValidationError(
            path or "request", f"unknown field number {unknown[0].field_number}"
        )
    for descriptor, value in message.ListFields():
        if descriptor.message_type is None or descriptor.message_type.GetOptions().map_entry:
            continue  # scalars, and maps of scalars (logit_bias)
        name = f"{path}.{descriptor.name}" if path else descriptor.name
        values = value if descriptor.is_repeated else [value]
        for item in values:
            _check_no_unknown_fields(item, name)


def validate(request, tokenizer: Tokenizer, limits: ValidationLimits) -> ValidatedRequest:
    _check_no_unknown_fields(request, "")
    request_id = request.request_id or uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable():
        raise RequestValidationError(
            "request_id", f"must be printable and at most {MAX_REQUEST_ID_CHARS} characters"
        )
    prompt_ids = _prompt_ids(request, tokenizer, limits)
    if not prompt_ids:
        raise RequestValidationError("prompt", "encodes to no tokens")
    if len(prompt_ids) >= limits.max_context_tokens:
        raise RequestValidationError(
            "prompt",
            f"has {len(prompt_ids)} tokens; {limits.describe_context()} "
            "(prompt plus at least one output token)",
        )
    params = _sampling_params(request.sampling, limits)
    if request.sampling.HasField("guided"):
        params = dataclasses.replace(
            params, guided=_guided(request.sampling.guided, len(prompt_ids))
        )
    room = limits.max_context_tokens - len(prompt_ids)
    if params.max_tokens > room:  # OpenAI-style: cut to the context
        params = dataclasses.replace(
            params, max_tokens=room, min_tokens=min(params.min_tokens, room)
        )
    if params.presence_penalty or params.frequency_penalty:
        # a migrated request's re-prefilled output still counts as output
        params = dataclasses.replace(params, prompt_tokens=len(prompt_ids))
    return ValidatedRequest(request_id, prompt_ids, params)


def _prompt_ids(request, tokenizer: Tokenizer, limits: ValidationLimits) -> list[int]:
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise RequestValidationError("prompt", "is required (text, token_ids or chat)")
    if kind == "text":
        if not request.text:
            raise RequestValidationError("prompt.text", "is empty")
        if len(request.text.encode("utf-8")) > limits.max_prompt_bytes:
            raise RequestValidationError(
                "prompt.text", f"is larger than {limits.max_prompt_bytes} bytes"
            )
        return tokenizer.encode(request.text)
    if kind == "token_ids":
        ids = list(request.token_ids.ids)
        if not ids:
            raise RequestValidationError("prompt.token_ids", "is empty")
        bad = next((t for t in ids if t >= limits.vocab_size), None)
        if bad is not None:
            raise RequestValidationError(
                "prompt.token_ids",
                f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})",
            )
        return ids
    messages = list(request.chat.messages)
    if not messages:
        raise RequestValidationError("prompt.chat.messages", "is empty")
    total_bytes = 0
    for index, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise RequestValidationError(
                f"prompt.chat.messages[{index}].role",
                f"must be one of {', '.join(CHAT_ROLES)}, got {message.role!r}",
            )
        total_bytes += len(message.content.encode("utf-8"))
    if total_bytes > limits.max_prompt_bytes:
        raise RequestValidationError(
            "prompt.chat.messages", f"are larger than {limits.max_prompt_bytes} bytes in all"
        )
    if not any(m.content for m in messages):
        raise RequestValidationError("prompt.chat.messages", "hold no content")
    tools = _json_field(request.chat.tools_json, "prompt.chat.tools", list)
    try:
        return tokenizer.encode_chat(
            [_template_message(m, i, tokenizer) for i, m in enumerate(messages)], tools=tools
        )
    except RequestValidationError:
        raise
    except Exception as error:  # a template's own raise_exception, e.g. roles out of order
        raise RequestValidationError(
            "prompt.chat.messages", f"rejected by the chat template: {error}"
        ) from error


def _json_field(text: str, field: str, kind: type):
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise RequestValidationError(field, f"is not valid JSON: {error}") from error
    if not isinstance(value, kind):
        raise RequestValidationError(field, f"must be a JSON {kind.__name__}")
    return value


def _template_message(message, index: int, tokenizer: Tokenizer) -> dict:
    """A message as chat templates read it (HF's convention): tool calls with their arguments as
    objects. A template with no tool format sees an assistant's calls as its content, the JSON the
    model was constrained to write them in: `[{"name": ..., "parameters": {...}}]`."""
    rendered: dict = {"role": message.role, "content": message.content}
    if message.tool_call_id:
        rendered["tool_call_id"] = message.tool_call_id
    if message.name:
        rendered["name"] = message.name
    where = f"prompt.chat.messages[{index}].tool_calls"
    calls = _json_field(message.tool_calls_json, where, list)
    if not calls:
        return rendered
    functions = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestValidationError(
                where, "each must be {type, id, function: {name, arguments}}"
            )
        arguments = function.get("arguments")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments or {}
        except json.JSONDecodeError as error:
            raise RequestValidationError(
                f"{where}.function.arguments", f"is not valid JSON: {error}"
            ) from error
        functions.append({"name": function["name"], "arguments": arguments})
    if tokenizer.chat_template is not None and "tool_calls" in tokenizer.chat_template:
        rendered["tool_calls"] = [
            {**call, "function": function} for call, function in zip(calls, functions)
        ]
    elif not message.content:
        rendered["content"] = json.dumps(
            [{"name": f["name"], "parameters": f["arguments"]} for f in functions]
        )
    return rendered


def _guided(guided, prompt_tokens: int) -> GuidedDecoding:
    kind = guided.WhichOneof("constraint")
    field = f"sampling.guided.{kind or 'constraint'}"
    try:
        if kind is None:
            raise ValueError("is empty: set json_schema, regex or choice")
        spec = GuidedDecoding(
            json_schema=guided.json_schema if kind == "json_schema" else None,
            regex=guided.regex if kind == "regex" else None,
            choice=tuple(guided.choice.choices),
            prompt_tokens=prompt_tokens,
        )
        check_grammar(spec)
    except (ValueError, GrammarError) as error:
        raise RequestValidationError(field, str(error)) from error
    return spec


def _sampling_params(sampling, limits: ValidationLimits) -> SamplingParams:
    fields = {
        "max_tokens": sampling.max_tokens
        if sampling.HasField("max_tokens")
        else limits.max_tokens_default,
        "temperature": sampling.temperature if sampling.HasField("temperature") else 1.0,
        "top_p": sampling.top_p if sampling.HasField("top_p") else 1.0,
        "top_k": sampling.top_k if sampling.HasField("top_k") else None,
        "seed": sampling.seed if sampling.HasField("seed") else None,
        "stop": tuple(sampling.stop),
        "stop_token_ids": tuple(sampling.stop_token_ids),
        "ignore_eos": sampling.ignore_eos,
        "logprobs": sampling.logprobs if sampling.HasField("logprobs") else None,
        "prompt_logprobs": sampling.prompt_logprobs
        if sampling.HasField("prompt_logprobs")
        else None,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "repetition_penalty": sampling.repetition_penalty
        if sampling.HasField("repetition_penalty")
        else 1.0,
        "logit_bias": tuple(sorted(sampling.logit_bias.items())),
        "min_tokens": sampling.min_tokens,
        "min_p": sampling.min_p,
    }
    for name, ids in (
        ("stop_token_ids", fields["stop_token_ids"]),
        ("logit_bias", [t for t, _ in fields["logit_bias"]]),
    ):
        bad = [t for t in ids if t >= limits.vocab_size]
        if bad:
            raise RequestValidationError(
                f"sampling.{name}",
                f"token id {bad[0]} is outside the vocabulary [0, {limits.vocab_size})",
            )
    try:
        return SamplingParams(**fields)
    except ValueError as error:  # SamplingParams names the field first
        field = str(error).split(" ", 1)[0]
        raise RequestValidationError(f"sampling.{field}", str(error).split(" ", 1)[1]) from error
