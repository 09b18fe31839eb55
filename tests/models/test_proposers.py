"""Proposers: n-gram lookup matches a plain reference; a draft model equal to the target drafts exactly the
target's greedy continuation (and, with the engine's sampler, a sampled request's seeded draws), catches up
after rollbacks, and refuses a different tokenizer."""

import json
import shutil
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numaserve as ns
from cluster_configs.errors import CheckpointError
from kernels.ngram import ngram_lookup
from models.model_spec import load_spec
from models.proposers import DraftModelProposer, NgramProposer
from models.tokenizer import Tokenizer
from scheduling.sampling.sampler import request_seed, sample_batch
from tests.conftest import random_prompt
from tests.support.model_factory import build_model

FP32 = {"weight_dtype": "float32", "kv_dtype": "float32"}


@dataclass
class Req:
    request_id: str
    token_ids: list[int]
    params: ns.SamplingParams = field(default_factory=lambda: ns.SamplingParams(temperature=0))
    seed: int | None = None  # the engine's Request.seed: params.seed, else drawn once

    def __post_init__(self):
        if self.seed is None:
            self.seed = request_seed(self.params)


# ---- n-gram ---------------------------------------------------------------------------------------

def reference_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n:]
        for s in reversed(range(L - n)):
            if tokens[s:s + n] == suffix:
                seq = list(tokens)
                for j in range(k):
                    seq.append(seq[s + n + j])
                return seq[L:]
    return []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40), min_n=st.integers(1, 3),
       extra=st.integers(0, 3), k=st.integers(1, 6))
def test_ngram_lookup_matches_a_plain_reference(tokens, min_n, extra, k):
    out = np.empty(k, np.int64)
    n = ngram_lookup(np.asarray(tokens, np.int64), min_n, min_n + extra, out)
    assert out[:n].tolist() == reference_lookup(tokens, min_n, min_n + extra, k)


def test_ngram_prefers_the_longest_most_recent_match():
    #            a  b  c  X  a  b  c  Y  b  c  Z  a  b  c
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 2, 3, 7, 1, 2, 3]
    proposer = NgramProposer(ns.SpeculationConfig(method="ngram", prompt_lookup_min=2, prompt_lookup_max=3))
    assert proposer.propose([Req("r", tokens)], [2]) == [[8, 2]]  # "1 2 3" last seen before 8, not 9
    assert proposer.propose([Req("q", tokens[:-3] + [5, 2, 3])], [3]) == [[7, 5, 2]]  # only "2 3" recurs


def test_ngram_proposer_drafts_nothing_at_depth_0_or_without_a_match():
    proposer = NgramProposer(ns.SpeculationConfig(method="ngram"))
    reqs = [Req("a", [1, 2, 1, 2]), Req("b", [5, 6, 7, 8])]
    assert proposer.propose(reqs, [0, 4]) == [[], []]
    assert proposer.propose(reqs, [3, 0]) == [[1, 2, 1], []]
    reqs[0].token_ids += [1, 2, 5, 1, 2]  # the kept token buffer follows appended tokens
    assert proposer.propose(reqs, [2, 0]) == [[5, 1], []]
    proposer.free("a")


# ---- draft model ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def target_llm(llama_dir):
    return ns.LLM(llama_dir, **FP32)


def greedy(llm, prompt: list[int], n: int) -> list[int]:
    return llm.generate(prompt, ns.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].token_ids


def self_draft(llama_dir, **kwargs) -> DraftModelProposer:
    kwargs = {"kv_cache_tokens": 1024, "block_size": 4, **kwargs}
    return DraftModelProposer(llama_dir, load_spec(llama_dir), Tokenizer.from_dir(llama_dir),
                              weight_dtype="float32", activation_dtype="float32", **kwargs)


def test_self_draft_proposes_the_targets_greedy_continuation_for_a_batch(llama_dir, target_llm):
    proposer = self_draft(llama_dir)
    prompts = [random_prompt(n, seed=40 + n) for n in (5, 23, 1, 40)]
    expected = [greedy(target_llm, p, 9) for p in prompts]
    reqs = [Req(f"r{i}", list(p)) for i, p in enumerate(prompts)]
    depths = [4, 3, 0, 4]
    assert proposer.propose(reqs, depths) == [e[:d] for e, d in zip(expected, depths)]
    for req, e, d in zip(reqs, expected, depths):  # every draft accepted, plus the target's bonus token
        req.token_ids += e[:d + 1]
    assert proposer.propose(reqs, [4, 4, 4, 4]) == [e[d + 1:d + 5] for e, d in zip(expected, depths)]


def test_self_draft_catches_up_after_a_rejection(llama_dir, target_llm):
    proposer = self_draft(llama_dir)
    prompt = random_prompt(17, seed=3)
    expected = greedy(target_llm, prompt, 4)
    req = Req("r", list(prompt))
    assert proposer.propose([req], [4]) == [expected]  # its KV now holds prompt + 3 drafts
    wrong = (expected[2] + 1) % 384
    req.token_ids += expected[:2] + [wrong]  # the target took 2 drafts and replaced the third
    assert proposer.propose([req], [4]) == [greedy(target_llm, req.token_ids, 4)]
    req.token_ids = req.token_ids[:len(prompt) + 1]  # a request rebuilt shorter (e.g. recomputed elsewhere)
    assert proposer.propose([req], [2]) == [greedy(target_llm, req.token_ids, 2)]


def test_self_draft_survives_a_draft_kv_pool_too_small_for_everyone(llama_dir, target_llm):
    proposer = self_draft(llama_dir, kv_cache_tokens=48)  # 12 blocks of 4: one 30-token request at a time
    prompts = [random_prompt(30, seed=60 + i) for i in range(3)]
    for i, p in enumerate(prompts):
        assert proposer.propose([Req(f"r{i}", list(p))], [3]) == [greedy(target_llm, p, 3)]
    assert len(proposer.seqs) == 1  # idle requests' draft KV was evicted for the newcomer
    proposer.free("r2")
    assert proposer.pool.num_free_blocks == proposer.pool.num_blocks


def test_a_self_draft_with_the_engines_sampler_drafts_a_sampled_requests_own_draws(llama_dir, target_llm):
    """A sampled request's draft races with the clocks keyed by (its seed, the draft's position), on the draft
    model's logits sampled as the request samples: a draft model equal to the target drafts exactly the
    target's seeded continuation, whatever else is in the batch, and a fresh proposer or an unseeded
    request with the same drawn seed draws the same; another seed draws otherwise."""
    params = ns.SamplingParams(temperature=1.2, top_p=0.95, repetition_penalty=1.1, seed=21)
    prompt = random_prompt(10, seed=22)
    expected = target_llm.generate(
        prompt, params.model_copy(update={"max_tokens": 4, "ignore_eos": True}))[0].token_ids
    drafts = self_draft(llama_dir, sampler=sample_batch).propose([Req("s", list(prompt), params)], [4])[0]
    assert drafts == expected
    others = [Req(f"o{i}", random_prompt(5 + 3 * i, seed=30 + i),
                  ns.SamplingParams(temperature=0.9 if i % 2 else 0))
              for i in range(5)]
    batched = self_draft(llama_dir, sampler=sample_batch).propose(
        others[:2] + [Req("s", list(prompt), params)] + others[2:], [3, 4, 4, 2, 4, 1])
    assert batched[2] == expected
    unseeded = Req("u", list(prompt), params.model_copy(update={"seed": None}), seed=21)
    assert self_draft(llama_dir, sampler=sample_batch).propose([unseeded], [4])[0] == expected
    other_seed = Req("s", list(prompt), params.model_copy(update={"seed": 23}))
    assert self_draft(llama_dir, sampler=sample_batch).propose([other_seed], [4])[0] != expected


def test_without_a_sampler_a_draft_model_drafts_its_argmax_for_every_request(llama_dir, target_llm):
    prompt = random_prompt(10, seed=22)
    sampled = Req("s", list(prompt), ns.SamplingParams(temperature=1.2, seed=21))
    assert self_draft(llama_dir).propose([sampled], [3])[0] == greedy(target_llm, prompt, 3)


def test_draft_model_with_another_tokenizer_is_refused(tmp_path, llama_dir):
    draft = tmp_path / "draft"
    shutil.copytree(llama_dir, draft)
    tok = json.loads((draft / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[200:202]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (draft / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(CheckpointError, match=r"tokenizer differs from the target's at 2 token ids"):
        DraftModelProposer(draft, load_spec(llama_dir), Tokenizer.from_dir(llama_dir), kv_cache_tokens=64)


def test_models_without_tokenizers_need_equal_vocabulary_sizes(tmp_path, llama_dir):
    target, draft = tmp_path / "target", tmp_path / "draft"
    shutil.copytree(llama_dir, target)
    build_model(draft, "llama", vocab_size=320)
    for d in (target, draft):
        (d / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"vocabulary size 320 differs from the target's 384"):
        DraftModelProposer(draft, load_spec(target), None, kv_cache_tokens=64)
    with pytest.raises(CheckpointError, match=r"the target has a tokenizer but the draft model has none"):
        DraftModelProposer(draft, load_spec(llama_dir), Tokenizer.from_dir(llama_dir), kv_cache_tokens=64)


def test_make_proposer_builds_the_configured_method(llama_dir):
    from models.proposers import make_proposer

    spec, tok = load_spec(llama_dir), Tokenizer.from_dir(llama_dir)
    kw = {"kv_cache_tokens": 64, "block_size": 16}
    assert make_proposer(ns.SpeculationConfig(), spec, tok, **kw) is None
    assert isinstance(make_proposer(ns.SpeculationConfig(method="ngram"), spec, tok, **kw), NgramProposer)
    draft = make_proposer(ns.SpeculationConfig(method="draft", draft_model=str(llama_dir)), spec, tok, **kw)
    assert isinstance(draft, DraftModelProposer) and draft.model.weight_dtype == "bfloat16"


def test_a_gguf_draft_of_the_targets_family_is_accepted(tmp_path, llama_dir, target_llm):
    from models.gguf.writer import convert_to_gguf

    gguf_path = convert_to_gguf(llama_dir, tmp_path / "draft.gguf", weight_dtype="float32")
    proposer = DraftModelProposer(gguf_path, load_spec(llama_dir), Tokenizer.from_dir(llama_dir),
                                  kv_cache_tokens=256, weight_dtype="float32", activation_dtype="float32")
    prompt = random_prompt(12, seed=9)
    assert proposer.propose([Req("g", prompt)], [3]) == [greedy(target_llm, prompt, 3)]
