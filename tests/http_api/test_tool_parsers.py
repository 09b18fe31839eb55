"""Tool-call parsers over text: each finds the calls in its format (as chat templates write them) with their
names and raw arguments, and the content around them; fed every prefix of the text, as a stream is, the
deltas (http_api/tool_calls.py) concatenate to what the whole text gives, and a call's first delta carries
its id and name."""

import json

import pytest

from cluster_configs.cluster_config import HttpConfig
from http_api import tool_calls
from http_api.chat_template import ChatTemplate
from http_api.tool_parsers import TOOL_PARSERS
from http_api.tool_parsers.base import scan_call
from tests.http_api.test_http_openai import DEMO_TEMPLATE, TOOLS

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
CLOCK = '{"name": "get_time", "arguments": {"zone": "CET"}}'


def stream(parser, text: str) -> tuple[str, list[tuple[str, str]], list[dict]]:
    """Content and calls (name, arguments) from the deltas of every prefix of text, and the deltas."""
    s = tool_calls.ToolCallStream(parser)
    deltas = [s.delta(text[:i], final=i == len(text))[0] for i in range(1, len(text) + 1)]
    content, calls = "", []
    for delta in deltas:
        content += delta.get("content", "")
        for call in delta.get("tool_calls", ()):
            if call["index"] == len(calls):
                assert call["id"].startswith("call_") and call["type"] == "function"
                calls.append([call["function"]["name"], call["function"]["arguments"]])
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                calls[call["index"]][1] += call["function"]["arguments"]
    return content, [tuple(c) for c in calls], deltas


def whole(parser, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    message = tool_calls.message(parser.parse(text, final=True), ["id"] * 8)
    return message["content"], [(c["function"]["name"], c["function"]["arguments"])
                                 for c in message.get("tool_calls", ())]


HERMES_CASES = {
    "one call after content": ("Let me look.\n<tool_call>" + WEATHER + "</tool_call>",
                               "Let me look.\n", [("get_weather", '{"city": "Paris", "days": 2}')]),
    "two calls, whitespace only around them": (
        "<tool_call>\n" + WEATHER + "\n</tool_call>\n<tool_call>" + CLOCK + "</tool_call>\n", None,
        [("get_weather", '{"city": "Paris", "days": 2}'), ("get_time", '{"zone": "CET"}')]),
    "no call": ("Just text with < and <tool but no call.", "Just text with < and <tool but no call.", []),
    "arguments before name, braces in strings": (
        '<tool_call>{"arguments": {"q": "a}b{\\"c"}, "name": "search"}</tool_call>', None,
        [("search", '{"q": "a}b{\\"c"}')]),
    "cut inside the call": ("<tool_call>" + WEATHER[:40], None, [("get_weather", WEATHER[37:40])]),
}


@pytest.mark.parametrize("case", HERMES_CASES)
def test_hermes_finds_calls_and_content(case):
    text, content, calls = HERMES_CASES[case]
    parser = TOOL_PARSERS["hermes"]()
    assert whole(parser, text) == (content, calls)
    streamed_content, streamed_calls, _ = stream(parser, text)
    assert streamed_content == (content or "") and streamed_calls == calls


LLAMA_CASES = {
    "one call": (WEATHER.replace("arguments", "parameters"), None,
                 [("get_weather", '{"city": "Paris", "days": 2}')]),
    "python tag, two calls": ("<|python_tag|>" + WEATHER + "; " + CLOCK, None,
                              [("get_weather", '{"city": "Paris", "days": 2}'),
                               ("get_time", '{"zone": "CET"}')]),
    "content": ("The weather is fine.", "The weather is fine.", []),
    "JSON that is no call": ('{"answer": 42}', '{"answer": 42}', []),
}


@pytest.mark.parametrize("case", LLAMA_CASES)
def test_llama3_json_finds_calls_and_content(case):
    text, content, calls = LLAMA_CASES[case]
    parser = TOOL_PARSERS["llama3_json"]()
    assert whole(parser, text) == (content, calls)
    streamed_content, streamed_calls, _ = stream(parser, text)
    assert streamed_content == (content or "") and streamed_calls == calls


def test_a_templated_conversation_parses_back_to_its_calls():
    """The demo template writes an assistant's calls as Hermes blocks: parsed back, they are the calls."""
    calls = [{"id": "a", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Oslo", "days": 1}}},
             {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}]
    text = ChatTemplate(DEMO_TEMPLATE, {"bos_token": ""}).render(
        [{"role": "assistant", "content": "Checking.", "tool_calls": calls}], add_generation_prompt=False,
        tools=TOOLS)
    text = text[text.index("# assistant:\n") + len("# assistant:\n"):]
    content, found = whole(TOOL_PARSERS["hermes"](), text)
    assert content.strip() == "Checking."
    assert [(name, json.loads(arguments)) for name, arguments in found] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_required_and_named_outputs_stream_as_their_calls():
    text = ('[{"name":"get_weather","parameters":{"city":"Rome","days":3}},'
            '{"name":"get_time","parameters":{}}]')
    content, calls, _ = stream(tool_calls.RequiredCallsParser(), text)
    assert content == "" and calls == [("get_weather", '{"city":"Rome","days":3}'), ("get_time", "{}")]
    content, calls, deltas = stream(tool_calls.NamedCallParser("get_time"), '{"zone":"UTC"}')
    assert calls == [("get_time", '{"zone":"UTC"}')] and deltas[0]["tool_calls"][0]["function"]["name"]


def test_scan_call_reads_scalar_arguments_and_reports_the_end():
    call, end = scan_call('{"name": "f", "arguments": 5 } tail', 0)
    assert (call.name, call.arguments, call.complete, end) == ("f", "5 ", True, 30)
    call, end = scan_call('{"name": "f", "arg', 0)
    assert (call.name, call.arguments, end) == ("f", "", None)


def test_the_config_names_exactly_the_parsers():
    [names, _none] = HttpConfig.model_fields["tool_call_parser"].annotation.__args__
    assert set(names.__args__) == set(TOOL_PARSERS)
