"""ns.LLM(..., tensor_parallel_size=2): rank 0 in the test's process, a follower process of its own with the
other half of the weights. Exact against tensor_parallel_size 1 (float32: scores within 1e-4, the same greedy
tokens), continuous batching of mixed requests equal to each alone, n-gram speculation equal to none, and the
follower stopped by close()."""

import numpy as np
import psutil
import pytest

import numaserve as ns
from cluster_configs.errors import AdapterError
from tests.conftest import random_prompt

EXACT = {"weight_dtype": "float32", "kv_dtype": "float32", "num_threads": 1}
GREEDY = ns.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(model_dirs):
    """(tensor_parallel_size 1, tensor_parallel_size 2) engines of the tiny Qwen3 (per-head q/k norms, a
    sliding-window layer)."""
    one = ns.LLM(model_dirs["qwen3"], **EXACT)
    two = ns.LLM(model_dirs["qwen3"], tensor_parallel_size=2, **EXACT)
    yield one, two
    one.close()
    two.close()


def test_two_ranks_score_within_1e_4_of_one_and_generate_the_same_greedy_tokens(pair):
    one, two = pair
    assert two.engine.model.spec.num_heads == one.engine.model.spec.num_heads // 2  # rank 0 holds half
    assert two.engine.model.weight_bytes <= 0.55 * one.engine.model.weight_bytes
    assert len(two.engine.ranks.group.pids) == 1
    prompts = [random_prompt(n, seed=n) for n in (5, 17, 40, 64)]
    for p in prompts:
        np.testing.assert_allclose(two.score(p), one.score(p), atol=1e-4, rtol=0)
    mixed = [ns.SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True) for i in range(4)]
    assert [c.token_ids for c in two.generate(prompts, mixed)] == \
        [c.token_ids for c in one.generate(prompts, mixed)]


def test_sixteen_mixed_requests_in_one_batch_equal_each_alone_bit_for_bit(pair):
    _, two = pair
    prompts = [random_prompt(3 + 5 * i, seed=100 + i) for i in range(16)]
    together = [c.token_ids for c in two.generate(prompts, GREEDY)]
    assert together == [two.generate([p], GREEDY)[0].token_ids for p in prompts]
    score = two.score(prompts[3])
    assert score.tobytes() == two.score(prompts[3]).tobytes()  # rank-order sums: the same bits again


def test_ngram_speculation_on_two_ranks_gives_the_tokens_without_it(model_dirs, pair):
    _, two = pair
    spec = ns.LLM(model_dirs["qwen3"], tensor_parallel_size=2, speculation={"method": "ngram"}, **EXACT)
    try:
        prompt = random_prompt(8, seed=5) * 4  # repeats: n-gram drafts find matches
        assert spec.generate([prompt], GREEDY)[0].token_ids == two.generate([prompt], GREEDY)[0].token_ids
    finally:
        spec.close()


def test_close_stops_the_follower_and_unsupported_features_are_typed_errors(model_dirs):
    llm = ns.LLM(model_dirs["llama"], tensor_parallel_size=2, **EXACT)
    followers = [psutil.Process(pid) for pid in llm.engine.ranks.group.pids]
    with pytest.raises(AdapterError, match="tensor_parallel_size 1"):
        llm.register_adapter("a", model_dirs["llama"])
    llm.close()
    assert all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in followers)
    with pytest.raises(ValueError, match="not supported with tensor_parallel_size > 1"):
        ns.EngineConfig(tensor_parallel_size=2, speculation={"method": "draft", "draft_model": "x"})
    with pytest.raises(ns.CheckpointError, match="tensor_parallel_size 3 must divide"):
        ns.LLM(model_dirs["llama"], tensor_parallel_size=3, **EXACT)
