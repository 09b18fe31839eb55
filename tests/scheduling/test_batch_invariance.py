"""Batch invariance: a token's outputs do not depend on the other tokens it is computed with.

Kernels: each token's rows of y = x @ W.T are bit-for-bit the same in any batch (every weight format,
float32 and int8 activations, matvec, register blocks and their token tails) and each query's attention
output the same alone or among other sequences. Engine: a request's logprobs are bit-for-bit the same
alone, batched with others, and recomputed from its prompt plus what it generated (a failover's
recompute), so a seeded request gives the same tokens alone or batched and greedy speculation cannot
flip a near tie.
"""

import numpy as np
import pytest

import numaserve as ns
from kernels.attention.paged import PARALLEL_MIN_WORK, paged_attention
from memory.matrices import Int8Matrix, WeightMatrix
from models.linear import linear
from tests.conftest import random_prompt

# token slices of one 41-token batch: alone, pairs and triples (matvec), a 4 x 4 block and its tails
SLICES = [(0, 1), (7, 8), (0, 2), (5, 8), (3, 7), (10, 21), (1, 41)]


def weight(fmt: str, n: int, k: int, seed: int = 0) -> WeightMatrix:
    return WeightMatrix.from_float(np.random.default_rng(seed).standard_normal((n, k)) * 0.05, fmt)


@pytest.mark.parametrize("fmt, k, activations", [
    ("float32", 2087, "float32"), ("float16", 2087, "float32"), ("bfloat16", 2087, "float32"),
    ("q8_0", 2048, "float32"), ("q4_0", 2048, "float32"), ("q8_0", 2048, "int8"), ("q4_0", 2048, "int8")])
def test_a_tokens_linear_outputs_are_the_same_in_any_batch(fmt, k, activations):
    w = weight(fmt, 203, k)  # 203 rows: a tail of row groups too
    if activations == "int8":
        w = Int8Matrix.pack(w)
    x = np.random.default_rng(1).standard_normal((41, k)).astype(np.float32)
    whole = linear(x, w)
    for a, b in SLICES:
        np.testing.assert_array_equal(linear(np.ascontiguousarray(x[a:b]), w), whole[a:b], err_msg=f"{a}:{b}")


def test_a_querys_attention_is_the_same_alone_or_among_other_sequences():
    rng = np.random.default_rng(2)
    num_blocks, block_size, n_kv, n_heads, head_dim = 80, 4, 2, 4, 32
    k_cache = rng.standard_normal((num_blocks, block_size, n_kv, head_dim)).astype(np.float32)
    v_cache = rng.standard_normal((num_blocks, block_size, n_kv, head_dim)).astype(np.float32)
    no_scale = np.zeros((1, 1, 1), np.float32)
    lengths = [37, 5, 141, 12]  # four sequences, each a prefill of all its positions
    tables = np.full((4, 40), -1, np.int32)
    free = iter(rng.permutation(num_blocks))
    for s, n in enumerate(lengths):
        tables[s, :(n + block_size - 1) // block_size] = [next(free)
                                                          for _ in range((n + block_size - 1) // block_size)]
    token_seq = np.concatenate([np.full(n, s, np.int32) for s, n in enumerate(lengths)])
    positions = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])
    q = rng.standard_normal((len(positions), n_heads, head_dim)).astype(np.float32)

    def attend(rows):
        out = np.empty((len(rows), n_heads, head_dim), np.float32)
        paged_attention(np.ascontiguousarray(q[rows]), k_cache, v_cache, no_scale, no_scale, False, tables,
                        token_seq[rows], positions[rows], 0, 0.125, out)
        return out

    everything = attend(np.arange(len(positions)))  # large enough for the parallel kernel, the others not
    assert len(positions) * n_heads * lengths[2] >= PARALLEL_MIN_WORK
    for rows in [np.arange(37), np.array([36]), np.array([0, 40, 77, 182]), np.arange(42, 103)]:
        np.testing.assert_array_equal(attend(rows), everything[rows])


ENGINES = {
    "float32": {"weight_dtype": "float32"},
    "bfloat16": {"weight_dtype": "bfloat16"},
    "q8_0 int8 activations, int8 KV": {"weight_dtype": "q8_0", "activation_dtype": "int8",
                                       "kv_dtype": "int8"},
    "q4_0 float32 activations": {"weight_dtype": "q4_0", "activation_dtype": "float32"},
}


@pytest.mark.parametrize("engine", ENGINES)
def test_a_requests_logprobs_and_tokens_are_the_same_alone_batched_and_recomputed(llama_dir, engine):
    llm = ns.LLM(llama_dir, block_size=4, **ENGINES[engine])
    prompts = [random_prompt(9 + 5 * i, seed=40 + i) for i in range(8)]
    greedy = ns.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=4)
    seeded = ns.SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True, logprobs=4)
    params = [greedy if i % 2 else seeded for i in range(8)]
    batched = llm.generate(prompts, params)
    for i in (0, 3):
        [alone] = llm.generate([prompts[i]], params[i])
        assert alone.token_ids == batched[i].token_ids
        assert alone.logprobs == batched[i].logprobs  # floats compared exactly
    # a failover recomputes the prompt plus what was generated in one prefill: the continuation is the same
    out = batched[3]
    [rest] = llm.generate([prompts[3] + out.token_ids[:10]], ns.SamplingParams(
        max_tokens=14, temperature=0, ignore_eos=True, logprobs=4))
    assert rest.token_ids == out.token_ids[10:]
    assert rest.logprobs == out.logprobs[10:]


def test_an_adapted_requests_logprobs_are_the_same_alone_or_batched(llama_dir, tmp_path):
    from tests.models.test_lora import make_adapter

    llm = ns.LLM(llama_dir)
    llm.register_adapter("a", make_adapter(llama_dir, tmp_path / "a", seed=1))
    prompts = [random_prompt(7 + 3 * i, seed=60 + i) for i in range(6)]
    params = ns.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=4)
    batched = llm.generate(prompts, params, adapter="a")  # six rows share the adapter's LoRA product
    [alone] = llm.generate([prompts[4]], params, adapter="a")
    assert (alone.token_ids, alone.logprobs) == (batched[4].token_ids, batched[4].logprobs)
