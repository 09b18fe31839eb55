"""Tool calling for /v1/chat/completions: what a request's tools and tool_choice make of its prompt, its
constraint and its output, and the calls as OpenAI answers and streams them.

- "none": the template sees the tools; the output is content.
- "auto" (the default with tools): the output is free; the server's --tool-call-parser finds calls in it.
- "required": the output is constrained (structured outputs) to a JSON array of one call per element,
  [{"name": <a tool's name>, "parameters": <valid against its schema>}, ...] (one element unless
  parallel_tool_calls), as vLLM constrains it.
- a named function: the output is constrained to that function's arguments.
Under "required" and a named function every call's arguments are valid against the function's JSON Schema.
A call's arguments are the raw JSON text the model wrote, in the response and, in pieces, in the stream.
"""

import functools
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster_configs.structured_outputs import StructuredOutputs
from http_api.errors import APIError
from http_api.tool_parsers import TOOL_PARSERS
from http_api.tool_parsers.base import CallPrefix, CallScanner, ParsedText, ToolParser

ANY_OBJECT = {"type": "object"}  # the arguments of a function that declares no parameters


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools."""

    tools: list[dict] | None  # what the chat template's `tools` sees
    constraint: StructuredOutputs | None  # on the output, when the tool choice forces calls
    new_parser: Callable[[], ToolParser] | None  # one per choice: reads its calls; None: content only


def plan_tools(tools: list[dict] | None, tool_choice, parallel_tool_calls: bool,
               parser_name: str | None) -> ToolPlan:
    """tools: the request's, as dicts ({"type": "function", "function": {...}}); tool_choice: "none",
    "auto", "required", {"type": "function", "function": {"name": ...}} or None (auto with tools)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice asks for a tool call but the request has no tools; send tools "
                                "or drop tool_choice", param="tool_choice")
        return ToolPlan(None, None, None)
    functions = {t["function"]["name"]: t["function"] for t in tools}
    if tool_choice == "none":
        return ToolPlan(tools, None, None)
    if tool_choice in (None, "auto"):
        if parser_name is None:
            raise APIError(400, 'tool_choice "auto" needs the server started with --tool-call-parser '
                                f"({' or '.join(TOOL_PARSERS)}) to find calls in the text; send "
                                'tool_choice "required", a named function, or "none"', param="tool_choice")
        return ToolPlan(tools, None, TOOL_PARSERS[parser_name])
    if tool_choice == "required":
        call = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                 "properties": {"name": {"const": name},
                                "parameters": f.get("parameters") or ANY_OBJECT}}
                for name, f in functions.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
        if not parallel_tool_calls:
            schema["maxItems"] = 1
        return ToolPlan(tools, StructuredOutputs(json=schema), RequiredCallsParser)
    name = tool_choice["function"]["name"]
    if name not in functions:
        raise APIError(400, f"tool_choice names the function {name!r}, which is not among the tools "
                            f"({', '.join(map(repr, functions))})", param="tool_choice")
    return ToolPlan(tools, StructuredOutputs(json=functions[name].get("parameters") or ANY_OBJECT),
                    functools.partial(NamedCallParser, name))


class RequiredCallsParser:
    """The output of tool_choice "required": a JSON array of {"name", "parameters"} objects."""

    def __init__(self):
        self.scan = CallScanner()

    def parse(self, text: str, final: bool) -> ParsedText:
        calls, start = [], text.find("[") + 1
        while start:
            start = text.find("{", start) + 1
            if not start:
                break
            call, end = self.scan(text, start - 1)
            calls.append(call)
            start = end or 0
        return ParsedText("", [c for c in calls if c.name is not None])


class NamedCallParser:
    """The output of a named tool_choice: the function's arguments, the whole text."""

    def __init__(self, name: str):
        self.name = name

    def parse(self, text: str, final: bool) -> ParsedText:
        return ParsedText("", [CallPrefix(self.name, text, final)])


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def message(parsed: ParsedText, call_ids: list[str]) -> dict:
    """The assistant message of a finished choice: content (None when it is only whitespace around calls)
    and tool_calls."""
    content = parsed.content if parsed.content.strip() or not parsed.calls else None
    out = {"role": "assistant", "content": content}
    if parsed.calls:
        out["tool_calls"] = [{"id": call_id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}}
                             for call_id, c in zip(call_ids, parsed.calls)]
    return out


def finish_reason(parsed: ParsedText, reason: str | None) -> str | None:
    return "tool_calls" if parsed.calls and reason == "stop" else reason


@dataclass
class ToolCallStream:
    """One choice's stream deltas as OpenAI streams calls: a call's first delta carries its index, id, type,
    name and the arguments so far; later ones the arguments' next piece. Content goes out as it is parsed,
    except whitespace alone, which waits until it is known not to sit only around calls."""

    parser: ToolParser
    call_ids: list[str] = field(default_factory=list)
    num_content_sent: int = 0
    num_arguments_sent: list[int] = field(default_factory=list)

    def delta(self, text: str, final: bool) -> tuple[dict, ParsedText]:
        """The delta after the text so far (empty: nothing new), and the text parsed."""
        parsed = self.parser.parse(text, final)
        out = {}
        show_content = parsed.content.strip() or (final and not parsed.calls)
        if show_content and len(parsed.content) > self.num_content_sent:
            out["content"] = parsed.content[self.num_content_sent:]
            self.num_content_sent = len(parsed.content)
        calls = []
        for i, call in enumerate(parsed.calls):
            if i == len(self.call_ids):
                self.call_ids.append(new_call_id())
                self.num_arguments_sent.append(len(call.arguments))
                calls.append({"index": i, "id": self.call_ids[i], "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments}})
            elif len(call.arguments) > self.num_arguments_sent[i]:
                piece = call.arguments[self.num_arguments_sent[i]:]
                calls.append({"index": i, "function": {"arguments": piece}})
                self.num_arguments_sent[i] = len(call.arguments)
        if calls:
            out["tool_calls"] = calls
        return out, parsed
