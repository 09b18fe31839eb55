"""The demo model's chat format and structured outputs on it, in process (no Ray): its template renders a
conversation with tools; the demo's structured step (a JSON Schema, a named tool call), run over an
in-process stand-in for its client, gives a valid record and a call with valid arguments; through the
OpenAI endpoints' code (OpenAIServing over a LocalDeployment), every output of each JSON Schema at
temperature 1 over 8 seeds validates, and calls under "required" carry valid arguments."""

import asyncio
import json

import jsonschema
import pytest

from http_api.chat_template import load_chat_template
from http_api.protocol import ChatCompletionRequest
from http_api.serving import OpenAIServing
from numaserve.demo import (
    DEMO_DIR,
    FUNCTION_SCHEMA,
    RUN_TESTS,
    _structured_and_tool_call,
    structured_request,
    tool_call_request,
)
from numaserve.llm import LLM
from tests.scheduling.test_structured_outputs import SCHEMAS
from tests.support.local_deployment import LocalDeployment

BASE = DEMO_DIR / "base"


@pytest.fixture(scope="module")
def llm(module_llm):
    return module_llm(BASE, num_threads=1)


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


class InProcessClient:
    """actors.client.Client's generate (one Completion of a prompt), over the in-process LLM: what the demo's
    structured step calls."""

    def __init__(self, llm: LLM):
        self.llm = llm

    def generate(self, prompt, params):
        [completion] = self.llm.generate(prompt, params)
        return completion


def test_the_demo_step_gives_a_valid_record_and_tool_call(llm, capsys):
    prompt_ids, _, _ = tool_call_request(BASE)
    assert prompt_ids[0] == llm.tokenizer.token_to_id("<s>") and prompt_ids[1] != prompt_ids[0]
    summary = _structured_and_tool_call(InProcessClient(llm), BASE)  # what numaserve demo runs over Ray
    jsonschema.validate(json.loads(summary["json"]), FUNCTION_SCHEMA)
    assert summary["tool_call"]["name"] == "run_tests"
    jsonschema.validate(json.loads(summary["tool_call"]["arguments"]), RUN_TESTS["function"]["parameters"])
    printed = capsys.readouterr().out
    assert f"{structured_request()[0]}{summary['json']}" in printed
    assert f"-> run_tests({summary['tool_call']['arguments']})" in printed


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
