"""Llama 3.1/3.2's JSON tool calls: the whole output is {"name": ..., "parameters": {...}} (or "arguments"),
several separated by ";", optionally after <|python_tag|>. An output that does not open with "{" is content;
so is one in which no call has a name, once final (until then it is held back: it may still be a call)."""

from http_api.tool_parsers.base import CallScanner, ParsedText

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser:
    def __init__(self):
        self.scan = CallScanner()

    def parse(self, text: str, final: bool) -> ParsedText:
        start = _skip_space(text, 0)
        if text.startswith(PYTHON_TAG, start):
            start = _skip_space(text, start + len(PYTHON_TAG))
        rest = text[start:]
        if not final and (not rest or PYTHON_TAG.startswith(rest)):
            return ParsedText("")
        if not rest.startswith("{"):
            return ParsedText(text)
        calls = []
        while True:
            call, end = self.scan(text, start)
            calls.append(call)
            if end is None:
                break
            start = _skip_space(text, end)
            if not text.startswith(";", start):
                break
            start = _skip_space(text, start + 1)
            if not text.startswith("{", start):
                break
        named = [c for c in calls if c.name is not None]
        if final and not named:
            return ParsedText(text)
        return ParsedText("", named)


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i
