"""Sampling: reproducible seeds, filters that restrict the distribution as documented, logprobs, stops."""

import json
import shutil

import numpy as np
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

import numaserve as ns
from scheduling.sampler import apply_penalties, sampling_probs
from tests.conftest import random_prompt

PROMPT = random_prompt(12, seed=7)
NUM_SAMPLES = 400


@pytest.fixture(scope="module")
def llm(llama_dir):
    return ns.LLM(llama_dir, weight_dtype="float32", kv_dtype="float32", max_num_seqs=256,
                  max_num_batched_tokens=1024)


@pytest.fixture(scope="module")
def next_token_logits(llm):
    return llm.score(PROMPT)[-1]


def first_tokens(llm, **params) -> np.ndarray:
    """The first sampled token of NUM_SAMPLES requests with seeds 0..NUM_SAMPLES-1, in one batch."""
    outs = llm.generate([PROMPT] * NUM_SAMPLES,
                        [ns.SamplingParams(max_tokens=1, seed=s, **params) for s in range(NUM_SAMPLES)])
    return np.array([o.token_ids[0] for o in outs])


def test_same_seed_same_tokens_alone_or_batched(llm):
    params = ns.SamplingParams(max_tokens=20, temperature=1.0, seed=123)
    alone = llm.generate(PROMPT, params)[0].token_ids
    batched = llm.generate([random_prompt(30, seed=1), PROMPT, random_prompt(5, seed=2)],
                           [ns.SamplingParams(max_tokens=20, seed=9), params, ns.SamplingParams(max_tokens=20)])
    assert batched[1].token_ids == alone
    other_seed = llm.generate(PROMPT, params.model_copy(update={"seed": 124}))[0].token_ids
    assert other_seed != alone


def test_top_k_1_equals_greedy(llm):
    greedy = llm.generate(PROMPT, ns.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    top1 = llm.generate(PROMPT, ns.SamplingParams(max_tokens=24, temperature=1.3, top_k=1, seed=5,
                                                  ignore_eos=True))[0]
    assert top1.token_ids == greedy.token_ids


def test_top_k_keeps_only_the_k_most_likely(llm, next_token_logits):
    allowed = set(np.argsort(-next_token_logits)[:5].tolist())
    tokens = first_tokens(llm, top_k=5)
    assert set(tokens.tolist()) <= allowed
    assert len(set(tokens.tolist())) > 1


def test_top_p_keeps_the_smallest_set_reaching_p(llm, next_token_logits):
    probs = np.exp(next_token_logits - next_token_logits.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    size = int(np.searchsorted(np.cumsum(probs[order]), 0.5) + 1)
    tokens = first_tokens(llm, top_p=0.5)
    assert set(tokens.tolist()) <= set(order[:size].tolist())
    assert len(set(tokens.tolist())) > 1


def test_min_p_drops_tokens_below_fraction_of_top(llm, next_token_logits):
    probs = np.exp(next_token_logits - next_token_logits.max())  # relative to the top probability
    tokens = first_tokens(llm, min_p=0.3)
    assert all(probs[t] >= 0.3 for t in tokens)


def test_temperature_sharpens_and_flattens(llm, next_token_logits):
    top = int(np.argmax(next_token_logits))
    cold = np.mean(first_tokens(llm, temperature=0.25) == top)
    warm = np.mean(first_tokens(llm, temperature=1.0) == top)
    hot = np.mean(first_tokens(llm, temperature=3.0) == top)
    assert cold > warm > hot
    # at temperature 1 the empirical frequency of the top token matches the model within 4 sigma
    p = sampling_probs(next_token_logits, ns.SamplingParams(temperature=1.0))[top]
    assert abs(warm - p) < 4 * np.sqrt(p * (1 - p) / NUM_SAMPLES)


def test_logprobs_are_the_models_top_k(llm, next_token_logits):
    out = llm.generate(PROMPT, ns.SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 4
    first = out.logprobs[0]
    expected = torch.log_softmax(torch.tensor(next_token_logits, dtype=torch.float64), -1).numpy()
    top3 = np.argsort(-expected)[:3]
    assert list(first)[:3] == top3.tolist()
    for token, lp in first.items():
        assert lp == pytest.approx(expected[token], abs=1e-5)
    for step, token in zip(out.logprobs, out.token_ids):
        assert token in step and all(v <= 0 for v in step.values())
    assert llm.generate(PROMPT, ns.SamplingParams(max_tokens=2))[0].logprobs is None


def test_repetition_penalty_matches_transformers():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=50).astype(np.float32)
    prompt, output = [3, 7, 7, 9], [9, 11]
    ours = apply_penalties(logits, prompt, output, ns.SamplingParams(repetition_penalty=1.7))
    ref = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), torch.tensor(logits)[None])[0]
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6)


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = np.zeros(10, np.float32)
    out = apply_penalties(logits, [1, 1, 1], [4, 4, 5], ns.SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    expected = np.zeros(10)
    expected[4] = -(0.5 + 2 * 0.25)
    expected[5] = -(0.5 + 1 * 0.25)
    np.testing.assert_allclose(out, expected)


def test_stop_string_is_cut_and_streaming_agrees(llm):
    params = ns.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    full = llm.generate("The quick brown", params)[0]
    stop = full.text[10:13]
    assert len(full.text) > 13 and stop
    stopped = llm.generate("The quick brown", params.model_copy(update={"stop": (stop,)}))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[:full.text.index(stop)]
    assert stopped.token_ids == full.token_ids[:len(stopped.token_ids)]
    streamed = "".join(llm.stream("The quick brown", params.model_copy(update={"stop": (stop,)})))
    assert streamed == stopped.text
    assert "".join(llm.stream("The quick brown", params)) == full.text


def test_stop_token_ids_and_eos_end_with_stop(llm, llama_dir, tmp_path):
    params = ns.SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    full = llm.generate(PROMPT, params)[0].token_ids
    stop_token = full[5]
    out = llm.generate(PROMPT, params.model_copy(update={"stop_token_ids": (stop_token,)}))[0]
    assert out.finish_reason == "stop" and out.token_ids == full[:full.index(stop_token) + 1]
    # the same token declared as the model's eos in generation_config.json
    shutil.copytree(llama_dir, tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop_token]}))
    eos_llm = ns.LLM(tmp_path / "m", weight_dtype="float32", kv_dtype="float32")
    out = eos_llm.generate(PROMPT, ns.SamplingParams(max_tokens=30, temperature=0))[0]
    assert out.finish_reason == "stop" and out.token_ids == full[:full.index(stop_token) + 1]
    ignored = eos_llm.generate(PROMPT, params)[0]
    assert ignored.finish_reason == "length" and ignored.token_ids == full
