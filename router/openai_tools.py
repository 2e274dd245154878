"""Tool calls in the OpenAI chat API: `tools` / `tool_choice` read from a request, the grammar that
forces a call, and the calls parsed back out of the answer (whole, or as a stream goes).

- `tool_choice` "none": the template gets no tools, the answer is text.
- a named function: the answer is constrained to that function's `parameters` schema; it is the
  call's arguments (as vLLM does).
- "required": the answer is constrained to a JSON array of `{"name", "parameters"}` objects, at
  least one, each naming a given tool (as vLLM does); every item is a call.
- "auto" (the default with tools): the template gets the tools and the model chooses. Calls are
  parsed from the format of Hermes / Qwen templates (and of SmolLM2's larger siblings' training):
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; an answer without one is text. The
  default model's template (SmolLM2-135M-Instruct) has no tool format: it ignores `tools`, so its
  "auto" answers are text unless the model writes that format by itself.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "auto", "required" or "named"
    name: Optional[str] = None  # the named function

    @property
    def streams_arguments(self) -> bool:
        """A named call's arguments are the answer itself: they stream as they come."""
        return self.mode == "named"


@dataclass(frozen=True)
class ToolRequest:
    tools: Optional[list]  # for the chat template (None: none)
    choice: Optional[ToolChoice]  # None: no calls are parsed
    schema: Optional[dict]  # the grammar forcing a call (required, named)


def read_tools(body: dict, invalid: Callable[[str, str], Exception]) -> ToolRequest:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice", "needs tools")
        return ToolRequest(None, None, None)
    if not isinstance(tools, list):
        raise invalid("tools", "must be an array of {type: 'function', function: {...}}")
    functions: dict[str, dict] = {}
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not function["name"]
        ):
            raise invalid(f"tools[{index}]", "must be {type: 'function', function: {name, ...}}")
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise invalid(f"tools[{index}].function.parameters", "must be a JSON schema object")
        functions[function["name"]] = parameters or {"type": "object"}
    if choice in (None, "auto"):
        return ToolRequest(tools, ToolChoice("auto"), None)
    if choice == "none":
        return ToolRequest(None, None, None)
    if choice == "required":
        items = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, parameters in functions.items()
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if body.get("parallel_tool_calls") is False:
            schema["maxItems"] = 1
        return ToolRequest(tools, ToolChoice("required"), schema)
    name = (
        choice.get("function", {}).get("name")
        if isinstance(choice, dict) and isinstance(choice.get("function"), dict)
        else None
    )
    if not isinstance(name, str):
        raise invalid(
            "tool_choice",
            "must be 'none', 'auto', 'required' or {type: 'function', function: {name}}",
        )
    if name not in functions:
        raise invalid("tool_choice", f"names {name!r}, which is not among the tools")
    return ToolRequest(tools, ToolChoice("named", name=name), functions[name])


def _call(name: str, arguments: Any) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": text},
    }


def parse_calls(text: str, choice: ToolChoice) -> tuple[Optional[str], list[dict]]:
    """The answer as (content, tool calls); an answer that holds no readable call is all content."""
    if choice.mode == "named":
        return None, [_call(choice.name, text)]
    if choice.mode == "required":
        try:
            items = json.loads(text)
            return None, [_call(item["name"], item.get("parameters", {})) for item in items]
        except (ValueError, TypeError, KeyError):
            return text, []
    if HERMES_OPEN not in text:
        return text, []
    calls = []
    for match in _HERMES_CALL.finditer(text):
        try:
            item = json.loads(match.group(1))
            calls.append(_call(item["name"], item.get("arguments", {})))
        except (ValueError, TypeError, KeyError):
            return text, []
    content = text[: text.index(HERMES_OPEN)].strip()
    return content or None, calls


@dataclass
class ToolCallStream:
    """A streamed answer's content and tool-call deltas. Named calls stream their arguments as they
    come; other calls are held until the answer ends and then sent whole, each with its index (text
    that may begin a `<tool_call>` is held back meanwhile)."""

    choice: ToolChoice
    _held: str = ""
    _opened: bool = False
    calls: list[dict] = field(default_factory=list)

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        if self.choice.streams_arguments:
            deltas = []
            if not self._opened:
                self._opened = True
                self.calls = [_call(self.choice.name, "")]
                first = self.calls[0]
                deltas.append({"index": 0, **first, "function": {**first["function"]}})
                deltas[0]["function"]["arguments"] = text
            elif text:
                deltas.append({"index": 0, "function": {"arguments": text}})
            return "", deltas
        self._held += text
        if self.choice.mode == "auto" and not final:
            # send what cannot be the start of a call
            cut = self._held.find(HERMES_OPEN)
            if cut < 0:
                cut = len(self._held) - _partial_suffix(self._held, HERMES_OPEN)
            sent, self._held = self._held[:cut], self._held[cut:]
            return sent, []
        if not final:
            return "", []
        content, self.calls = parse_calls(self._held, self.choice)
        self._held = ""
        deltas = [{"index": i, **call} for i, call in enumerate(self.calls)]
        return content or "", deltas


def _partial_suffix(text: str, marker: str) -> int:
    """How many final characters of `text` are a proper prefix of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
