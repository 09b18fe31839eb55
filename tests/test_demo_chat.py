"""The demo model's chat format and structured outputs on it, in process (no Ray): its template renders a
conversation with tools; the two requests `numaserve demo` makes (a JSON Schema, a named tool call) give a
valid record and a call with valid arguments; through the OpenAI endpoints' code (OpenAIServing over a
LocalDeployment), every output of each JSON Schema at temperature 1 over 8 seeds validates, and calls under
"required" carry valid arguments."""

import asyncio
import json

import jsonschema
import pytest

from actors.chat_template import load_chat_template
from actors.local_deployment import LocalDeployment
from actors.openai_protocol import ChatCompletionRequest
from actors.openai_serving import OpenAIServing
from numaserve.demo import DEMO_DIR, FUNCTION_SCHEMA, RUN_TESTS, structured_request, tool_call_request
from numaserve.llm import LLM
from tests.test_structured_outputs import SCHEMAS

BASE = DEMO_DIR / "base"


@pytest.fixture(scope="module")
def llm():
    with LLM(BASE, num_threads=1) as llm:
        yield llm


@pytest.fixture(scope="module")
def serving(llm):
    return OpenAIServing(LocalDeployment(llm), "base", str(BASE), load_chat_template(BASE), False, "fp_demo")


def test_both_demo_models_carry_the_chat_template():
    for model in ("base", "draft"):
        template = load_chat_template(DEMO_DIR / model)
        text = template.render([{"role": "system", "content": "Write tests."},
                                {"role": "user", "content": "Run them."}], tools=[RUN_TESTS])
        assert text.startswith('<s>"""Write tests."""\n# Tools.')
        assert text.endswith("# user: Run them.\n# assistant:\n")
        assert "# run_tests: Run one test module" in text and '"pattern": "^test_[a-z_]{1,16}$"' in text


def test_the_demo_requests_give_a_valid_record_and_tool_call(llm):
    prompt, params = structured_request()
    [record] = llm.generate(prompt, params)
    jsonschema.validate(json.loads(record.text), FUNCTION_SCHEMA)
    prompt_ids, params, parser = tool_call_request(BASE)
    assert prompt_ids[0] == llm.tokenizer.token_to_id("<s>") and prompt_ids[1] != prompt_ids[0]
    [call] = parser.parse(llm.generate(prompt_ids, params)[0].text, final=True).calls
    assert call.name == "run_tests"
    jsonschema.validate(json.loads(call.arguments), RUN_TESTS["function"]["parameters"])


def chat(serving, **body) -> dict:
    return asyncio.run(serving.chat(ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "Describe it."}], "temperature": 1.0, "seed": 0, "n": 8,
         "max_completion_tokens": 120} | body)))


@pytest.mark.parametrize("name", SCHEMAS)
def test_every_output_of_a_json_schema_validates_on_the_demo_model(serving, name):
    r = chat(serving, response_format={"type": "json_schema", "json_schema": {"name": name,
                                                                              "schema": SCHEMAS[name]}})
    for choice in r["choices"]:
        assert choice["finish_reason"] == "stop", choice["message"]["content"]
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMAS[name])


def test_required_tool_calls_on_the_demo_model_carry_valid_arguments(serving):
    r = chat(serving, tools=[RUN_TESTS], tool_choice="required", parallel_tool_calls=False)
    for choice in r["choices"]:
        [call] = choice["message"]["tool_calls"]
        assert choice["finish_reason"] == "tool_calls" and call["function"]["name"] == "run_tests"
        jsonschema.validate(json.loads(call["function"]["arguments"]), RUN_TESTS["function"]["parameters"])
