"""Hermes' tool calls (NousResearch Hermes 2/3, Qwen 2.5/3): each call is
<tool_call>{"name": ..., "arguments": {...}}</tool_call>, anywhere in the text; what is outside the tags is
content. A block whose JSON has no name is dropped."""

from http_api.tool_parsers.base import CallScanner, ParsedText, partial_marker

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser:
    def __init__(self):
        self.scan = CallScanner()

    def parse(self, text: str, final: bool) -> ParsedText:
        content, calls, pos = [], [], 0
        while True:
            k = text.find(OPEN, pos)
            if k < 0:
                tail = text[pos:]
                content.append(tail if final else tail[:len(tail) - partial_marker(tail, OPEN)])
                break
            content.append(text[pos:k])
            start = k + len(OPEN)
            while start < len(text) and text[start].isspace():
                start += 1
            if start == len(text):
                break
            end = None
            if text[start] == "{":
                call, end = self.scan(text, start)
                calls.append(call)
            close = text.find(CLOSE, end if end is not None else start)
            if end is None and text[start] == "{" or close < 0:
                break  # the call, or its closing tag, is still coming
            pos = close + len(CLOSE)
        return ParsedText("".join(content), [c for c in calls if c.name is not None])
