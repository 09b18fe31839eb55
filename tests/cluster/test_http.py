"""The OpenAI-compatible HTTP API of a two_numa_sim deployment, driven over loopback by the official `openai`
client (and raw requests where the client cannot go): results equal the in-process engine, usage is exact,
streams are shaped as OpenAI's, bad requests get OpenAI error bodies and the server goes on, dropped clients
free their workers, and a schema fuzz finds no 5xx."""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import ray
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from schemathesis import GenerationMode
from transformers import AutoTokenizer

import numaserve as ns
from benchmarks.ports import free_port
from tests.cluster.conftest import (
    advance,
    idle,
    paused,
    queued,
    reference_outputs,
    scrape,
    sim_config,
    wait_for,
)
from tests.conftest import random_prompt
from tests.numaserve.test_lm_eval import check_local_completions

NAME = "http"
MODEL = "llama"  # the served model's name: its folder's
GREEDY = ns.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
IGNORE_EOS = {"ignore_eos": True}
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    # 8 running + 4 queued per worker: 24 requests admitted in all, then 429
    return sim_config("two_numa_sim", max_queued_per_worker=4, engine={"max_num_seqs": 8},
                      adapter_registry=str(tmp_path_factory.mktemp("registry") / "adapters.json"),
                      http={"port": free_port(), "enable_lora_loading": True})


@pytest.fixture(scope="module")
def client(ray_cluster, llama_dir, config):
    client = ns.serve(config, model=llama_dir, name=NAME)
    yield client
    client.shutdown()


@pytest.fixture(scope="module")
def url(client) -> str:
    return client.http_url


@pytest.fixture(scope="module")
def api(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)



def serves(api) -> bool:
    """A good request succeeds (with its tokens: sampled, it must not meet EOS)."""
    return api.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body=IGNORE_EOS).usage \
        .completion_tokens == 2


def test_embeddings_and_echoed_prompt_logprobs_through_the_workers_equal_the_engine_in_process(
        client, api, llama_dir, config):
    # /v1/embeddings: each input placed on a worker like a request (NumaWorker.embed); echo with logprobs:
    # the prompt's tokens scored in the prefill on the worker, carried through the caller's stream
    texts = ["the cat sat", "a much longer input than the first one"]
    llm = ns.LLM(llama_dir, **config.engine.model_dump(exclude={"num_threads"}))
    expected = llm.embed(texts)
    got = api.embeddings.create(model=MODEL, input=texts)
    assert [d.index for d in got.data] == [0, 1]
    np.testing.assert_allclose(np.array([d.embedding for d in got.data], np.float32), expected, atol=1e-5)
    ids = llm.tokenizer.encode(texts[1])
    logits = llm.score(ids)[:-1].astype(np.float64)  # [len(ids) - 1, V]: the next token's after each
    logprobs = logits - logits.max(-1, keepdims=True)
    logprobs -= np.log(np.exp(logprobs).sum(-1, keepdims=True))
    scores = logprobs[np.arange(len(ids) - 1), ids[1:]]
    out = api.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True, logprobs=0, temperature=0)
    echoed = out.choices[0].logprobs.token_logprobs[:len(ids)]
    assert echoed[0] is None
    np.testing.assert_allclose(echoed[1:], scores, atol=1e-4)
    llm.close()


def test_lm_eval_local_completions_against_the_served_deployment_equals_llm_score(url, llama_dir, config,
                                                                                  monkeypatch):
    # `numaserve serve`'s stack (the HTTP actor, router and workers) under lm-evaluation-harness
    with ns.LLM(llama_dir, **config.engine.model_dump(exclude={"num_threads"})) as llm:
        check_local_completions(url, MODEL, llm, llama_dir, monkeypatch)


def test_the_server_binds_loopback_and_is_healthy(client, url, config):
    assert url == f"http://127.0.0.1:{config.http.port}"
    assert requests.get(f"{url}/health", timeout=10).status_code == 200
    assert ns.connect(NAME).http_url == url
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(
        requests.get(f"{url}/openapi.json", timeout=10).json()["paths"])


def test_a_greedy_completion_equals_llm_generate_with_exact_usage(api, llama_dir, config):
    [expected] = reference_outputs(llama_dir, config, ["def add(a, b):"], GREEDY)
    r = api.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=12, temperature=0,
                               extra_body=IGNORE_EOS)
    [choice] = r.choices
    assert (choice.index, choice.text, choice.finish_reason, choice.logprobs) == (
        0, expected.text, "length", None)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(expected.prompt_token_ids), 12, len(expected.prompt_token_ids) + 12)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == MODEL
    assert r.system_fingerprint.startswith("fp_") and abs(r.created - time.time()) < 120


def test_every_prompt_form_gives_its_choices_in_order(api, llama_dir, config):
    texts, ids = ["def add(a, b):", "The quick brown fox"], [[5, 6, 7, 8], [9, 10]]
    expected = reference_outputs(llama_dir, config, texts + ids, GREEDY)
    kwargs = {"model": MODEL, "max_tokens": 12, "temperature": 0, "extra_body": IGNORE_EOS}
    for prompt, want in [(ids[0], expected[2:3]), (texts, expected[:2]), (ids, expected[2:])]:
        r = api.completions.create(prompt=prompt, **kwargs)
        assert [(c.index, c.text) for c in r.choices] == [(i, e.text) for i, e in enumerate(want)]
        assert r.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in want)
        assert r.usage.completion_tokens == 12 * len(want)


def test_streaming_text_equals_non_streaming_text_one_id_finish_reason_last_then_usage(api):
    kwargs = {"model": MODEL, "prompt": ["def add(a, b):", "In the beginning"], "max_tokens": 40,
              "temperature": 0, "extra_body": IGNORE_EOS}
    whole = api.completions.create(**kwargs)
    chunks = list(api.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and chunks[0].id != whole.id
    assert all(c.object == "text_completion" and c.model == MODEL for c in chunks)
    *deltas, last = chunks
    assert last.choices == [] and last.usage == whole.usage  # the usage chunk closes the stream
    assert all(c.usage is None and len(c.choices) == 1 for c in deltas)
    for choice in whole.choices:
        mine = [c.choices[0] for c in deltas if c.choices[0].index == choice.index]
        assert "".join(d.text for d in mine) == choice.text
        assert [d.finish_reason for d in mine] == [None] * (len(mine) - 1) + ["length"]
    plain = list(api.completions.create(**kwargs, stream=True))
    assert all(c.usage is None and c.choices for c in plain)  # no usage chunk unless asked


def test_n_3_with_a_seed_gives_three_seeded_completions(api, llama_dir, config):
    params = [ns.SamplingParams(max_tokens=16, temperature=1.0, seed=11 + i, ignore_eos=True)
              for i in range(3)]
    expected = reference_outputs(llama_dir, config, ["The quick brown fox"] * 3, params)
    kwargs = {"model": MODEL, "prompt": "The quick brown fox", "n": 3, "seed": 11, "max_tokens": 16,
              "temperature": 1.0, "extra_body": IGNORE_EOS}
    r = api.completions.create(**kwargs)
    assert [(c.index, c.text) for c in r.choices] == [(i, e.text) for i, e in enumerate(expected)]
    assert len({c.text for c in r.choices}) == 3  # choice i is seeded with seed + i
    assert r.usage.prompt_tokens == len(expected[0].prompt_token_ids) and r.usage.completion_tokens == 48
    assert [c.text for c in api.completions.create(**kwargs).choices] == [e.text for e in expected]


def test_stop_strings_end_the_text_before_them(api, llama_dir, config):
    [full] = reference_outputs(llama_dir, config, ["In the beginning"], ns.SamplingParams(
        max_tokens=40, temperature=0, ignore_eos=True))
    cut = next(i for i in range(4, len(full.text) - 2) if full.text.index(full.text[i:i + 2]) == i)
    stop = full.text[cut:cut + 2]
    kwargs = {"model": MODEL, "prompt": "In the beginning", "max_tokens": 40, "temperature": 0,
              "stop": [stop, "never in the text"], "extra_body": IGNORE_EOS}
    [choice] = api.completions.create(**kwargs).choices
    assert (choice.text, choice.finish_reason) == (full.text[:cut], "stop")
    chunks = list(api.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.text[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_renders_the_models_template_and_equals_llm_generate(api, llama_dir, config):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "def add(a, b):"}]
    ids = AutoTokenizer.from_pretrained(llama_dir).apply_chat_template(messages, add_generation_prompt=True,
                                                                       tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    [expected] = reference_outputs(llama_dir, config, [ids], GREEDY)
    kwargs = {"model": MODEL, "messages": messages, "temperature": 0, "extra_body": IGNORE_EOS}
    r = api.chat.completions.create(max_completion_tokens=12, **kwargs)
    [choice] = r.choices
    assert (choice.message.role, choice.message.content, choice.finish_reason) == (
        "assistant", expected.text, "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 12)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL
    assert api.chat.completions.create(max_tokens=12, **kwargs).choices[0].message.content == expected.text
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "def add(a, b):"}]}]
    assert api.chat.completions.create(max_tokens=12,
                                       **kwargs | {"messages": parts}).choices[0].message.content == \
        expected.text
    chunks = list(api.chat.completions.create(max_tokens=12, stream=True, **kwargs))
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]


def test_chat_without_max_tokens_may_fill_the_context(api, config):
    r = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0)
    # the model's max_position_embeddings
    assert r.choices[0].finish_reason == "stop" or r.usage.total_tokens == 512


def test_logprobs_equal_the_in_process_llms(api, llama_dir, config):
    [expected] = reference_outputs(llama_dir, config, ["def add(a, b):"], ns.SamplingParams(
        max_tokens=10, temperature=0, ignore_eos=True, logprobs=3))
    sampled = [row[t] for t, row in zip(expected.token_ids, expected.logprobs)]
    kwargs = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 10, "temperature": 0, "logprobs": 3,
              "extra_body": IGNORE_EOS}
    lp = api.completions.create(**kwargs).choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(sampled, abs=1e-5)  # float32 sums over other thread counts
    for top, row in zip(lp.top_logprobs, expected.logprobs):  # keyed by text: tokens with one text merge
        assert max(top.values()) == pytest.approx(max(row.values()), abs=1e-5)
        assert all(min(abs(v - r) for r in row.values()) < 1e-5 for v in top.values()), (top, row)
        assert len(top) <= len(row)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    streamed = [x for c in api.completions.create(**kwargs, stream=True)
                for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs

    chat = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "def add(a, b):"}],
                                       max_tokens=10, temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body=IGNORE_EOS).choices[0]
    ids = AutoTokenizer.from_pretrained(llama_dir).apply_chat_template(
        [{"role": "user", "content": "def add(a, b):"}], add_generation_prompt=True, tokenize=True)
    [expected] = reference_outputs(llama_dir, config,
                                   [list(ids["input_ids"] if hasattr(ids, "keys") else ids)],
                                   ns.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                     logprobs=2))
    content = chat.logprobs.content
    assert [c.logprob for c in content] == pytest.approx(
        [row[t] for t, row in zip(expected.token_ids, expected.logprobs)], abs=1e-5)
    assert [[t.logprob for t in c.top_logprobs] for c in content] == [
        pytest.approx(list(row.values())[:2], abs=1e-5) for row in expected.logprobs]
    special = {"<s>", "</s>", "<unk>"}  # in the logprobs, not in the text
    # a tiny random model's tokens need not join into valid UTF-8: the text shows U+FFFD where they do not
    assert b"".join(bytes(c.bytes) for c in content if c.token not in special).decode(errors="replace") == \
        chat.message.content


def test_an_adapter_loaded_over_http_is_listed_and_selected_by_model(api, url, llama_dir, config, tmp_path):
    from tests.models.test_lora import make_adapter

    path = make_adapter(llama_dir, tmp_path / "tests", seed=1)
    r = requests.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "tests", "lora_path": str(path)},
                      timeout=30)
    assert r.status_code == 200, r.text
    bad = requests.post(f"{url}/v1/load_lora_adapter",
                        json={"lora_name": "gone", "lora_path": str(tmp_path / "x")}, timeout=30)
    assert bad.status_code == 400 and "not a directory" in bad.json()["error"]["message"]
    models = {m.id: m for m in api.models.list().data}
    assert set(models) == {MODEL, "tests"}
    assert models["tests"].parent == MODEL and models[MODEL].parent is None
    assert models["tests"].root == str(path.resolve())
    [expected] = reference_outputs(llama_dir, config, ["def add(a, b):"], GREEDY, adapters={"tests": path})
    [base] = reference_outputs(llama_dir, config, ["def add(a, b):"], GREEDY)
    r = api.completions.create(model="tests", prompt="def add(a, b):", max_tokens=12, temperature=0,
                               extra_body=IGNORE_EOS)
    assert r.model == "tests" and r.choices[0].text == expected.text != base.text


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("path, body, status, param, match", [
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature",
     "greater than or equal to 0"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs", "less than or equal to 20"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    ("/v1/completions", {"prompt": "hi", "model": "nope"}, 404, "model", "model 'nope' does not exist"),
    ("/v1/chat/completions", CHAT | {"model": "nope"}, 404, "model", "GET /v1/models lists"),
    ("/v1/completions", {"prompt": [5] * 600}, 400, "prompt", "shorten the prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 600}]}, 400, "messages",
     "shorten the prompt"),
    ("/v1/completions", {"prompt": [5, 10**6]}, 400, "prompt", "outside the vocabulary"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature", "valid number"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt", "must be a string, a list of strings"),
    ("/v1/completions", {"prompt": "hi", "n": 1.5}, 400, "n", "valid integer"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop", "stop strings must be non-empty"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 5e-324}, 400, "repetition_penalty",
     "greater than or equal to 0.000001"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1.0}}, 400, "logit_bias", "token ids"),
    ("/v1/completions", {"prompt": "hi", "temperature": float("nan")}, 400, "temperature", "got nan"),
    ("/v1/completions", {"prompt": "hi", "top_p": float("inf")}, 400, "top_p", None),
    ("/v1/chat/completions", CHAT | {"presence_penalty": float("-inf")}, 400, "presence_penalty", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10 ** 12}, 400, "max_tokens", None),
    ("/v1/completions", {}, 400, "prompt", "prompt is required"),
    ("/v1/completions", {"prompt": "hi", "n": 100, "max_tokens": 2}, 429, None, "queue is full"),
    ("/v1/completions", {"prompt": ["hi"] * 65, "n": 2}, 400, "n", "at most 128"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", "valid list"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "at least 1 item"),
    ("/v1/chat/completions", CHAT | {"top_logprobs": 2}, 400, None, "top_logprobs needs logprobs: true"),
    ("/v1/chat/completions", CHAT | {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "less than"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "url": "x"}]}]},
     400, "messages[0].content", None),
])
def test_a_bad_request_gets_its_status_and_an_openai_error_body_and_service_goes_on(client, api, url, path,
                                                                                    body, status, param,
                                                                                    match):
    # json.dumps writes NaN and Infinity as Python's json reads them (requests' json= refuses to)
    r = requests.post(f"{url}{path}", data=json.dumps(body), headers={"Content-Type": "application/json"},
                      timeout=30)
    error = r.json()["error"]
    assert (r.status_code, set(error), error["param"]) == (status, ERROR_KEYS, param), error
    assert match is None or match in error["message"], error
    wait_for(lambda: idle(client), 30, "the admitted ones of a refused request to be cancelled")
    assert serves(api)


@pytest.mark.parametrize("body, status, code", [
    (b'{"prompt": "hi",', 400, "invalid_json"),
    (b'["prompt"]', 400, "invalid_body"),
    (b'{"prompt": "' + b"a" * (9 << 20) + b'"}', 413, "request_too_large"),
])
def test_malformed_and_oversized_bodies_get_openai_errors(api, url, body, status, code):
    r = requests.post(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"},
                      timeout=60)
    assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
    assert serves(api)


def test_curl_style_bodies_without_a_json_content_type_are_read_as_json(url):
    r = requests.post(f"{url}/v1/completions",
                      data=json.dumps({"prompt": "hi", "max_tokens": 3, "ignore_eos": True}),
                      headers={"Content-Type": "application/x-www-form-urlencoded"}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.load_sensitive
def test_a_full_deployment_answers_429_with_retry_after_and_serves_again(client, api, url):
    long = ns.SamplingParams(max_tokens=480, temperature=0, ignore_eos=True)
    # admitted and not streamed: the 24 stay outstanding until their callers (here) finish them
    admissions = ray.get([client.router.admit.remote(random_prompt(8, seed=700 + i), long)
                          for i in range(24)])
    try:
        r = requests.post(f"{url}/v1/completions", json={"prompt": "hi"}, timeout=30)
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):
            api.chat.completions.create(model=MODEL, **CHAT)
    finally:
        ray.get([client.router.finish.remote(a.request_id) for a in admissions])
    wait_for(lambda: idle(client), 30, "the cancelled requests to drain")
    assert serves(api)


@pytest.mark.load_sensitive
def test_requests_dropped_by_the_client_are_aborted_and_free_their_kv_blocks(client, api, url):
    wait_for(lambda: idle(client), 30, "an idle deployment")
    aborted = metric(scrape(url), "numaserve:request_success_total", finished_reason="abort")
    long = {"model": MODEL, "max_tokens": 480, "temperature": 0, "extra_body": IGNORE_EOS}
    with ThreadPoolExecutor(3) as pool, paused(client):  # none can run on to its 480 tokens before its close
        opening = [pool.submit(api.completions.create, prompt=random_prompt(8, seed=i), stream=True, **long)
                   for i in range(3)]  # each returns once its first token is out (the server's headers wait)
        wait_for(lambda: queued(client) == 3, 30, "the three requests to reach the workers")
        for _ in range(50):  # a step at a time, until each has its first token (a few tokens of 480 at most)
            if all(o.done() for o in opening):
                break
            advance(client)
            time.sleep(0.05)
        streams = [o.result() for o in opening]
        assert metric(scrape(url), "numaserve:num_requests_running") == 3
        assert metric(scrape(url), "numaserve:kv_cache_usage_perc") > 0
        for s in streams:
            s.close()

        def freed() -> dict | None:
            samples = scrape(url)
            gauges = [metric(samples, f"numaserve:{name}") for name in ("num_requests_running",
                                                                        "num_requests_waiting",
                                                                        "kv_cache_usage_perc")]
            return samples if gauges == [0, 0, 0] else None

        samples = wait_for(freed, 30, "/metrics to show the dropped streams' requests and KV blocks gone")
    assert metric(samples, "numaserve:request_success_total", finished_reason="abort") - aborted == 3
    assert idle(client)
    # a dropped non-streaming request: tests/http_api/test_http_server.py


def metric(samples: list, name: str, **labels) -> float:
    """The sum over workers of one sample name (with these labels)."""
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds")


def test_metrics_after_a_known_workload_count_exactly_and_histograms_are_ordered(client, api, url):
    wait_for(lambda: idle(client), 30, "an idle deployment")
    before = scrape(url)
    greedy = {"model": MODEL, "temperature": 0, "extra_body": IGNORE_EOS}
    answers = [api.completions.create(prompt=["def add(a, b):", "In the beginning", "x + y"], max_tokens=9,
                                      **greedy),
               api.completions.create(prompt="The quick brown fox", n=2, seed=3, max_tokens=5, **greedy),
               api.chat.completions.create(messages=[{"role": "user", "content": "hi"}], max_tokens=7,
                                           **greedy)]
    chunks = list(api.completions.create(prompt="x = 1", max_tokens=6, stream=True,
                                         stream_options={"include_usage": True}, **greedy))
    after = scrape(url)

    def delta(name: str, **labels) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    num_requests = 3 + 2 + 1 + 1
    # n=2 shares its prompt in usage, but each choice is a request that prefills it
    prompt_tokens = sum(a.usage.prompt_tokens for a in answers) + answers[1].usage.prompt_tokens + \
        chunks[-1].usage.prompt_tokens
    generation_tokens = sum(a.usage.completion_tokens for a in answers) + chunks[-1].usage.completion_tokens
    assert generation_tokens == 3 * 9 + 2 * 5 + 7 + 6
    assert delta("numaserve:request_success_total", finished_reason="length") == num_requests
    assert delta("numaserve:request_success_total") == num_requests
    assert delta("numaserve:prompt_tokens_total") == prompt_tokens
    assert delta("numaserve:generation_tokens_total") == generation_tokens
    # each admitted once, never preempted
    assert delta("numaserve:prefix_cache_queries_total") == prompt_tokens
    assert 0 <= delta("numaserve:prefix_cache_hits_total") <= prompt_tokens
    assert delta("numaserve:num_preemptions_total") == 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(f"numaserve:{name}_count") == num_requests, name
    # one token a step without speculation: an inter-token interval for each token after the first
    assert delta("numaserve:inter_token_latency_seconds_count") == generation_tokens - num_requests
    workers = {s.labels["worker"]: s.labels for s in after if s.name == "numaserve:num_requests_running"}
    assert set(workers) == {"local-numa0-0", "local-numa1-0"}
    assert {labels["numa_node"] for labels in workers.values()} == {"0", "1"}
    assert {labels["model_name"] for labels in workers.values()} == {MODEL}
    for worker in workers:
        for name in HISTOGRAMS:
            buckets = sorted((float(s.labels["le"]), s.value) for s in after
                             if s.name == f"numaserve:{name}_bucket" and s.labels["worker"] == worker)
            counts = [count for _, count in buckets]
            assert len(counts) > 10 and counts == sorted(counts), (name, worker, buckets)  # cumulative
            assert buckets[-1] == (float("inf"), metric(after, f"numaserve:{name}_count", worker=worker))
            assert metric(after, f"numaserve:{name}_sum", worker=worker) > 0
        assert metric(after, "numaserve:time_to_first_token_seconds_count", worker=worker) > 0  # both served


def test_fuzzing_the_schema_finds_no_server_error(client, url):
    # schemathesis' pytest integration (schema.parametrize, from_fixture) does not run under pytest 9: cases
    # come from its Hypothesis strategies instead, positive and negative, for each operation in turn
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models",
                                              "/health"}
    for operation in operations:
        cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE),
                          operation.as_strategy(GenerationMode.NEGATIVE))

        @given(case=cases)
        @settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def no_server_error(case):
            response = case.call(base_url=url, timeout=60)
            assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])

        no_server_error()


def test_the_workers_metrics_reach_rays_prometheus_export(client, api):
    assert serves(api)
    [node] = [n for n in ray.nodes() if n["Alive"]]
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"

    def exported() -> set | None:
        text = requests.get(url, timeout=10).text
        found = {s.labels.get("worker") for family in text_string_to_metric_families(text)
                 for s in family.samples if s.name.startswith("ray_numaserve_generation_tokens")}
        return found & {"local-numa0-0", "local-numa1-0"}

    wait_for(exported, 60, "Ray's export to show a worker's numaserve_generation_tokens")  # every few seconds
