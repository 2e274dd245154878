"""vLLM's server extras in its shapes: `POST /tokenize` (a prompt, or chat messages through the
model's template), `POST /detokenize` and `GET /version`. Bodies in, bodies out; errors are
`ApiError`s naming the field."""

from __future__ import annotations

from importlib import metadata
from typing import Any

from engine.tokenizer import Tokenizer
from router.openai_api import ApiError, content_text, invalid

MAX_TOKENIZE_BYTES = 1 << 20  # as the validator's prompt limit


def tokenize(body: dict, tokenizer: Tokenizer, max_model_len: int) -> dict:
    """`{prompt, add_special_tokens (true)}` or `{messages, add_generation_prompt (true)}` ->
    `{count, max_model_len, tokens, token_strs}` (token_strs with `return_token_strs`)."""
    unknown = set(body) - {
        "model",
        "prompt",
        "messages",
        "add_special_tokens",
        "add_generation_prompt",
        "return_token_strs",
    }
    if unknown:
        raise invalid(sorted(unknown)[0], "unrecognized request argument")
    if ("prompt" in body) == ("messages" in body):
        raise invalid("prompt", "send exactly one of prompt (a string) and messages")
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise invalid("prompt", "must be a string")
        _check_size(len(prompt.encode("utf-8")), "prompt")
        ids = tokenizer.encode(prompt, _flag(body, "add_special_tokens", True))
    else:
        ids = _chat_ids(body, tokenizer)
    strings = [tokenizer.id_to_token(t) for t in ids]
    return {
        "count": len(ids),
        "max_model_len": max_model_len,
        "tokens": ids,
        "token_strs": strings if _flag(body, "return_token_strs", False) else None,
    }


def detokenize(body: dict, tokenizer: Tokenizer, vocab_size: int) -> dict:
    """`{tokens: [ids]}` -> `{prompt: text}`."""
    unknown = set(body) - {"model", "tokens"}
    if unknown:
        raise invalid(sorted(unknown)[0], "unrecognized request argument")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in tokens
    ):
        raise invalid("tokens", f"must be an array of token ids in [0, {vocab_size})")
    return {"prompt": tokenizer.decode(tokens)}


def version() -> dict:
    try:
        return {"version": metadata.version("pdserve")}
    except metadata.PackageNotFoundError:
        return {"version": "unknown"}


def _chat_ids(body: dict, tokenizer: Tokenizer) -> list[int]:
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "must be a non-empty array of {role, content}")
    rendered = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid(f"messages[{index}]", "must be an object with role and content")
        content = content_text(message.get("content"), f"messages[{index}]")
        rendered.append({"role": message["role"], "content": content})
    _check_size(sum(len(m["content"].encode("utf-8")) for m in rendered), "messages")
    try:
        return tokenizer.encode_chat(rendered, _flag(body, "add_generation_prompt", True))
    except Exception as error:  # no template, or the template's own raise_exception
        raise invalid("messages", f"rejected by the chat template: {error}") from error


def _flag(body: dict, name: str, default: bool) -> bool:
    value: Any = body.get(name, default)
    if not isinstance(value, bool):
        raise invalid(name, "must be a boolean")
    return value


def _check_size(size: int, field: str) -> None:
    if size > MAX_TOKENIZE_BYTES:
        raise ApiError(413, f"{field}: is larger than {MAX_TOKENIZE_BYTES} bytes", field)
