"""What every tool-call parser returns, and the scanner they share for a call's JSON object.

A parser reads the text generated so far (streaming: again after every delta) and returns the content said
outside calls and each call found so far: its name once the name's string is complete, its arguments as the
raw text of their JSON value so far. Each is a prefix of what the finished text gives, so a stream's deltas
are differences (http_api/tool_calls.py) and concatenate to the non-streamed response. Until `final`, a parser
holds back an end of content that may begin a call marker.

A parser instance reads one choice's text as it grows (CallScanner remembers the calls already closed, so a
stream rescans only the call in progress); each choice gets its own.
"""

import json
from dataclasses import dataclass, field
from typing import Protocol

ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes and OpenAI say arguments, Llama 3.1 says parameters


@dataclass
class CallPrefix:
    name: str | None  # None until the name's JSON string is complete
    arguments: str  # the raw JSON text of the arguments' value so far
    complete: bool = False  # the call's object is closed


@dataclass
class ParsedText:
    content: str
    calls: list[CallPrefix] = field(default_factory=list)


class ToolParser(Protocol):
    def parse(self, text: str, final: bool) -> ParsedText: ...


def scan_call(text: str, start: int) -> tuple[CallPrefix, int | None]:
    """The call whose JSON object opens at text[start] ("{"), and the index past its "}" (None: not closed
    yet). Keys at the object's top level: "name" (a string) and the arguments under ARGUMENT_KEYS."""
    depth, i, n = 0, start, len(text)
    expect, key = "key", None  # at depth 1: what comes next ("key", "colon", "value", "after")
    name, args_start, args_end = None, None, None
    while i < n:
        c = text[i]
        if c == '"':
            j = _string_end(text, i)
            if j is None:
                break
            if depth == 1 and expect == "key":
                key, expect = json.loads(text[i:j]), "colon"
            elif depth == 1 and expect == "value":
                if key == "name":
                    name = json.loads(text[i:j])
                if key in ARGUMENT_KEYS:
                    args_start, args_end = i, j
                expect = "after"
            i = j
            continue
        if c in "{[":
            if depth == 1 and expect == "value":
                args_start = i if key in ARGUMENT_KEYS else args_start
                expect = "nested"
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 1 and expect == "nested":
                args_end = i + 1 if key in ARGUMENT_KEYS else args_end
                expect = "after"
            if depth == 0:
                if expect == "scalar" and key in ARGUMENT_KEYS:
                    args_end = i
                return _prefix(text, name, args_start, args_end, i, True), i + 1
        elif depth == 1:
            if c == ":" and expect == "colon":
                expect = "value"
            elif c == ",":
                if expect == "scalar" and key in ARGUMENT_KEYS:
                    args_end = i
                expect = "key"
            elif expect == "value" and not c.isspace():  # a number, true, false or null
                args_start = i if key in ARGUMENT_KEYS else args_start
                expect = "scalar"
        i += 1
    return _prefix(text, name, args_start, args_end, n, False), None


class CallScanner:
    """scan_call over one text that only grows: a call once closed is not scanned again."""

    def __init__(self):
        self.closed: dict[int, tuple[CallPrefix, int]] = {}

    def __call__(self, text: str, start: int) -> tuple[CallPrefix, int | None]:
        if start in self.closed:
            return self.closed[start]
        call, end = scan_call(text, start)
        if end is not None:
            self.closed[start] = call, end
        return call, end


def _prefix(text: str, name, args_start, args_end, end: int, complete: bool) -> CallPrefix:
    if args_start is None:
        return CallPrefix(name, "", complete)
    return CallPrefix(name, text[args_start:end if args_end is None else args_end], complete)


def _string_end(text: str, start: int) -> int | None:
    """The index past the JSON string that opens at text[start]; None if it does not close yet."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return None


def partial_marker(text: str, marker: str) -> int:
    """How many characters at the end of text begin marker (held back: the marker may be coming)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
