"""Sampling: reproducible seeds, filters that restrict the distribution as documented, logprobs, stops; the
batched sampler against the per-request reference (same greedy tokens, same distributions, keyed draws)."""

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch
from numba import njit
from transformers import RepetitionPenaltyLogitsProcessor

import numaserve as ns
from kernels.sampling.filters import _filter_row
from kernels.sampling.race import _uniform, race_all, race_kept
from models.sampling_batch import SamplingBatch
from scheduling.sampling.sampler import (
    apply_penalties_batch,
    request_seed,
    row_keys,
    sample_batch,
    top_logprobs_batch,
)
from tests.conftest import random_prompt
from tests.support.chi_square import chi_square_p_value
from tests.support.reference_sampler import apply_penalties, sample, sampling_probs

PROMPT = random_prompt(12, seed=7)
NUM_SAMPLES = 400


@pytest.fixture(scope="module")
def llm(module_llm, llama_dir):
    return module_llm(llama_dir, weight_dtype="float32", kv_dtype="float32", max_num_seqs=256,
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
                           [ns.SamplingParams(max_tokens=20, seed=9), params,
                            ns.SamplingParams(max_tokens=20)])
    assert batched[1].token_ids == alone
    other_seed = llm.generate(PROMPT, params.model_copy(update={"seed": 124}))[0].token_ids
    assert other_seed != alone


SEEDED_FILTERS = [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9},
                  {"top_k": 20, "repetition_penalty": 1.2},
                  {"min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": 0.3},
                  {"temperature": 1.3, "top_k": 50, "top_p": 0.95}, {"temperature": 0.0}]


def test_seeded_requests_give_the_same_tokens_alone_batched_or_preempted(llm, llama_dir):
    """Each request's draws are keyed by (its seed, position): the batch around it, chunked prefill and a
    preemption (recompute) change none of its tokens."""
    prompts = [random_prompt(n, seed=60 + i)
               for i, n in enumerate((1, 300, 17, 64, 3, 128, 250, 9, 33, 200, 2, 90))]
    params = [ns.SamplingParams(max_tokens=24, seed=500 + i, ignore_eos=True,
                                **SEEDED_FILTERS[i % len(SEEDED_FILTERS)])
              for i in range(len(prompts))]
    alone = [llm.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params)]
    assert [o.token_ids for o in llm.generate(prompts, params)] == alone
    bytes_per_block = 4 * 2 * 2 * 2 * 24 * 4  # block_size * (k, v) * layers * kv_heads * head_dim * fp32
    small = ns.LLM(llama_dir, weight_dtype="float32", kv_dtype="float32", block_size=4,
                   kv_cache_bytes=96 * bytes_per_block, max_num_batched_tokens=64)
    assert [o.token_ids for o in small.generate(prompts, params)] == alone
    assert small.stats()["num_preemptions"] > 0


def test_top_k_1_equals_greedy(llm):
    greedy = llm.generate(PROMPT, ns.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    top1 = llm.generate(PROMPT, ns.SamplingParams(max_tokens=24, temperature=1.3, top_k=1, seed=5,
                                                  ignore_eos=True))[0]
    assert top1.token_ids == greedy.token_ids


def test_a_temperature_below_the_floor_is_greedy(llm):
    # 5e-324 (the fuzzer's): logits / temperature overflowed to inf - inf = nan, every weight 0, a 500
    greedy = llm.generate(PROMPT, ns.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    for tiny in (5e-324, 1e-300, 9.9e-6):
        params = ns.SamplingParams(max_tokens=24, temperature=tiny, top_p=5e-324, ignore_eos=True)
        assert params.greedy and llm.generate(PROMPT, params)[0].token_ids == greedy.token_ids


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
    ref = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]),
                                                torch.tensor(logits)[None])[0]
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6)


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = np.zeros(10, np.float32)
    out = apply_penalties(logits, [1, 1, 1], [4, 4, 5],
                          ns.SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
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


# ---- the batched sampler against the per-request reference ---------------------------------------------

MIN_P_VALUE = 1e-3  # the chi-square tests are seeded: each passes or fails deterministically
NUM_DRAWS = 20_000
PENALTIES = [{}, {"repetition_penalty": 1.3}, {"presence_penalty": 0.7, "frequency_penalty": 0.4},
             {"repetition_penalty": 1.1, "presence_penalty": -0.5, "frequency_penalty": 0.9},
             {"repetition_penalty": 0.8}]
FILTERS = [{"temperature": 0.7, "top_p": 0.9}, {"temperature": 1.3}, {"top_k": 40},
           {"temperature": 0.8, "top_k": 40, "top_p": 0.8}, {"min_p": 0.05}, {"top_p": 0.5, "min_p": 0.1},
           {"temperature": 1.5, "top_k": 500, "top_p": 0.95, "min_p": 0.02},
           {"temperature": 0.05, "top_p": 0.99},
           {"top_p": 0.3, "repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.3},
           {"top_p": 1e-6}, {"top_k": 100_000}, {"min_p": 1.0}]


class Req:
    """What the sampler reads from a request."""

    def __init__(self, params: ns.SamplingParams, token_ids: list[int], num_prompt_tokens: int, seed=None):
        self.params, self.token_ids, self.num_prompt_tokens = params, list(token_ids), num_prompt_tokens
        if seed is not None:
            self.seed = seed

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


def requests_for(logits: np.ndarray, params: dict, seed: int = 0) -> list[Req]:
    """One request per row: 8 random prompt tokens, then an output holding its row's most likely token
    twice (so penalties change the outcome), and some random ones, also repeated."""
    rng = np.random.default_rng(seed)
    reqs = []
    for i, row in enumerate(logits):
        prompt = rng.integers(0, row.shape[0], 8).tolist()
        output = [int(np.argmax(row))] * 2 + rng.integers(0, row.shape[0], 3).tolist() * 2
        reqs.append(Req(ns.SamplingParams(seed=1000 + i, **params), prompt + output, num_prompt_tokens=8))
    return reqs


def batch_of(reqs: list[Req], positions: list[int] | None = None) -> SamplingBatch:
    """The requests' rows as the engine's step builds them (scheduling/sampling/step_sampler.py): position
    len(token_ids) unless given."""
    seeds = [request_seed(r.params) if getattr(r, "seed", None) is None else r.seed for r in reqs]
    where = [len(r.token_ids) for r in reqs] if positions is None else positions
    return SamplingBatch.build([r.params for r in reqs], seeds, where, [r.token_ids for r in reqs],
                               [r.num_prompt_tokens for r in reqs])


def sample_requests(logits: np.ndarray, reqs: list[Req], positions: list[int] | None = None) -> np.ndarray:
    return sample_batch(logits, batch_of(reqs, positions))


def penalize_requests(logits: np.ndarray, reqs: list[Req]) -> np.ndarray:
    return apply_penalties_batch(logits, batch_of(reqs))


def reference_probs(logits: np.ndarray, reqs: list[Req]) -> np.ndarray:
    return np.stack([sampling_probs(apply_penalties(x, r.token_ids[:r.num_prompt_tokens], r.output_token_ids,
                                                    r.params), r.params) for x, r in zip(logits, reqs)])


@njit(cache=True)
def filtered_probs(logits, temperature, top_k, top_p, min_p, out):
    """out[i] = row i's distribution as the sampling kernel filters it. logits: [N, V] f32; out: [N, V]
    f64."""
    V = logits.shape[1]
    scratch = np.empty(V)
    idx = np.empty(V, np.int64)
    for i in range(logits.shape[0]):
        w = out[i]
        n, total = _filter_row(logits[i], temperature[i], top_k[i], top_p[i], min_p[i], w, idx)
        if n < 0:
            for j in range(V):
                w[j] /= total
        else:
            scratch[:n] = w[idx[:n]]
            w[:] = 0.0
            for m in range(n):
                w[idx[m]] = scratch[m] / total


def sampling_probs_batch(logits: np.ndarray, reqs: list[Req]) -> np.ndarray:
    """[N, V] float64: the distribution each row's request samples from, batched as the sampler does (its
    penalties, then kernels/sampling/filters.py's filters; one-hot at the argmax for a greedy request)."""
    logits = penalize_requests(np.asarray(logits, np.float32), reqs)
    out = np.zeros(logits.shape)
    greedy = np.array([r.params.greedy for r in reqs], bool)
    rows = np.flatnonzero(~greedy)
    if rows.size:
        params = [reqs[i].params for i in rows]
        probs = np.empty((rows.size, logits.shape[1]))
        filtered_probs(np.ascontiguousarray(logits[rows]),
                       np.array([p.temperature for p in params], np.float64),
                       np.array([p.top_k for p in params], np.int64),
                       np.array([p.top_p for p in params], np.float64),
                       np.array([p.min_p for p in params], np.float64), probs)
        out[rows] = probs
    greedy_rows = np.flatnonzero(greedy)
    out[greedy_rows, np.argmax(logits[greedy_rows], axis=1)] = 1.0
    return out


def llm_like_logits(num_rows: int, vocab: int, seed: int) -> np.ndarray:
    """Heavy-tailed rows (a few tokens far above a broad floor), and some exact ties, like a trained
    model's."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_rows, vocab)) * 2.0
    x[:, rng.integers(0, vocab, 30)] += rng.gamma(2.0, 4.0, (num_rows, 30))
    return x.astype(np.float32)


@pytest.mark.parametrize("penalties", PENALTIES, ids=str)
def test_greedy_tokens_equal_the_per_request_sampler(penalties):
    logits = llm_like_logits(48, 32000, seed=1)
    logits[:, 7] = logits.max(axis=1) - 0.01  # a near tie, so penalties decide which wins
    reqs = requests_for(logits, {"temperature": 0.0, **penalties})
    # greedy through top_k
    reqs += requests_for(logits, {"temperature": 1.3, "top_k": 1, **penalties}, seed=1)
    rows = np.concatenate([logits, logits])
    reference = [sample(apply_penalties(x, r.token_ids[:r.num_prompt_tokens], r.output_token_ids, r.params),
                        r.params, None) for x, r in zip(rows, reqs)]
    assert sample_requests(rows, reqs).tolist() == reference
    mixed = sample_requests(np.concatenate([rows, logits[:8]]),
                            reqs + requests_for(logits[:8], {"top_p": 0.9}))
    assert mixed[:len(reqs)].tolist() == reference  # greedy rows among sampled ones
    if penalties.get("repetition_penalty", 1.0) > 1.0 or penalties.get("frequency_penalty", 0.0) > 0.0:
        # the penalties lowered the top token: it mattered
        assert reference != np.argmax(rows, axis=1).tolist()


@pytest.mark.parametrize("penalties", PENALTIES[1:], ids=str)
def test_batched_penalties_equal_the_reference_exactly(penalties):
    logits = llm_like_logits(16, 5000, seed=2)
    before = logits.copy()
    reqs = requests_for(logits, penalties)
    reqs[3] = Req(ns.SamplingParams(), reqs[3].token_ids, 8)  # rows without penalties in the same batch
    reqs[5].token_ids = reqs[5].token_ids[:8]  # no output yet: presence / frequency do not apply
    expected = np.stack([apply_penalties(x, r.token_ids[:8], r.output_token_ids, r.params)
                         for x, r in zip(logits, reqs)])
    assert np.array_equal(penalize_requests(logits, reqs), expected)
    assert np.array_equal(logits, before)  # the caller's logits are not modified


def test_without_penalties_the_logits_are_not_copied():
    logits = llm_like_logits(4, 100, seed=3)
    assert penalize_requests(logits, requests_for(logits, {"top_p": 0.5})) is logits


@pytest.mark.parametrize("params", FILTERS, ids=str)
def test_filtered_distributions_equal_the_reference(params):
    """Same support (every keep / drop decision of top-k, top-p, min-p) and the same probabilities."""
    rng = np.random.default_rng(4)
    logits = np.concatenate([
        llm_like_logits(6, 32000, seed=5),
        (rng.standard_normal((2, 32000)) * 2.5).astype(np.float32),  # the benchmark's flat rows
        rng.integers(-6, 6, (2, 32000)).astype(np.float32),  # ties everywhere, at every boundary
        np.where(rng.random((1, 32000)) < 0.9, -np.inf,
                 rng.standard_normal((1, 32000))).astype(np.float32),  # masked
        np.zeros((1, 32000), np.float32),  # all equal
    ])
    reqs = requests_for(logits, params)
    ours, reference = sampling_probs_batch(logits, reqs), reference_probs(logits, reqs)
    for i in range(len(reqs)):
        assert np.array_equal(ours[i] > 0, reference[i] > 0), f"row {i}: kept sets differ"
        np.testing.assert_allclose(ours[i], reference[i], rtol=1e-12, atol=1e-15, err_msg=f"row {i}")


def test_filtered_distributions_equal_the_reference_on_small_vocabularies():
    rng = np.random.default_rng(6)
    for vocab in (1, 2, 3, 17):
        for params in FILTERS:
            logits = rng.standard_normal((3, vocab)).astype(np.float32)
            reqs = [Req(ns.SamplingParams(**params), [0], 1) for _ in range(3)]
            np.testing.assert_allclose(sampling_probs_batch(logits, reqs), reference_probs(logits, reqs),
                                       rtol=1e-12, atol=1e-15, err_msg=f"vocab {vocab}, {params}")


def test_greedy_rows_have_a_one_hot_distribution():
    logits = llm_like_logits(3, 50, seed=7)
    reqs = requests_for(logits, {"temperature": 0.0})
    reqs[1] = Req(ns.SamplingParams(top_p=0.5), [1], 1)
    probs = sampling_probs_batch(logits, reqs)
    assert np.array_equal(probs[[0, 2]], np.eye(50)[np.argmax(logits[[0, 2]], axis=1)])
    np.testing.assert_allclose(probs[1], reference_probs(logits[1:2], reqs[1:2])[0], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("vocab", [40, 1000], ids=["vocab40", "vocab1000"])
@pytest.mark.parametrize("params", FILTERS[:7] + [{"temperature": 0.3, "top_p": 0.99}] + FILTERS[8:9],
                         ids=str)
def test_sampled_tokens_follow_the_reference_distribution(params, vocab):
    logits = (np.random.default_rng(8).standard_normal((1, vocab)) * 1.5).astype(np.float32)
    req = requests_for(logits, params)[0]
    probs = reference_probs(logits, [req])[0]
    assert (probs * NUM_DRAWS >= 5).sum() >= 3, "too peaked a distribution to test"
    reqs = [Req(req.params.model_copy(update={"seed": s}), req.token_ids, 8) for s in range(NUM_DRAWS)]
    tokens = sample_requests(np.repeat(logits, NUM_DRAWS, axis=0), reqs)
    p_value = chi_square_p_value(np.bincount(tokens, minlength=vocab), probs)
    assert p_value > MIN_P_VALUE, f"{params}, vocab {vocab}: chi-square p-value {p_value:.2e}"


def two_sample_p_value(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson's test that two count vectors come from one distribution (a 2 x K contingency table; bins
    expected < 5 times in either sample pooled)."""
    total = a + b
    expected_a, expected_b = total * a.sum() / total.sum(), total * b.sum() / total.sum()
    small = np.minimum(expected_a, expected_b) < 5
    obs = np.stack([np.append(a[~small], a[small].sum()), np.append(b[~small], b[small].sum())])
    exp = np.stack([np.append(expected_a[~small], expected_a[small].sum()),
                    np.append(expected_b[~small], expected_b[small].sum())])
    keep = exp.min(axis=0) > 0
    obs, exp = obs[:, keep], exp[:, keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    return float(torch.special.gammaincc(torch.tensor((obs.shape[1] - 1) / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.parametrize("params", [FILTERS[0], FILTERS[3], FILTERS[8]], ids=str)
def test_sampled_tokens_have_the_per_request_samplers_distribution(params):
    """sample_batch (keyed draws, numba filters) against the per-request sampler the engine used before
    (a counted generator, numpy filters), draw for draw: the same distribution by a two-sample chi-square."""
    vocab = 200
    logits = (np.random.default_rng(13).standard_normal((1, vocab)) * 1.5).astype(np.float32)
    req = requests_for(logits, params)[0]
    penalized = apply_penalties(logits[0], req.token_ids[:8], req.output_token_ids, req.params)
    rng = np.random.default_rng(14)
    before = np.array([sample(penalized, req.params, rng) for _ in range(NUM_DRAWS)])
    reqs = [Req(req.params.model_copy(update={"seed": s}), req.token_ids, 8) for s in range(NUM_DRAWS)]
    after = sample_requests(np.repeat(logits, NUM_DRAWS, axis=0), reqs)
    counts_before, counts_after = np.bincount(before, minlength=vocab), np.bincount(after, minlength=vocab)
    assert (counts_before > 0).sum() >= 5, "too peaked a distribution to test"
    p_value = two_sample_p_value(counts_before, counts_after)
    assert p_value > MIN_P_VALUE, f"{params}: two-sample chi-square p-value {p_value:.2e}"


def test_two_sample_check_detects_a_different_distribution():
    # power check of the test above: the same draws against draws at another temperature
    logits = (np.random.default_rng(13).standard_normal((1, 200)) * 1.5).astype(np.float32)
    # other seeds: draws with shared clocks agree
    tokens = [sample_requests(np.repeat(logits, NUM_DRAWS, axis=0),
                              [Req(ns.SamplingParams(temperature=t, seed=i * NUM_DRAWS + s), [0], 1)
                               for s in range(NUM_DRAWS)])
              for i, t in enumerate((1.0, 1.1))]
    assert two_sample_p_value(*(np.bincount(t, minlength=200) for t in tokens)) < 1e-6


def test_chi_square_check_detects_a_wrong_filter():
    # power check of the test above: draws from top_p 0.9 fail against the top_p 0.8 reference
    logits = (np.random.default_rng(8).standard_normal((1, 40)) * 1.5).astype(np.float32)
    reqs = [Req(ns.SamplingParams(top_p=0.9, seed=s), [0], 1) for s in range(NUM_DRAWS)]
    tokens = sample_requests(np.repeat(logits, NUM_DRAWS, axis=0), reqs)
    wrong = sampling_probs(logits[0], ns.SamplingParams(top_p=0.8))
    observed = np.bincount(tokens, minlength=40)
    assert observed[wrong == 0].sum() > 0 or chi_square_p_value(observed, wrong) < 1e-12


# ---- keyed randomness -------------------------------------------------------------------------------------

def test_same_seed_and_position_give_the_same_token_whatever_the_batch():
    logits = llm_like_logits(12, 2000, seed=9)
    reqs = [Req(ns.SamplingParams(seed=s, **FILTERS[i % 9]), [3, 4, 5, i], 2)
            for i, s in enumerate(range(50, 62))]
    alone = [int(sample_requests(logits[i:i + 1], [r])[0]) for i, r in enumerate(reqs)]
    assert sample_requests(logits, reqs).tolist() == alone
    order = np.random.default_rng(0).permutation(12)
    others = requests_for(llm_like_logits(5, 2000, seed=10), {"top_k": 5})
    mixed_reqs = [reqs[i] for i in order] + others
    mixed_logits = np.concatenate([logits[order], llm_like_logits(5, 2000, seed=10)])
    mixed_reqs.insert(3, Req(ns.SamplingParams(temperature=0.0), [1], 1))
    mixed_logits = np.insert(mixed_logits, 3, logits[0], axis=0)
    tokens = sample_requests(mixed_logits, mixed_reqs).tolist()
    assert [tokens[mixed_reqs.index(r)] for r in reqs] == alone


def test_the_draw_is_keyed_by_position_and_seed_only():
    logits = np.zeros((1, 1000), np.float32)
    req = Req(ns.SamplingParams(seed=7), [1, 2, 3], 1)
    at_3 = sample_requests(logits, [req])  # default position: len(token_ids)
    assert sample_requests(logits, [Req(ns.SamplingParams(seed=7), [9] * 3, 3)], positions=[3]) == at_3
    assert sample_requests(logits, [req], positions=[3]) == at_3
    # a request's own seed (drawn once for an unseeded request) keys its draws
    unseeded = Req(ns.SamplingParams(), [1, 2, 3], 1, seed=request_seed(ns.SamplingParams(seed=7)))
    assert sample_requests(logits, [unseeded]) == at_3
    draws = [int(sample_requests(logits, [req], positions=[p])[0]) for p in range(3, 23)]
    assert len(set(draws)) > 15  # 20 positions of a uniform 1000-token distribution: new draws


def test_tokens_at_different_positions_are_independent():
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    logits = np.repeat(np.log(probs)[None].astype(np.float32), NUM_DRAWS, axis=0)
    reqs = [Req(ns.SamplingParams(seed=s), [0], 1) for s in range(NUM_DRAWS)]
    first = sample_requests(logits, reqs, positions=[10] * NUM_DRAWS)
    second = sample_requests(logits, reqs, positions=[11] * NUM_DRAWS)
    joint = np.bincount(first * 4 + second, minlength=16)
    p_value = chi_square_p_value(joint, np.outer(probs, probs).ravel())
    assert p_value > MIN_P_VALUE, f"tokens at positions 10 and 11: chi-square p-value {p_value:.2e}"


@njit(cache=True)
def fill_token_uniforms(key, out):
    """out[j] = v_j, the race's uniform for token j of the row keyed by key. out: [V] f64."""
    for j in range(out.shape[0]):
        out[j] = _uniform(key, j)


def test_the_race_uniforms_are_uniform_and_uncorrelated_across_tokens_positions_and_seeds():
    keys = row_keys(np.repeat(np.arange(40), 50), np.tile(np.arange(50), 40))  # 40 seeds x 50 positions
    v = np.empty((len(keys), 100))
    for i, key in enumerate(keys):
        fill_token_uniforms(key, v[i])
    assert v.min() > 0.0 and v.max() < 1.0
    p_value = chi_square_p_value(np.bincount((v.ravel() * 100).astype(int), minlength=100),
                                 np.full(100, 0.01))
    assert p_value > MIN_P_VALUE, f"uniform histogram: chi-square p-value {p_value:.2e}"
    sigma = 1 / np.sqrt(v.size)  # of a correlation between independent samples
    grid = v.reshape(40, 50, 100)
    assert abs(np.corrcoef(grid[..., :-1].ravel(), grid[..., 1:].ravel())[0, 1]) < 4 * sigma  # next token
    assert abs(np.corrcoef(grid[:, :-1].ravel(), grid[:, 1:].ravel())[0, 1]) < 4 * sigma  # next position
    assert abs(np.corrcoef(grid[:-1].ravel(), grid[1:].ravel())[0, 1]) < 4 * sigma  # next seed


def test_the_screened_race_over_a_whole_row_picks_the_exact_races_winner():
    """race_all skips the logarithm of every token that cannot beat the heaviest one's clock; that must never
    change the winner: it equals the race with every clock computed (race_kept over all the kept tokens)."""
    rng = np.random.default_rng(17)
    scratch = np.empty(5000, np.int64)
    for row in range(200):
        w = np.exp(rng.standard_normal(5000) * (0.5 + row % 5))
        w[rng.random(5000) < 0.3] = 0.0  # dropped tokens (min_p) never win
        w /= w.max()
        kept = np.flatnonzero(w > 0)
        key = row_keys([row], [row * 7])[0]
        assert race_all(w, key, scratch) == race_kept(w, kept.copy(), len(kept), key)


def test_a_race_with_shared_clocks_couples_two_close_distributions():
    """Why drafts race: a draft distribution q racing with the target p's clocks picks p's token with
    probability >= (1 - TV) / (1 + TV), while each side alone keeps its own distribution."""
    rng = np.random.default_rng(18)
    p = rng.dirichlet(np.full(50, 0.3))
    q = 0.8 * p + 0.2 * rng.dirichlet(np.full(50, 0.3))
    tv = 0.5 * np.abs(p - q).sum()
    kept = np.arange(50)
    keys = row_keys(range(NUM_DRAWS), [3] * NUM_DRAWS)
    drawn_p = np.array([race_kept(p, kept, 50, key) for key in keys])
    drawn_q = np.array([race_kept(q, kept, 50, key) for key in keys])
    assert np.mean(drawn_p == drawn_q) >= (1 - tv) / (1 + tv)
    assert chi_square_p_value(np.bincount(drawn_p, minlength=50), p) > MIN_P_VALUE
    assert chi_square_p_value(np.bincount(drawn_q, minlength=50), q) > MIN_P_VALUE


def test_request_seed_is_the_params_seed_or_drawn_once():
    assert request_seed(ns.SamplingParams(seed=5)) == 5
    assert request_seed(ns.SamplingParams(seed=-1)) == 2**64 - 1
    assert request_seed(ns.SamplingParams(seed=2**70 + 3)) == 3
    drawn = {request_seed(ns.SamplingParams()) for _ in range(8)}
    assert len(drawn) == 8 and all(0 <= s < 2**64 for s in drawn)


def test_top_logprobs_batch_are_the_models_log_softmax():
    logits = llm_like_logits(4, 3000, seed=12)
    logits[2, :5] = logits[2].max()  # ties among the top: lower ids first
    expected = torch.log_softmax(torch.tensor(logits, dtype=torch.float64), -1).numpy()
    rows = top_logprobs_batch(logits, [5, 17, 3, 2999], [3, 0, 4, 20])
    for row, x, token, k in zip(rows, expected, [5, 17, 3, 2999], [3, 0, 4, 20]):
        top = np.argsort(-x, kind="stable")[:k].tolist()
        assert list(row)[:k] == top and token in row and len(row) == len(set(top) | {token})
        for t, lp in row.items():
            assert lp == pytest.approx(x[t], abs=1e-12)


def test_a_token_mask_keeps_each_row_to_its_allowed_tokens():
    """SamplingBatch.token_masks (what structured outputs fill): a greedy row takes its best allowed token, a
    sampled row draws only allowed ones; rows without a restriction allow every token."""
    logits = llm_like_logits(6, 500, seed=9)
    reqs = [Req(ns.SamplingParams(temperature=0.0 if i < 3 else 1.0, seed=i), [1, 2], 2) for i in range(6)]
    rng = np.random.default_rng(3)
    masks = np.zeros(logits.shape, bool)
    for i in range(5):  # 5 allowed tokens, never the row's argmax
        masks[i, rng.choice(np.setdiff1d(np.arange(500), [np.argmax(logits[i])]), 5, replace=False)] = True
    masks[5] = True  # the last row is not restricted
    for _ in range(20):
        reqs = [Req(r.params.model_copy(update={"seed": int(rng.integers(1 << 30))}), r.token_ids, 2)
                for r in reqs]
        tokens = sample_batch(logits, replace(batch_of(reqs), token_masks=masks))
        assert all(masks[i, t] for i, t in enumerate(tokens))
        assert [int(t) for t in tokens[:3]] == [int(np.flatnonzero(m)[np.argmax(x[m])]) for x, m in
                                                 zip(logits[:3], masks[:3])]
        assert tokens[5] == sample_requests(logits[5:], reqs[5:])[0]  # all allowed: the unmasked draw
