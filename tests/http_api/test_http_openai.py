"""The OpenAI surface over HTTP, end to end without Ray: the real uvicorn server over a LocalDeployment (one
in-process LLM of a tiny random model, the demo chat template) driven by the real `openai` client.

Structured outputs: every output of each JSON Schema, sampled at temperature 1 over 8 seeds (n=8, a seeded
request's choice i uses seed + i), validates with jsonschema, through every spelling a client sends; regex and
choice outputs match; a Lark grammar's outputs parse; `parse()` with a pydantic model. Tool calls: under
"required" and a named function every call's arguments validate against the function's schema; streamed
deltas concatenate to the non-streamed response; "auto" finds a Hermes call in the text. Bad inputs are 400
bodies naming the field; CORS answers an allowed origin's preflight and not another's; /tokenize and
/detokenize round-trip."""

import asyncio
import json
import re
import threading
import time
from pathlib import Path

import jsonschema
import openai
import pydantic
import pytest
import requests
from tokenizers import Tokenizer

from cluster_configs.cluster_config import HttpConfig
from cluster_configs.sampling_params import SamplingParams
from http_api.app import build_app
from http_api.chat_template import ChatTemplate
from http_api.errors import APIError
from http_api.fill_in_middle import fim_prompt
from http_api.protocol import ChatCompletionRequest, TokenizeRequest
from http_api.serving import OpenAIServing
from models.tokenizer import Tokenizer as ModelTokenizer
from tests.scheduling.test_structured_outputs import SCHEMAS
from tests.support.http_app import served
from tests.support.local_deployment import LocalDeployment
from tests.support.model_factory import build_model

DEMO_TEMPLATE = (Path(__file__).parents[2] / "scripts" / "demo_chat_template.jinja").read_text()
ALLOWED_ORIGIN = "https://app.example"
N = 8  # seeds 0..7 in one request
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "maxLength": 8},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                  "unit": {"enum": ["c", "f"]}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                   "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}}
TOOLS = [WEATHER, CLOCK]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def llm(module_llm, tmp_path_factory):
    directory = tmp_path_factory.mktemp("http") / "llama"
    build_model(directory, "llama", max_position_embeddings=2048)  # room for the tools in the prompt
    llm = module_llm(directory, num_threads=1)
    llm.generate("warm-up", SamplingParams(max_tokens=2))  # the kernels loaded before any timeout runs
    return llm


def serving_of(llm, **http) -> OpenAIServing:
    template = ChatTemplate(DEMO_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"})
    return OpenAIServing(LocalDeployment(llm), "tiny", "/tiny", template, False, "fp_test",
                         HttpConfig(**http))


@pytest.fixture(scope="module")
def url(llm):
    app = build_app(serving_of(llm, tool_call_parser="hermes", allowed_origins=(ALLOWED_ORIGIN,)))
    with served(app) as url:
        yield url


@pytest.fixture(scope="module")
def api(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def chat(api, **kwargs):
    defaults = {"model": "tiny", "messages": MESSAGES, "temperature": 1.0, "seed": 0, "n": N,
                "max_completion_tokens": 120}
    return api.chat.completions.create(**defaults | kwargs)


# ---- structured outputs --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEMAS)
def test_every_output_of_a_json_schema_response_format_validates(api, name):
    r = chat(api, response_format={"type": "json_schema",
                                   "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}})
    assert len(r.choices) == N
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


@pytest.mark.parametrize("spelling", ["structured_outputs", "guided_json", "json_object"])
def test_every_spelling_of_a_json_constraint_holds_on_completions(api, spelling):
    schema = SCHEMAS["defs_and_ref"]
    body = {"structured_outputs": {"structured_outputs": {"json": schema}},
            "guided_json": {"guided_json": json.dumps(schema)},
            "json_object": {"response_format": {"type": "json_object"}}}[spelling]
    r = api.completions.create(model="tiny", prompt="data: ", temperature=1.0, seed=0, n=N, max_tokens=120,
                               extra_body=body)
    if spelling == "json_object":  # any object: a random model may wander in a string past max_tokens
        finished = [c for c in r.choices if c.finish_reason == "stop"]
        assert finished and all(isinstance(json.loads(c.text), dict) for c in finished)
        return
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.text), schema)


def test_regex_and_choice_outputs_match(api):
    regex = r"[a-f]{2,5}-\d{1,3}"
    for body in ({"guided_regex": regex}, {"structured_outputs": {"regex": regex}}):
        for choice in chat(api, extra_body=body).choices:
            assert re.fullmatch(regex, choice.message.content), choice.message.content
    options = ["yes", "no", "maybe so"]
    for body in ({"guided_choice": options}, {"structured_outputs": {"choice": options}}):
        assert {c.message.content for c in chat(api, extra_body=body).choices} <= set(options)


def test_a_lark_grammars_outputs_parse(api):
    grammar = 'start: expr\nexpr: NUMBER | "(" expr "+" expr ")"\nNUMBER: /[0-9]{1,3}/'
    for choice in chat(api, extra_body={"guided_grammar": grammar}).choices:
        text = choice.message.content
        while (reduced := re.sub(r"\(\d+\+\d+\)", "0", text)) != text:  # innermost sums, until none is left
            text = reduced
        assert re.fullmatch(r"\d{1,3}", text), choice.message.content


class Point(pydantic.BaseModel):
    x: int = pydantic.Field(ge=0, le=9)
    y: int = pydantic.Field(ge=0, le=9)


class Shape(pydantic.BaseModel):
    kind: str = pydantic.Field(pattern="^(line|box)$")
    points: list[Point] = pydantic.Field(min_length=1, max_length=3)


def test_parse_with_a_pydantic_model(api):
    r = api.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Shape, temperature=1.0,
                                   seed=0, n=N, max_completion_tokens=120)
    for choice in r.choices:
        assert isinstance(choice.message.parsed, Shape), choice.message.content


# ---- tool calls ----------------------------------------------------------------------------------------


def schema_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_calls_carry_valid_arguments(api, parallel):
    """Parallel: a random model goes on listing calls, and max_tokens may cut the last one (finish "length");
    every call before it is complete and valid, and some choices end the list themselves."""
    r = chat(api, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
             max_completion_tokens=400)
    for choice in r.choices:
        calls = choice.message.tool_calls
        assert calls and choice.message.content is None
        assert parallel or len(calls) == 1 and choice.finish_reason == "tool_calls"
        complete = calls if choice.finish_reason == "tool_calls" else calls[:-1]
        for call in complete:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name))
    assert any(c.finish_reason == "tool_calls" for c in r.choices)


def test_a_named_function_is_called_with_valid_arguments(api):
    r = chat(api, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    for choice in r.choices:
        [call] = choice.message.tool_calls
        assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), schema_of("get_time"))


def streamed_calls(stream) -> tuple[dict, dict]:
    """Each choice's calls (index -> [id, name, arguments]) and finish reason, from a stream's deltas; a
    call's first delta must carry its id, type and name, later ones arguments only."""
    calls, reasons = {}, {}
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                mine = calls.setdefault(choice.index, {})
                if delta.index not in mine:
                    assert delta.id and delta.type == "function" and delta.function.name
                    mine[delta.index] = [delta.id, delta.function.name, delta.function.arguments or ""]
                else:
                    assert delta.id is None and delta.function.name is None
                    mine[delta.index][2] += delta.function.arguments
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    return calls, reasons


@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_call_deltas_concatenate_to_the_response(api, tool_choice):
    kwargs = {"tools": TOOLS, "tool_choice": tool_choice, "max_completion_tokens": 400}
    whole = chat(api, **kwargs)
    calls, reasons = streamed_calls(chat(api, stream=True, **kwargs))
    for choice in whole.choices:
        assert reasons[choice.index] == choice.finish_reason in ("tool_calls", "length")
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
            (name, arguments) for _, name, arguments in calls[choice.index].values()]


def test_auto_finds_a_hermes_call_in_the_text(api):
    # the text is forced into a Hermes call by a regex: "auto" must find it, as it would in a model's own
    regex = (r'Sure\.\n<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}", '
             r'"days": [1-7]\}\}</tool_call>')
    kwargs = {"tools": TOOLS, "extra_body": {"guided_regex": regex}}
    whole = chat(api, **kwargs)
    calls, reasons = streamed_calls(chat(api, stream=True, **kwargs))
    for choice in whole.choices:
        [call] = choice.message.tool_calls
        assert choice.message.content == "Sure.\n"
        assert choice.finish_reason == reasons[choice.index] == "tool_calls"
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), schema_of("get_weather"))
        assert [(call.function.name, call.function.arguments)] == [
            (name, arguments) for _, name, arguments in calls[choice.index].values()]


def test_tool_results_and_earlier_calls_are_accepted_back(api):
    first = chat(api, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
                 n=1).choices[0].message
    messages = MESSAGES + [first.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"} for call in first.tool_calls]
    r = api.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="none",
                                    max_completion_tokens=4)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content is not None


# ---- the rest of the surface ---------------------------------------------------------------------------


def post(url: str, path: str, body: dict) -> requests.Response:
    return requests.post(f"{url}{path}", json=body, timeout=300)


@pytest.mark.parametrize("path,body,param,words", [
    ("/v1/chat/completions", {"guided_json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
     "guided_json", "nonsense"),
    ("/v1/completions", {"guided_regex": "(a"}, "guided_regex", "guided_regex"),
    ("/v1/completions", {"guided_grammar": "start: undefined_rule"}, "guided_grammar", "undefined_rule"),
    ("/v1/completions", {"response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "json_schema"),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "send one"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "user"),
    ("/v1/completions", {"suffix": "return x"}, "suffix", "fill-in-the-middle"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice", "'f'"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice", "no tools"),
    ("/v1/chat/completions", {"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}]},
     "tools", "nonsense"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "guided_regex",
     "send one"),
])
def test_bad_inputs_are_400s_naming_the_field(url, path, body, param, words):
    base = {"model": "tiny", "max_tokens": 4} | (
        {"messages": MESSAGES} if path.endswith("chat/completions") else {"prompt": "x"})
    r = post(url, path, base | body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert words in error["message"] and "Traceback" not in error["message"]


def test_suffix_fills_in_the_middle_with_the_models_fim_tokens(llm):
    hf = Tokenizer.from_str(llm.tokenizer.hf_tokenizer.to_str())
    hf.add_special_tokens(["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"])
    assert fim_prompt(ModelTokenizer(hf), "def f(x):\n", "\n    return y") == (
        "<|fim_prefix|>def f(x):\n<|fim_suffix|>\n    return y<|fim_middle|>")
    with pytest.raises(APIError, match="no fill-in-the-middle tokens"):
        fim_prompt(llm.tokenizer, "def f(x):\n", "\n    return y")


def test_auto_tool_choice_needs_a_parser(llm):
    req = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": TOOLS})
    with pytest.raises(APIError, match="--tool-call-parser"):
        asyncio.run(serving_of(llm).chat(req))


def test_a_chat_is_tokenized_off_the_event_loop_and_one_too_long_is_refused_before_it(llm, monkeypatch):
    """A long chat tokenized in the event loop held up every stream the server relays; one too long for
    max_model_len whatever its tokens is refused from its characters, untokenized."""
    real, threads = llm.tokenizer.hf_tokenizer, []

    class Recording:
        def encode(self, text, **kwargs):
            threads.append(threading.current_thread())
            return real.encode(text, **kwargs)

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(ModelTokenizer, "hf_tokenizer", property(lambda self: Recording()))
    serving = serving_of(llm)
    asyncio.run(serving.chat(ChatCompletionRequest.model_validate({"messages": MESSAGES, "max_tokens": 2})))
    assert threads and threading.main_thread() not in threads  # asyncio.run's loop is in the main thread
    threads.clear()
    too_long = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "a" * 5_000_000}]})
    with pytest.raises(APIError, match=r"prompt has 50000\d\d characters, more than max_model_len=2048") as e:
        asyncio.run(serving.chat(too_long))
    assert (e.value.status, e.value.param, e.value.code) == (400, "messages", "context_length_exceeded")
    assert not threads
    counted = asyncio.run(serving.tokenize(TokenizeRequest.model_validate(
        {"messages": [{"role": "user", "content": "a " * 200_000}]})))  # /tokenize counts any length
    assert counted["count"] > llm.engine.max_model_len and threading.main_thread() not in threads


def test_nulls_and_fields_without_effect_are_accepted(url):
    r = post(url, "/v1/chat/completions", {
        "model": "tiny", "messages": MESSAGES, "max_tokens": 3, "n": None, "stream": None,
        "temperature": None, "stop": None, "logprobs": None, "tools": None, "tool_choice": None,
        "response_format": None, "stream_options": None, "user": "u1", "store": False, "metadata": {"k": "v"},
        "service_tier": "auto"})
    assert r.status_code == 200, r.text
    now = time.time()
    assert abs(r.json()["created"] - now) < 60
    models = requests.get(f"{url}/v1/models", timeout=10).json()["data"]
    assert models and all(abs(m["created"] - now) < 600 for m in models)


def test_cors_preflight_answers_an_allowed_origin_only(url):
    def preflight(origin: str) -> requests.Response:
        return requests.options(f"{url}/v1/chat/completions", timeout=10, headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})

    allowed = preflight(ALLOWED_ORIGIN)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    other = preflight("https://evil.example")
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_tokenize_and_detokenize_round_trip(url, llm):
    text = "def add(a, b):\n    return a + b"
    r = post(url, "/tokenize", {"model": "tiny", "prompt": text, "return_token_strs": True}).json()
    assert r["tokens"] == llm.tokenizer.encode(text) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == llm.engine.max_model_len and "".join(r["token_strs"][1:]) == text
    assert post(url, "/detokenize", {"model": "tiny", "tokens": r["tokens"]}).json() == {"prompt": text}
    chat_ids = post(url, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    assert llm.tokenizer.decode(chat_ids) == "# user: What is the weather in Paris?\n# assistant:\n"
    assert requests.get(f"{url}/version", timeout=10).json()["version"]


def test_a_dropped_stream_aborts_its_request_in_the_engine(api, llm):
    stream = api.completions.create(model="tiny", prompt="x", max_tokens=2000, stream=True,
                                    extra_body={"ignore_eos": True})
    next(iter(stream))
    assert llm.engine_loop.call(lambda engine: len(engine.scheduler.requests)) == 1
    stream.close()
    deadline = time.monotonic() + 30
    while llm.engine_loop.call(lambda engine: len(engine.scheduler.requests)):
        assert time.monotonic() < deadline, "the request still runs after its client went away"
        time.sleep(0.05)
