"""Every KV dtype and per-layer override map end to end on the shipped demo model (head_dim 32): greedy
tokens against bfloat16 KV over held-out prompts, overrides, preemption and prefix caching. Run with -s to
see the counts."""

import math

import pytest

import numaserve as ns
from memory.kv_cache import kv_bytes_per_token
from models.quantization.calibrate import token_windows
from models.tokenizer import Tokenizer
from numaserve.demo import DEMO_DIR
from numaserve.demo_eval import GREEDY, NEW_TOKENS, NUM_PROMPTS, greedy_prompts, heldout_stream, window_scores

BASE = DEMO_DIR / "base"
# prompts (of 16) whose 32 greedy tokens equal bfloat16 KV's, issue 29's bound. Measured here: int8 15,
# int8_hadamard 16, fp8_e4m3 16 and fp8_e5m2 14 (with their recent window in bfloat16; without it 10 and 11:
# README), int4 8, int4_hadamard 12 (its Gaussian codebook, scores debiased)
MIN_IDENTICAL = {"int8": 15, "fp8_e4m3": 15}
# issue 29's perplexity bounds against bfloat16 KV over the model's full 1024-token context (16 windows:
# README)
PPL_BOUND = {"int8": 0.001, "fp8_e4m3": 0.003, "int4_hadamard": 0.005}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return greedy_prompts(Tokenizer.from_dir(BASE))


@pytest.fixture(scope="module")
def tokens(prompts):
    cache = {}

    def get(kv_dtype: str, **fields) -> list[list[int]]:
        key = (kv_dtype, repr(sorted(fields.items())))
        if key not in cache:
            llm = ns.LLM(BASE, kv_dtype=kv_dtype, **fields)
            cache[key] = [c.token_ids for c in llm.generate(prompts, GREEDY)]
        return cache[key]

    return get


@pytest.mark.parametrize("kv_dtype", list(MIN_IDENTICAL))
def test_greedy_tokens_with_reduced_kv_equal_bfloat16_kvs(tokens, kv_dtype):
    got, wide = tokens(kv_dtype), tokens("bfloat16")
    identical = sum(a == b for a, b in zip(got, wide))
    print(f"\n{kv_dtype} KV: {identical} of {NUM_PROMPTS} continuations equal bfloat16 KV's")
    assert all(len(a) == NEW_TOKENS for a in got)
    assert identical >= MIN_IDENTICAL[kv_dtype]


def test_overrides_on_every_layer_give_that_dtypes_tokens(tokens):
    every_layer = {i: "bfloat16" for i in range(6)}
    assert tokens("int4", kv_dtype_overrides=every_layer) == tokens("bfloat16")


def test_an_override_map_stores_each_layer_in_its_dtype_and_sizes_the_pool_by_it(prompts):
    overrides = {0: "bfloat16", 5: "fp8_e4m3"}
    llm = ns.LLM(BASE, kv_dtype="int4_hadamard", kv_dtype_overrides=overrides, kv_cache_bytes=1 << 20,
                 block_size=16)
    kv = llm.engine.kv_cache
    assert kv.layer_dtypes == ["bfloat16"] + ["int4_hadamard"] * 4 + ["fp8_e4m3"]
    row = {"bfloat16": 64, "int4_hadamard": 16 + 4, "fp8_e4m3": 32 + 4}  # one head's row at head_dim 32
    bytes_per_token = 2 * 4 * sum(row[d] for d in kv.layer_dtypes)  # (k, v) x 4 kv heads
    assert llm.stats()["num_blocks"] == (1 << 20) // (16 * bytes_per_token)
    out = llm.generate(prompts[:4], GREEDY)
    assert all(len(c.token_ids) == NEW_TOKENS for c in out)


@pytest.mark.parametrize("kv_dtype, overrides", [("int4_hadamard", {}), ("fp8_e5m2", {2: "int8_hadamard"})])
def test_preemption_and_prefix_hits_change_no_tokens(prompts, kv_dtype, overrides):
    alone = [c.token_ids for c in ns.LLM(BASE, kv_dtype=kv_dtype, kv_dtype_overrides=overrides,
                                         enable_prefix_caching=False).generate(prompts[:6], GREEDY)]
    llm = ns.LLM(BASE, kv_dtype=kv_dtype, kv_dtype_overrides=overrides, block_size=16, max_num_seqs=6,
                 kv_cache_bytes=24 * 16 * kv_bytes_per_token(6, 4, 32, kv_dtype, overrides))
    together = [c.token_ids for c in llm.generate(prompts[:6], GREEDY)]
    assert llm.stats()["num_preemptions"] > 0
    assert together == alone
    again = [c.token_ids for c in llm.generate(prompts[4:6], GREEDY)]  # the last prompts' blocks are cached
    assert llm.stats()["prefix_hit_rate"] > 0
    # fp8_e5m2's layers read a hit's last positions from their codes (no window before wide_from): equal
    # tokens after the hit are measured here, not implied
    assert again == alone[4:6]


def test_held_out_perplexity_of_each_kv_dtype_against_bfloat16_kv():
    windows = token_windows(heldout_stream(Tokenizer.from_dir(BASE)), 1024, 4)
    scores = window_scores({d: ns.LLM(BASE, kv_dtype=d, max_num_batched_tokens=1024).score
                            for d in ("bfloat16", *PPL_BOUND, "int4")}, windows)
    change = {d: math.exp(nll.mean() - scores["bfloat16"][0].mean()) - 1 for d, (nll, _) in scores.items()}
    divergence = {d: kl.mean() for d, (_, kl) in scores.items()}
    print("\nheld-out perplexity against bfloat16 KV:", {d: f"{c:+.3%}" for d, c in change.items()},
          "KL:", {d: f"{k:.5f}" for d, k in divergence.items()})
    assert all(abs(change[d]) <= bound for d, bound in PPL_BOUND.items())
    # the rotation and its Gaussian codebook: the next-token distributions at most 0.6x as far from bfloat16
    # KV's as plain int4's (measured 0.45x here; over 4 windows the perplexity change itself is noise)
    assert divergence["int4_hadamard"] < 0.6 * divergence["int4"]
