"""Issue #28's request options over HTTP, through build_app and the real `openai` client on 127.0.0.1 against
one in-process ns.LLM (no Ray): logit_bias with OpenAI's string keys, min_tokens, best_of (n <= best_of; not
with stream), echo with logprobs in OpenAI's completions shape, vLLM's prompt_logprobs, and /v1/embeddings
(strings, token ids, float and base64, the server's pooling, usage) equal to what ns.LLM gives in process."""

import base64
import itertools

import numpy as np
import openai
import pytest
import requests

import numaserve as ns
from cluster_configs.cluster_config import HttpConfig
from http_api.app import build_app
from http_api.responses import TokenTexts
from http_api.serving import OpenAIServing
from tests.conftest import random_prompt
from tests.support.http_app import served
from tests.support.local_deployment import LocalDeployment

FP32 = {"weight_dtype": "float32", "kv_dtype": "float32"}
EOS = 2
_ids = itertools.count()


@pytest.fixture(scope="module")
def llm(module_llm, llama_dir):
    return module_llm(llama_dir, **FP32, max_num_seqs=64)


def serve(llm: ns.LLM, config: HttpConfig):
    """The real app over llm, served in this process (a context manager -> its URL)."""
    serving = OpenAIServing(LocalDeployment(llm), "tiny", "/tiny", None, False, "fp_t", config)
    return served(build_app(serving))


@pytest.fixture(scope="module", params=["last", "mean"])
def api(llm, request):
    with serve(llm, HttpConfig(pooling=request.param)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), url, request.param


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


PROMPT = random_prompt(24, seed=8)


def test_logit_bias_and_min_tokens_as_in_process(llm, api):
    client, *_ = api
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                    logit_bias={"77": 100}, extra_body={"ignore_eos": True})
    expected = llm.generate(PROMPT, ns.SamplingParams(max_tokens=6, temperature=0, logit_bias={77: 100.0},
                                                      ignore_eos=True))[0]
    assert expected.token_ids == [77] * 6 and out.choices[0].text == expected.text
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0,
                                    logit_bias={str(EOS): 50}, extra_body={"min_tokens": 5})
    assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "stop"
    nulls = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True, "min_tokens": None, "best_of": None,
                                                  "logit_bias": None, "prompt_logprobs": None})
    assert nulls.usage.completion_tokens == 6  # null is absent
    with pytest.raises(openai.BadRequestError, match=r"logit_bias \[999\] are outside the vocabulary"):
        client.completions.create(model="tiny", prompt=PROMPT, logit_bias={"999": 1})
    with pytest.raises(openai.BadRequestError, match="logit_bias keys must be token ids"):
        client.completions.create(model="tiny", prompt=PROMPT, logit_bias={"x": 1})
    with pytest.raises(openai.BadRequestError, match=r"\[-100, 100\]"):
        client.completions.create(model="tiny", prompt=PROMPT, logit_bias={"5": 101})


def test_best_of_returns_the_n_best_candidates(llm, api):
    client, *_ = api
    params = ns.SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True, logprobs=0)
    candidates = llm.generate([PROMPT] * 4, [params.model_copy(update={"seed": 60 + i}) for i in range(4)])
    scores = [sum(lp[t] for t, lp in zip(c.token_ids, c.logprobs)) for c in candidates]
    best = [candidates[i].text for i in np.argsort(scores, kind="stable")[::-1][:2]]
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=2, best_of=4, seed=60,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in out.choices] == best and [c.index for c in out.choices] == [0, 1]
    assert all(c.logprobs is None for c in out.choices)
    assert out.usage.completion_tokens == 32  # every candidate's tokens
    with pytest.raises(openai.BadRequestError, match="best_of must be >= n"):
        client.completions.create(model="tiny", prompt=PROMPT, n=3, best_of=2)
    with pytest.raises(openai.BadRequestError, match="cannot be used with stream"):
        client.completions.create(model="tiny", prompt=PROMPT, best_of=2, stream=True)
    # best_of = n (clients send best_of 1): the n choices, streamed or not
    streamed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, best_of=1, seed=60,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == candidates[0].text


def check_scored(token_logprobs, top_logprobs, prompt: list[int], logits: np.ndarray, k: int, texts) -> None:
    reference = log_softmax(logits)
    assert token_logprobs[0] is None and top_logprobs[0] is None
    for p in range(1, len(prompt)):
        np.testing.assert_allclose(token_logprobs[p], reference[p - 1, prompt[p]], atol=1e-5, rtol=0)
        top = np.argsort(-reference[p - 1], kind="stable")[:k]
        assert {texts(t) for t in top} <= set(top_logprobs[p])


def test_echo_with_logprobs_scores_the_prompt_in_openais_shape(llm, api):
    client, *_ = api
    logits = llm.score(PROMPT)
    texts = TokenTexts(llm.tokenizer).text
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                    logprobs=2, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    generated = llm.generate(PROMPT, ns.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                                                       logprobs=2))[0]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(PROMPT) + 3
    check_scored(lp.token_logprobs, lp.top_logprobs, PROMPT, logits, 2, lambda t: texts(int(t)))
    for value, token, row in zip(lp.token_logprobs[len(PROMPT):], generated.token_ids, generated.logprobs):
        np.testing.assert_allclose(value, row[token], atol=1e-6, rtol=0)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert out.choices[0].text.endswith(generated.text) and out.usage.prompt_tokens == len(PROMPT)
    streamed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                         logprobs=2, stream=True, extra_body={"ignore_eos": True})
    tokens, values = [], []
    for chunk in streamed:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
            values += chunk.choices[0].logprobs.token_logprobs
    assert tokens == lp.tokens and values == lp.token_logprobs


def test_vllm_prompt_logprobs(llm, api):
    client, *_ = api
    logits = llm.score(PROMPT)
    reference = log_softmax(logits)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 3})
    rows = out.choices[0].model_extra["prompt_logprobs"]
    assert rows[0] is None and len(rows) == len(PROMPT)
    for p in range(1, len(PROMPT)):
        top = np.argsort(-reference[p - 1], kind="stable")[:3].tolist()
        assert [int(t) for t in rows[p]][:3] == top
        assert [v["rank"] for v in rows[p].values()][:3] == [1, 2, 3]
        np.testing.assert_allclose(rows[p][str(PROMPT[p])]["logprob"], reference[p - 1, PROMPT[p]],
                                   atol=1e-5, rtol=0)
    assert out.choices[0].logprobs is None


def test_embeddings_equal_llm_embed_in_float_and_base64(llm, api):
    client, url, pooling = api
    texts = ["The quick brown fox", "def add(a, b):"]
    expected = llm.embed(texts, pooling=pooling)
    as_float = client.embeddings.create(model="tiny", input=texts, encoding_format="float")
    got = np.array([d.embedding for d in as_float.data], np.float32)
    assert np.array_equal(got, expected) and [d.index for d in as_float.data] == [0, 1]
    ids = [llm.tokenizer.encode(t) for t in texts]
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens == sum(map(len, ids))
    # the openai client asks for base64 unless told otherwise, and decodes it
    as_base64 = client.embeddings.create(model="tiny", input=ids)
    assert np.array_equal(np.array([d.embedding for d in as_base64.data], np.float32), expected)
    raw = requests.post(f"{url}/v1/embeddings", json={"input": PROMPT, "encoding_format": "base64"}).json()
    one = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    assert np.array_equal(one, llm.embed(PROMPT, pooling=pooling)[0])
    bad = requests.post(f"{url}/v1/embeddings", json={"input": [[999]]})
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]
    assert requests.post(f"{url}/v1/embeddings", json={"input": []}).status_code == 400
