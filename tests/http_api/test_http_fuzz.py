"""schemathesis over /openapi.json against the real uvicorn server in process, over a LocalDeployment of a
tiny random model with the demo chat template, tool calls parsed, adapters loadable, and an API key
(HttpConfig.api_keys, as `numaserve serve --api-key`): every operation, positive and negative cases, EXAMPLES
each with the key and EXAMPLES without it. No answer is a 5xx or takes longer than TIMEOUT_S; every error body
is OpenAI-shaped and shows no internals (tests/conftest.py's hook); after it the server is healthy and serves
a completion. Deterministic: derandomized Hypothesis, generation phases only (no shrinking: a failure shows
the case as generated)."""

import time
from collections import Counter

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from cluster_configs.cluster_config import HttpConfig
from cluster_configs.sampling_params import SamplingParams
from http_api.app import build_app
from http_api.chat_template import ChatTemplate
from http_api.serving import OpenAIServing
from numaserve.llm import LLM
from tests.http_api.test_http_openai import DEMO_TEMPLATE
from tests.support.http_app import served
from tests.support.local_deployment import LocalDeployment
from tests.support.model_factory import build_model

EXAMPLES = 200  # generated requests per operation and key mode
TIMEOUT_S = 30.0  # one request's: a hang fails the test
KEY = "fuzz-key"
# generated bodies ask for any max_tokens: past the cap is a 400, so none decodes for long (the completions
# default, 16, fits: a body without max_tokens runs)
MAX_TOKENS_CAP = 16
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fuzz") / "llama"
    build_model(directory, "llama")
    with LLM(directory, num_threads=1) as llm:
        llm.generate("warm-up", SamplingParams(max_tokens=2))
        config = HttpConfig(api_keys=(KEY,), max_tokens_cap=MAX_TOKENS_CAP, default_deadline_s=TIMEOUT_S,
                            tool_call_parser="hermes")
        template = ChatTemplate(DEMO_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"})
        serving = OpenAIServing(LocalDeployment(llm), "tiny", "/tiny", template, True, "fp", config)
        with served(build_app(serving)) as url:
            yield url


def fuzz(operation, url: str, headers: dict) -> Counter:
    """EXAMPLES generated requests of the operation, each answered in TIMEOUT_S without a 5xx -> the count of
    each status."""
    seen = Counter()
    cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE),
                      operation.as_strategy(GenerationMode.NEGATIVE))

    @given(case=cases)
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def no_server_error(case):
        response = case.call(base_url=url, headers=headers, timeout=TIMEOUT_S)
        seen[response.status_code] += 1
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
        if response.status_code >= 400 and response.content:
            assert set(response.json()["error"]) == ERROR_KEYS, response.text[:500]

    no_server_error()
    return seen


@pytest.mark.parametrize("with_key", [True, False], ids=["key", "no key"])
def test_fuzzing_every_operation_finds_no_5xx_no_hang_and_leaves_the_server_healthy(url, with_key):
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} == {
        "POST /v1/completions", "POST /v1/chat/completions", "POST /v1/embeddings", "GET /v1/models",
        "POST /v1/load_lora_adapter", "POST /v1/unload_lora_adapter", "POST /tokenize", "POST /detokenize",
        "GET /version", "GET /health",
        "GET /metrics", "GET /v1/numaserve/stats"}
    headers = {"Authorization": f"Bearer {KEY}"} if with_key else {}
    start = time.monotonic()
    statuses = {f"{op.method.upper()} {op.path}": fuzz(op, url, headers) for op in operations}
    print(f"fuzzed {sum(sum(s.values()) for s in statuses.values())} requests in "
          f"{time.monotonic() - start:.0f} s: {statuses}")
    # an operation without parameters has one request to send (Hypothesis stops when the cases run out)
    assert all(sum(s.values()) >= EXAMPLES for name, s in statuses.items() if name.startswith("POST")), \
        statuses
    if not with_key:  # the key guards /v1 and the tokenizer's routes, whatever the body
        assert all(set(s) <= {400, 401, 404, 405, 415, 422} for name, s in statuses.items()
                   if "/v1/" in name or "tokenize" in name), statuses
    assert requests.get(f"{url}/health", timeout=TIMEOUT_S).status_code == 200
    r = requests.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT_S)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
