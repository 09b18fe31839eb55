"""The request options clients send besides the sampling filters: logit_bias and min_tokens (the batched
sampler's sparse additions against a dense reference, and through the engine), prompt_logprobs (equal to
LLM.score on the same ids, whatever the prefix cache or chunking), best_of (the best candidate of those a
request of that many seeds gives), and LLM.embed (Hugging Face's last hidden states pooled)."""

import numpy as np
import pytest
import torch
from pydantic import ValidationError

import numaserve as ns
from models.sampling_batch import SamplingBatch
from scheduling.sampling.best_of import cumulative_logprob
from scheduling.sampling.sampler import sample_batch
from tests.conftest import random_prompt

FP32 = {"weight_dtype": "float32", "kv_dtype": "float32"}
PROMPT = random_prompt(40, seed=3)
EOS = 2  # tests/support/model_factory.py's


@pytest.fixture(scope="module")
def llm(module_llm, llama_dir):
    return module_llm(llama_dir, **FP32, max_num_seqs=64)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


# ---- logit_bias and min_tokens in the batched sampler ---------------------------------------------------

def test_sparse_additions_equal_a_dense_reference_for_greedy_and_seeded_rows():
    rng = np.random.default_rng(0)
    N, V = 12, 500
    logits = (rng.standard_normal((N, V)) * 3).astype(np.float32)
    logits[:, EOS] = logits.max(axis=1) + 5  # EOS would win where it is not banned
    positions = [10 + i for i in range(N)]  # prompt of 10: row i's output index is i
    params, dense = [], logits.copy()
    for i in range(N):
        bias = {int(t): float(b) for t, b in zip(rng.integers(0, V, 5), rng.uniform(-100, 100, 5))} \
            if i % 3 else None
        p = ns.SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, logit_bias=bias, min_tokens=6,
                              stop_token_ids=(7,), repetition_penalty=1.2 if i % 4 == 0 else 1.0,
                              max_tokens=20)
        params.append(p)
        for t, b in (bias or {}).items():
            dense[i, t] += np.float32(b)
        if i < 6:  # output shorter than min_tokens: EOS and the stop token banned
            dense[i, [EOS, 7]] = -np.inf
    histories = [list(range(10 + i)) for i in range(N)]
    sparse = SamplingBatch.build(params, list(range(N)), positions, histories, [10] * N, eos_token_ids=(EOS,))
    reference = SamplingBatch.build([p.model_copy(update={"logit_bias": None, "min_tokens": 0})
                                     for p in params], list(range(N)), positions, histories, [10] * N)
    before = logits.copy()
    assert sample_batch(logits, sparse).tolist() == sample_batch(dense, reference).tolist()
    assert np.array_equal(logits, before)  # the caller's logits are not modified
    tokens = sample_batch(logits, sparse)
    assert EOS not in tokens[:6] and EOS in tokens[6:]


def test_logit_bias_forces_a_token_and_leaves_other_rows_alone(llm):
    greedy = ns.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    alone = llm.generate(PROMPT, greedy)[0].token_ids
    forced = greedy.model_copy(update={"logit_bias": {77: 100.0}})
    banned = greedy.model_copy(update={"logit_bias": {t: -100.0 for t in set(alone)}})
    outs = llm.generate([PROMPT] * 3, [forced, greedy, banned])
    assert outs[0].token_ids == [77] * 8
    assert outs[1].token_ids == alone  # an unbiased row in the same batch
    assert not set(outs[2].token_ids) & set(alone)


def test_invalid_logit_bias_is_refused_naming_it(llm):
    with pytest.raises(ns.InvalidRequest, match=r"logit_bias \[384, 999\] are outside the vocabulary"):
        llm.generate(PROMPT, ns.SamplingParams(logit_bias={5: 1.0, 384: 1.0, 999: -1.0}))
    with pytest.raises(ValidationError, match=r"\[-100, 100\]"):
        ns.SamplingParams(logit_bias={5: 100.5})
    with pytest.raises(ValidationError, match="min_tokens=9 exceeds max_tokens=8"):
        ns.SamplingParams(min_tokens=9, max_tokens=8)


def test_min_tokens_holds_back_eos_stop_token_ids_and_stop_strings(llm):
    eos_first = ns.SamplingParams(max_tokens=20, temperature=0, logit_bias={EOS: 50.0})
    assert llm.generate(PROMPT, eos_first)[0].token_ids == [EOS]
    out = llm.generate(PROMPT, eos_first.model_copy(update={"min_tokens": 5}))[0]
    assert out.token_ids[-1] == EOS and EOS not in out.token_ids[:-1] and len(out.token_ids) == 6
    assert out.finish_reason == "stop"
    stop_first = ns.SamplingParams(max_tokens=20, temperature=0.9, seed=4, logit_bias={9: 50.0},
                                   stop_token_ids=(9,))
    out = llm.generate(PROMPT, stop_first.model_copy(update={"min_tokens": 7}))[0]
    assert out.token_ids[-1] == 9 and 9 not in out.token_ids[:-1] and len(out.token_ids) == 8
    # a stop string in the first token's text ends nothing before min_tokens
    greedy = ns.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    full = llm.generate(PROMPT, greedy)[0]
    stop = full.text[:1]
    assert llm.generate(PROMPT, greedy.model_copy(update={"stop": stop}))[0].text == ""
    held = llm.generate(PROMPT, greedy.model_copy(update={"stop": stop, "min_tokens": 12}))[0]
    assert held.token_ids == full.token_ids and held.text == full.text


# ---- prompt_logprobs ------------------------------------------------------------------------------------

def check_prompt_logprobs(rows, ids: list[int], logits: np.ndarray, k: int) -> None:
    """rows: [None, then one dict per prompt token]; logits: LLM.score(ids)."""
    reference = log_softmax(logits)
    assert rows[0] is None and len(rows) == len(ids)
    for p in range(1, len(ids)):
        row = rows[p]
        top = np.argsort(-reference[p - 1], kind="stable")[:k].tolist()
        assert list(row)[:k] == top
        assert set(row) == set(top) | {ids[p]}
        for t, value in row.items():
            np.testing.assert_allclose(value, reference[p - 1, t], atol=1e-5, rtol=0)


@pytest.mark.parametrize("engine", [{}, {"max_num_batched_tokens": 16}], ids=["one pass", "chunked"])
def test_prompt_logprobs_equal_score_with_prefix_cache_and_chunks(llama_dir, engine):
    ids = random_prompt(70, seed=11)
    params = ns.SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=3, logprobs=2)
    with ns.LLM(llama_dir, **FP32, enable_prefix_caching=True, **engine) as llm:
        logits = llm.score(ids)
        plain = llm.generate(ids, ns.SamplingParams(max_tokens=3, temperature=0))[0]  # fills the prefix cache
        hits = llm.stats()["num_prefix_hit_tokens"]
        out = llm.generate(ids, params)[0]
        assert llm.stats()["num_prefix_hit_tokens"] == hits  # the scored request read no cached block
        again = llm.generate(ids, ns.SamplingParams(max_tokens=3, temperature=0))[0]
        assert llm.stats()["num_prefix_hit_tokens"] > hits  # while a plain one does
    check_prompt_logprobs(out.prompt_logprobs, ids, logits, 3)
    assert out.token_ids == plain.token_ids == again.token_ids
    assert plain.prompt_logprobs is None and out.logprobs is not None


def test_prompt_logprobs_of_a_batch_and_after_preemption(llama_dir):
    prompts = [random_prompt(n, seed=n) for n in (5, 33, 64)]
    params = ns.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, prompt_logprobs=0)
    # a pool of 10 blocks of 16: three requests growing to 104 tokens preempt each other
    with ns.LLM(llama_dir, **FP32, kv_cache_bytes=10 * 16 * 2 * 2 * 24 * 4 * 2) as llm:
        logits = [llm.score(p) for p in prompts]
        outs = llm.generate(prompts, params)
        assert llm.stats()["num_preemptions"] > 0
        alone = [llm.generate(p, params)[0] for p in prompts]
    for p, lg, out, one in zip(prompts, logits, outs, alone):
        check_prompt_logprobs(out.prompt_logprobs, p, lg, 0)
        assert out.token_ids == one.token_ids


def test_prompt_logprobs_streamed_requests_and_limits(llm):
    with pytest.raises(ns.InvalidRequest, match="prompt_logprobs"):
        llm.session().sequence().generate(PROMPT, ns.SamplingParams(prompt_logprobs=1))
    with pytest.raises(ValidationError):
        ns.SamplingParams(prompt_logprobs=21)


# ---- best_of --------------------------------------------------------------------------------------------

def test_best_of_returns_the_candidate_of_highest_cumulative_logprob(llm):
    params = ns.SamplingParams(max_tokens=10, temperature=1.0, seed=40, ignore_eos=True)
    candidates = llm.generate([PROMPT] * 5, [params.model_copy(update={"seed": 40 + i, "logprobs": 0})
                                             for i in range(5)])
    scores = [cumulative_logprob(c.token_ids, c.logprobs) for c in candidates]
    best = candidates[int(np.argmax(scores))]
    assert len({tuple(c.token_ids) for c in candidates}) > 1  # the choice mattered
    out = llm.generate([PROMPT, PROMPT], params.model_copy(update={"best_of": 5}))
    assert [o.token_ids for o in out] == [best.token_ids] * 2  # reproducible
    assert out[0].logprobs is None  # asked only to rank
    with_logprobs = llm.generate(PROMPT, params.model_copy(update={"best_of": 5, "logprobs": 1}))[0]
    assert with_logprobs.token_ids == best.token_ids and len(with_logprobs.logprobs) == 10
    for single in (lambda p: next(llm.stream(PROMPT, p)),
                   lambda p: llm.session().sequence().generate(PROMPT, p)):
        with pytest.raises(ns.InvalidRequest, match="best_of=2 is served by LLM.generate"):
            single(params.model_copy(update={"best_of": 2}))


# ---- embeddings -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embed_equals_hf_last_hidden_states_pooled(llm, hf_models, pooling):
    prompts = [random_prompt(n, seed=50 + n) for n in (1, 7, 40)]
    ours = llm.embed(prompts, pooling=pooling)
    raw = llm.embed(prompts, pooling=pooling, normalize=False)
    assert ours.shape == (3, 64) and ours.dtype == np.float32
    for prompt, e, r in zip(prompts, ours, raw):
        with torch.no_grad():
            hidden = hf_models["llama"](torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1]
        hidden = hidden[0].double().numpy()
        pooled = hidden[-1] if pooling == "last" else hidden.mean(axis=0)
        np.testing.assert_allclose(r, pooled, atol=1e-4, rtol=0)
        np.testing.assert_allclose(e, pooled / np.linalg.norm(pooled), atol=1e-5, rtol=0)
    with pytest.raises(ns.InvalidRequest, match="pooling"):
        llm.embed(prompts, pooling="cls")
    assert llm.stats()["num_running"] == 0
