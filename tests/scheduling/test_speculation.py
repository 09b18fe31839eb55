"""Speculative decoding in the engine: greedy outputs equal those without it, token for token (every method
and mode, stops and max_tokens inside accepted runs, preemption); a self-draft accepts everything; sampled
outputs follow the target's own distribution and, seeded, are the tokens of no speculation, alone or
batched."""

import itertools
import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
import safetensors.torch
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import numaserve as ns
from models.proposers import eagle as eagle_proposer
from models.proposers.base import Proposer
from models.proposers.eagle import EagleProposer
from models.proposers.eagle_head import HEAD_FILE
from models.proposers.medusa import MedusaProposer
from models.proposers.medusa_head import CONFIG_FILE as MEDUSA_CONFIG
from models.proposers.medusa_head import HEADS_FILE as MEDUSA_HEADS
from scheduling.engine import Engine
from scheduling.speculation.controller import SpeculationController
from scheduling.speculation.depth_policy import SpeculationPolicy
from scheduling.speculation.method_chooser import MethodChooser
from tests.conftest import random_prompt
from tests.support.chi_square import chi_square_p_value
from tests.support.eagle_factory import model_with_eagle, record_drafts
from tests.support.medusa_factory import model_with_heads

FP32 = {"weight_dtype": "float32", "kv_dtype": "float32"}
MODES = ("auto", "on", "latency_first", "throughput_first")
K = 4
MIN_P_VALUE = 1e-3  # seeded runs: each chi-square test passes or fails deterministically


# ---- helpers --------------------------------------------------------------------------------------

@pytest.fixture
def memory_bound_costs(monkeypatch):
    """The load-aware modes decide from measured seconds, which differ from machine to machine (a CI run
    once priced the draft model out at batch 16 and never drafted). Here every step and proposer pass is
    charged what it costs on a memory-bound decode: a fixed cost (the weights read once) dominating, a
    draft pass a twentieth of a step. The modes then draft wherever the measured acceptance pays, on every
    machine alike; whether they draft is asserted, what they decide is
    tests/scheduling/test_spec_policy.py's."""
    step_s, token_s = 0.010, 0.00005
    observe = SpeculationController.observe

    def charged(self, stats):
        passes = tuple((n, (step_s + token_s * n) / 20) for n, _ in stats.draft_passes)
        observe(self, replace(stats, seconds=step_s + token_s * stats.num_tokens, draft_passes=passes,
                              draft_seconds=sum(s for _, s in passes)))
    monkeypatch.setattr(SpeculationController, "observe", charged)

def perturbed_copy(src, dst, scale: float, seed: int = 0):
    """A draft model: the target's weights plus noise (same tokenizer), so some drafts pass, some not."""
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())
    model.save_pretrained(dst, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    return dst


def record_runs(engine: Engine) -> dict[str, list[tuple[int, list[int], int]]]:
    """Request id -> per step (outputs it had before, the run the step sampled for it, drafts verified)."""
    runs: dict[str, list] = {}
    process = engine.scheduler.processor.process

    def recording(plan, out):
        for scheduled, sampled in zip(plan.scheduled, out.sampled):
            if sampled is not None:
                req = scheduled.request
                runs.setdefault(req.request_id, []).append(
                    (len(req.output_token_ids), list(sampled.token_ids), sampled.num_draft_tokens))
        return process(plan, out)

    engine.scheduler.processor.process = recording
    return runs


def run(engine: Engine, prompts: list, params, prefix: str = "r") -> list:
    params = params if isinstance(params, list) else [params] * len(prompts)
    reqs = [engine.add_request(f"{prefix}{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    while engine.has_unfinished():
        engine.step()
    return reqs


def outcome(reqs) -> list[tuple]:
    return [(r.output_token_ids, r.text, r.finish_reason, r.logprobs) for r in reqs]


def assert_same(got: list[tuple], expected: list[tuple]) -> None:
    """Tokens, text and finish reason equal; logprobs of the same tokens within 1e-5 (a verification step's
    rows differ from a decode step's in the last float bits)."""
    assert [o[:3] for o in got] == [o[:3] for o in expected]
    for o, e in zip(got, expected):
        assert [list(lp) for lp in o[3]] == [list(lp) for lp in e[3]]
        np.testing.assert_allclose([v for lp in o[3] for v in lp.values()],
                                   [v for lp in e[3] for v in lp.values()], atol=1e-5)


def cut_inside_a_run(runs, req) -> bool:
    """The request's last step sampled a run longer than what it appended: a stop or max_tokens cut it."""
    before, tokens, num_drafts = runs[req.request_id][-1]
    appended = req.output_token_ids[before:]
    assert tokens[:len(appended)] == appended
    return num_drafts > 0 and len(appended) < len(tokens)


# ---- greedy: the same tokens with and without speculation ------------------------------------------

@pytest.fixture(scope="module")
def draft_dir(llama_dir, tmp_path_factory):
    return perturbed_copy(llama_dir, tmp_path_factory.mktemp("draft"), scale=0.3)


@pytest.fixture(scope="module")
def mixed():
    """16 mixed prompts and params: lengths 1..120, repetitive text (n-gram hits), stop strings, stop ids,
    logprobs, penalties, several max_tokens."""
    prompts = [random_prompt(n, seed=200 + i) for i, n in enumerate((1, 7, 33, 120, 3, 64, 15, 90))]
    prompts += ["The quick brown fox jumps over the lazy dog. The quick brown fox",
                "def add(a, b):\n    return", [5, 6, 7, 8, 9] * 8,
                "numaserve serves language models on CPUs, one worker per NUMA node. numaserve",
                [11, 12] * 20, "In the beginning was the word, and the word", random_prompt(40, seed=7),
                "Tokens"]
    g = {"temperature": 0, "ignore_eos": True}
    params = [ns.SamplingParams(max_tokens=m, **g) for m in (24, 17, 9, 30, 1, 2, 24, 12)]
    params += [ns.SamplingParams(max_tokens=30, stop=["lazy", "fox jumps"], **g),
               ns.SamplingParams(max_tokens=20, logprobs=3, **g),
               ns.SamplingParams(max_tokens=26, stop_token_ids=[9], **g),
               ns.SamplingParams(max_tokens=28, repetition_penalty=1.3, **g),
               ns.SamplingParams(max_tokens=25, presence_penalty=0.5, frequency_penalty=0.4, **g),
               ns.SamplingParams(max_tokens=19, stop=["word"], **g),
               ns.SamplingParams(max_tokens=23, temperature=0, ignore_eos=False),
               ns.SamplingParams(max_tokens=21, top_k=1, temperature=0.7, ignore_eos=True)]
    return prompts, params


@pytest.fixture(scope="module")
def reference(llama_dir, mixed):
    return outcome(run(ns.LLM(llama_dir, **FP32).engine, *mixed))


@pytest.fixture(scope="module")
def medusa_dir(llama_dir, mixed, tmp_path_factory):
    """The test model with K Medusa heads fitted to its greedy continuations of the mixed id prompts."""
    prompts = [p for p in mixed[0] if isinstance(p, list)]
    return model_with_heads(llama_dir, tmp_path_factory.mktemp("medusa") / "model", num_heads=K,
                            prompts=prompts)


@pytest.fixture(scope="module")
def eagle_dir(llama_dir, mixed, tmp_path_factory):
    """The test model with an EAGLE head fitted to its greedy continuations of the mixed id prompts."""
    prompts = [p for p in mixed[0] if isinstance(p, list)]
    return model_with_eagle(llama_dir, tmp_path_factory.mktemp("eagle") / "model", prompts=prompts)


@pytest.fixture(scope="module")
def heads_dirs(medusa_dir, eagle_dir):
    return {"medusa": medusa_dir, "eagle": eagle_dir}


def method_setup(method: str, llama_dir, draft_dir, heads_dirs) -> tuple:
    """(the model to serve, the speculation fields) of a method."""
    if method == "draft":
        return llama_dir, {"draft_model": str(draft_dir)}
    return heads_dirs.get(method, llama_dir), {}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", ["ngram", "draft", "medusa", "eagle"])
def test_greedy_speculation_gives_the_same_tokens_as_none(llama_dir, draft_dir, heads_dirs, mixed, reference,
                                                          method, mode, memory_bound_costs):
    model, extra = method_setup(method, llama_dir, draft_dir, heads_dirs)
    spec = {"method": method, "num_speculative_tokens": K, "mode": mode} | extra
    llm = ns.LLM(model, **FP32, speculation=spec, max_num_batched_tokens=512)
    # this draft model is the target's size, so its cost prior keeps the load-aware modes from ever trying
    # it; price it as free here so that they draft (pricing: tests/scheduling/test_spec_policy.py)
    llm.engine.speculation.controller.cost_prior = (0.0, 0.0)
    assert_same(outcome(run(llm.engine, *mixed)), reference)
    stats = llm.stats()
    assert stats["spec_num_draft_tokens"] > 0 and stats["spec_num_accepted_tokens"] > 0, stats
    assert stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]  # and some were rejected
    assert stats["num_free_blocks"] == stats["num_blocks"]  # rolled-back and finished blocks all returned


def test_greedy_speculation_under_preemption_in_a_small_kv_pool(llama_dir, draft_dir, heads_dirs, mixed,
                                                                reference):
    bytes_per_block = 4 * 2 * 2 * 2 * 24 * 4  # block_size * (k, v) * layers * kv_heads * head_dim * fp32
    for method in ("ngram", "draft", "medusa", "eagle"):
        model, extra = method_setup(method, llama_dir, draft_dir, heads_dirs)
        llm = ns.LLM(model, **FP32, block_size=4, kv_cache_bytes=48 * bytes_per_block,
                     max_num_batched_tokens=128, speculation={"method": method, "mode": "on", **extra})
        assert_same(outcome(run(llm.engine, *mixed)), reference)
        stats = llm.stats()
        assert stats["num_preemptions"] > 0 and stats["spec_num_accepted_tokens"] > 0, stats
        assert stats["num_free_blocks"] == stats["num_blocks"] == 48


# ---- method "auto": every method the model has, one drafting per step ------------------------------

@pytest.fixture(scope="module")
def all_heads_dir(medusa_dir, eagle_dir, tmp_path_factory):
    """The test model with its Medusa heads and its EAGLE head both beside it."""
    directory = shutil.copytree(eagle_dir, tmp_path_factory.mktemp("all-heads") / "model")
    for file in (MEDUSA_HEADS, MEDUSA_CONFIG):
        shutil.copy(medusa_dir / file, directory / file)
    return directory


def take_turns(chooser: MethodChooser) -> None:
    """Make the chooser's methods draft in turn, one step each (whatever their goodput says)."""
    names, step = list(chooser.candidates), itertools.count()
    turn = {"now": 0}
    for name, candidate in chooser.candidates.items():
        def on_turn_only(plan, name=name, choose=candidate.choose):
            choice = choose(plan)
            if choice is not None and names[turn["now"] % len(names)] != name:
                choice = replace(choice, depths=[0] * len(choice.depths))
            return choice
        candidate.choose = on_turn_only
    propose = chooser.propose

    def next_turn(plan, batcher):
        turn["now"] = next(step)
        return propose(plan, batcher)
    chooser.propose = next_turn


def test_method_auto_weighs_every_method_the_model_has(all_heads_dir, llama_dir, draft_dir):
    llm = ns.LLM(all_heads_dir, **FP32, speculation={"method": "auto", "draft_model": str(draft_dir)})
    assert list(llm.engine.speculation.candidates) == ["ngram", "medusa", "eagle", "draft"]
    assert (list(ns.LLM(llama_dir, **FP32, speculation={"method": "auto"}).engine.speculation.candidates)
            == ["ngram"])


@pytest.mark.parametrize("small_pool", [False, True])
def test_methods_drafting_in_turn_give_the_same_tokens_as_none(all_heads_dir, draft_dir, mixed, reference,
                                                               small_pool):
    """Switching method every step (EAGLE catching up on positions another method verified, the draft
    model on tokens it did not draft, Medusa and n-gram between them), with preemption in a small pool."""
    pool = {"block_size": 4, "kv_cache_bytes": 48 * 4 * 2 * 2 * 2 * 24 * 4, "max_num_batched_tokens": 128} \
        if small_pool else {"max_num_batched_tokens": 512}
    llm = ns.LLM(all_heads_dir, **FP32, **pool, speculation={"method": "auto", "mode": "on",
                                                            "num_speculative_tokens": K,
                                                            "draft_model": str(draft_dir)})
    take_turns(llm.engine.speculation)
    assert_same(outcome(run(llm.engine, *mixed)), reference)
    stats = llm.stats()
    assert all(n > 0 for n in stats["spec_num_drafts_by_method"].values()), stats["spec_num_drafts_by_method"]
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    assert stats["num_preemptions"] > 0 if small_pool else True
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_method_auto_measures_what_each_method_delivers_and_says_why(all_heads_dir, mixed, reference,
                                                                     memory_bound_costs):
    llm = ns.LLM(all_heads_dir, **FP32, max_num_batched_tokens=512,
                 speculation={"method": "auto", "num_speculative_tokens": K})
    assert_same(outcome(run(llm.engine, *mixed)), reference)
    stats = llm.stats()
    assert stats["spec_method"] == "auto" and stats["spec_method_chosen"] in ("ngram", "medusa", "eagle")
    assert stats["spec_num_accepted_tokens"] > 0
    measured = {key.split(" at ")[0] for key in stats["spec_delivered_tokens_per_s"]}
    assert "none" in measured and measured & {"ngram", "medusa", "eagle"}, (
        stats["spec_delivered_tokens_per_s"])
    choices = [d for d in llm.diagnostics()
               if d["topic"] == "speculation" and d["choice"].startswith("method ")]
    assert choices and "measuring what it delivers at batch size" in choices[0]["reason"]


# ---- token trees: verified with tree attention, the accepted path's KV kept -----------------------

def with_tree_proposer(llm, width: int) -> list[int]:
    """Have the engine's Medusa or EAGLE proposer draft trees of this width; -> a list that records, per
    verification that kept a tree path, whether the path left the first branch (its KV moved to the slots
    after the root)."""
    assert isinstance(llm.engine.speculation.proposer, MedusaProposer | EagleProposer)
    llm.engine.speculation.proposer.fixed_width = width
    moved = []
    move_slots = llm.engine.kv_cache.move_slots

    def counting(block_ids, src, dst):
        moved.append(src != dst)
        move_slots(block_ids, src, dst)

    llm.engine.kv_cache.move_slots = counting
    return moved


@pytest.mark.parametrize("width", [2, 3])
@pytest.mark.parametrize("kv_dtype", ["float32", "int8", "fp8_e4m3", "int4"])
@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_greedy_tree_speculation_gives_the_same_tokens_as_none(llama_dir, heads_dirs, mixed, method, width,
                                                               kv_dtype):
    reference = outcome(run(ns.LLM(llama_dir, weight_dtype="float32", kv_dtype=kv_dtype).engine, *mixed))
    llm = ns.LLM(heads_dirs[method], weight_dtype="float32", kv_dtype=kv_dtype,
                 speculation={"method": method, "num_speculative_tokens": K, "mode": "on"})
    moved = with_tree_proposer(llm, width)
    assert_same(outcome(run(llm.engine, *mixed)), reference)
    stats = llm.stats()
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"], stats
    assert any(moved), "no accepted path left the first branch: the KV move went untested"
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert (llm.engine.kv_cache.shadow_of < 0).all()  # fp8's recent-window shadows went back too


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_greedy_tree_speculation_under_preemption_in_a_small_kv_pool(heads_dirs, mixed, reference, method):
    bytes_per_block = 4 * 2 * 2 * 2 * 24 * 4  # block_size * (k, v) * layers * kv_heads * head_dim * fp32
    llm = ns.LLM(heads_dirs[method], **FP32, block_size=4, kv_cache_bytes=48 * bytes_per_block,
                 max_num_batched_tokens=128, speculation={"method": method, "mode": "on", "tree_width": 2})
    assert_same(outcome(run(llm.engine, *mixed)), reference)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_num_accepted_tokens"] > 0, stats
    assert stats["num_free_blocks"] == stats["num_blocks"] == 48


@pytest.mark.parametrize("width", [1, 2])
def test_eagle_with_a_draft_vocabulary_drafts_only_its_tokens_and_keeps_the_targets(eagle_dir, mixed,
                                                                                    reference, tmp_path,
                                                                                    width):
    """A head with a draft vocabulary (models/proposers/eagle_head.py d2t) of the tokens most frequent in the
    reference outputs guesses among them only; the tokens stay the target's."""
    counts = np.bincount([t for ids, *_ in reference for t in ids], minlength=384)
    draft_ids = np.sort(np.argsort(-counts, kind="stable")[:96])
    directory = shutil.copytree(eagle_dir, tmp_path / "model")
    state = dict(safetensors.torch.load_file(directory / HEAD_FILE))
    state["d2t"] = torch.as_tensor(draft_ids) - torch.arange(len(draft_ids))
    safetensors.torch.save_file(state, directory / HEAD_FILE)
    llm = ns.LLM(directory, **FP32, speculation={"method": "eagle", "num_speculative_tokens": K, "mode": "on",
                                                 "tree_width": width})
    drafted = record_drafts(llm)
    assert_same(outcome(run(llm.engine, *mixed)), reference)
    assert drafted and set(drafted) <= set(draft_ids.tolist())
    stats = llm.stats()
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"], stats


def test_eagle_keeps_a_bounded_number_of_unseen_features_and_restarts_from_the_newest(llama_dir, eagle_dir,
                                                                                      mixed, monkeypatch):
    """A request that has not drafted for MAX_UNSEEN positions (here its 120-token prompt, with the bound
    at 24) keeps only that many features: the head restarts from the newest RESTART_KEEP, drafts, and the
    tokens are the target's."""
    monkeypatch.setattr(eagle_proposer, "MAX_UNSEEN", 24)
    monkeypatch.setattr(eagle_proposer, "RESTART_KEEP", 8)
    prompt, params = mixed[0][3], ns.SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    want = ns.LLM(llama_dir, **FP32).generate(prompt, params)[0].token_ids
    llm = ns.LLM(eagle_dir, **FP32, speculation={"method": "eagle", "mode": "on"})
    proposer, most = llm.engine.speculation.proposer, []
    observe = proposer.observe_hidden

    def bounded(request_id, first, features):
        observe(request_id, first, features)
        most.append(len(proposer.seqs[request_id].features))

    proposer.observe_hidden = bounded
    assert llm.generate(prompt, params)[0].token_ids == want
    assert len(prompt) > 24 and max(most) <= 24 and llm.stats()["spec_num_accepted_tokens"] > 0


@pytest.mark.parametrize("width", [1, 3])
def test_eagle_drafts_after_a_prefix_cache_hit_and_keeps_the_tokens(llama_dir, eagle_dir, mixed, width):
    """The second request's prompt comes from the prefix cache, so the target hands over no features for it:
    the head starts after it (models/proposers/eagle.py) and still drafts tokens the target keeps."""
    prompt = mixed[0][3]  # 120 ids
    params = ns.SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    want = ns.LLM(llama_dir, **FP32).generate(prompt, params)[0].token_ids
    llm = ns.LLM(eagle_dir, **FP32, speculation={"method": "eagle", "mode": "on", "tree_width": width})
    proposer, first_seen = llm.engine.speculation.proposer, {}
    observe = proposer.observe_hidden

    def recording(request_id, first, features):
        first_seen.setdefault(request_id, first)
        observe(request_id, first, features)

    proposer.observe_hidden = recording
    for _ in range(2):
        before = llm.stats()["spec_num_accepted_tokens"]
        assert llm.generate(prompt, params)[0].token_ids == want
        assert llm.stats()["spec_num_accepted_tokens"] > before
    fresh, cached = first_seen.values()
    assert fresh == 0 and cached > 0  # the second request's prompt came from the prefix cache
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]


# ---- self-draft: every draft accepted; stops and max_tokens inside accepted runs --------------------

@pytest.fixture(scope="module")
def self_draft(llama_dir):
    def make(model_dir=llama_dir, **kwargs) -> Engine:
        spec = {"method": "draft", "draft_model": str(llama_dir), "num_speculative_tokens": K, "mode": "on"}
        return ns.LLM(model_dir, **FP32, speculation=spec, **kwargs).engine
    return make


def test_self_draft_accepts_every_draft_and_appends_k_plus_1_tokens_per_verification(self_draft):
    engine = self_draft()
    runs = record_runs(engine)
    params = ns.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    reqs = run(engine, [random_prompt(n, seed=300 + n) for n in (3, 20, 50)], params)
    stats = engine.stats()
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"] > 0
    assert stats["spec_accepted_per_position"] == stats["spec_verified_per_position"]
    for req in reqs:
        verifications = [(len(tokens), d) for _, tokens, d in runs[req.request_id] if d > 0]
        assert all(n == d + 1 for n, d in verifications)
        # the last may be capped
        assert [n for n, _ in verifications[:-1]] == [K + 1] * (len(verifications) - 1)
        assert len(req.output_token_ids) == 40


def continuation(llama_dir, prompt, n: int) -> list[int]:
    params = ns.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return ns.LLM(llama_dir, **FP32).generate(prompt, params)[0].token_ids


def inside_run_index(out: list[int], start: int = 2) -> int:
    """An output index in the middle of a self-draft run (runs: [0], [1..K+1], [K+2..2K+2], ...) whose token
    does not occur earlier."""
    return next(j for j in range(start, len(out)) if j % (K + 1) not in (0, 1) and out[j] not in out[:j])


def test_stop_token_inside_an_accepted_run_cuts_it_there(llama_dir, self_draft):
    prompt = random_prompt(12, seed=11)
    out = continuation(llama_dir, prompt, 30)
    j = inside_run_index(out)
    engine = self_draft()
    runs = record_runs(engine)
    [req] = run(engine, [prompt], ns.SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[out[j]]))
    assert (req.output_token_ids, req.finish_reason) == (out[:j + 1], "stop")
    assert cut_inside_a_run(runs, req)


def test_eos_inside_an_accepted_run_cuts_it_there(llama_dir, self_draft, tmp_path):
    prompt = random_prompt(12, seed=12)
    out = continuation(llama_dir, prompt, 30)
    j = inside_run_index(out)
    shutil.copytree(llama_dir, tmp_path / "m")
    for name in ("config.json", "generation_config.json"):
        path = tmp_path / "m" / name
        if path.exists():
            path.write_text(json.dumps(json.loads(path.read_text()) | {"eos_token_id": out[j]}))
    engine = self_draft(tmp_path / "m")
    assert engine.spec.eos_token_ids == (out[j],)
    runs = record_runs(engine)
    [req] = run(engine, [prompt], ns.SamplingParams(max_tokens=30, temperature=0))
    assert (req.output_token_ids, req.finish_reason) == (out[:j + 1], "stop")
    assert cut_inside_a_run(runs, req)


def test_stop_string_inside_an_accepted_run_cuts_it_there(llama_dir, self_draft):
    prompt = "The quick brown fox"
    off = ns.LLM(llama_dir, **FP32)
    out = continuation(llama_dir, prompt, 30)
    tok = off.tokenizer
    for j in range(2, len(out)):  # a stop string first completed by a token in the middle of a run
        piece = tok.decode(out[j:j + 1]).strip()
        if j % (K + 1) in (0, 1) or len(piece) < 2 or piece in tok.decode(out[:j]):
            continue
        params = ns.SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[piece])
        [expected] = off.generate(prompt, params)
        if len(expected.token_ids) == j + 1:
            break
    else:
        pytest.fail("no stop string found in the middle of a run")
    engine = self_draft()
    runs = record_runs(engine)
    [req] = run(engine, [prompt], params)
    assert (req.output_token_ids, req.text, req.finish_reason) == (expected.token_ids, expected.text, "stop")
    assert cut_inside_a_run(runs, req)


def test_max_tokens_inside_an_accepted_run_cuts_it_there(llama_dir, self_draft):
    prompt = random_prompt(9, seed=13)
    # runs: 1 token (prefill), K + 1, then K drafts capped to the 2 left: 3 sampled, 2 kept
    max_tokens = K + 4
    engine = self_draft()
    runs = record_runs(engine)
    [req] = run(engine, [prompt], ns.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    assert (req.output_token_ids, req.finish_reason) == (continuation(llama_dir, prompt, max_tokens),
                                                         "length")
    assert cut_inside_a_run(runs, req)


# ---- sampling: exactly the target's distribution; seeded outputs independent of the batch -------------

def tiny_checkpoint(path, seed: int, num_layers: int = 2):
    config = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=0, eos_token_id=1, initializer_range=0.5)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def vocab16(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab16")
    return tiny_checkpoint(root / "target", seed=1), tiny_checkpoint(root / "draft", seed=2, num_layers=1)


@pytest.fixture(scope="module")
def vocab16_medusa(vocab16, tmp_path_factory):
    """The vocab16 target with 2 random Medusa heads beside it (with 16 tokens, some of their guesses
    pass)."""
    return model_with_heads(vocab16[0], tmp_path_factory.mktemp("vocab16-medusa") / "target", num_heads=2)


@pytest.fixture(scope="module")
def vocab16_eagle(vocab16, tmp_path_factory):
    """The vocab16 target with a random EAGLE head beside it."""
    return model_with_eagle(vocab16[0], tmp_path_factory.mktemp("vocab16-eagle") / "target")


def vocab16_setup(method: str, vocab16, vocab16_medusa, vocab16_eagle=None) -> tuple:
    """(the model to serve, the speculation fields) of a method on the vocab16 target."""
    target, draft = vocab16
    if method == "draft":
        return target, {"draft_model": str(draft)}
    if method.startswith("eagle"):
        return vocab16_eagle, {}
    return (vocab16_medusa if method.startswith("medusa") else target), {}


def reference_probs(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """softmax at temperature 1, then top_k, then top_p (the smallest set of most likely tokens reaching
    it)."""
    p = np.exp(logits.astype(np.float64) - logits.max())
    p /= p.sum()
    if top_k:
        p[p < np.sort(p)[-top_k]] = 0.0
        p /= p.sum()
    order = np.argsort(-p, kind="stable")
    p[order[np.cumsum(p[order]) - p[order] >= top_p]] = 0.0
    return p / p.sum()


NUM_RUNS = 20_000
PROMPT = [3, 9, 4, 12, 7]


@pytest.mark.parametrize("method, filters", [("draft", {}), ("draft", {"top_k": 10, "top_p": 0.85}),
                                             ("medusa", {"top_k": 10, "top_p": 0.85}), ("medusa-tree", {}),
                                             ("eagle", {}), ("eagle-tree", {"top_k": 10, "top_p": 0.85})],
                         ids=["draft-plain", "draft-top_k_top_p", "medusa-top_k_top_p", "medusa-tree-plain",
                              "eagle-plain", "eagle-tree-top_k_top_p"])
def test_sampling_with_drafts_emits_the_targets_distribution(vocab16, vocab16_medusa, vocab16_eagle, method,
                                                             filters):
    model, extra = vocab16_setup(method, vocab16, vocab16_medusa, vocab16_eagle)
    llm = ns.LLM(model, **FP32, block_size=4, max_num_seqs=NUM_RUNS, max_num_batched_tokens=1 << 16,
                 speculation={"method": method.removesuffix("-tree"), "num_speculative_tokens": 2,
                              "mode": "on"}
                 | extra | ({"tree_width": 3} if method.endswith("-tree") else {}))
    params = [ns.SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True, **filters)
              for s in range(NUM_RUNS)]
    outs = np.array([o.token_ids for o in llm.generate([PROMPT] * NUM_RUNS, params)])  # [runs, 3]
    stats = llm.stats()
    assert stats["spec_num_draft_tokens"] > NUM_RUNS  # drafts proposed ...
    # ... some accepted, some not
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    top_k, top_p = filters.get("top_k", 0), filters.get("top_p", 1.0)
    first = reference_probs(llm.score(PROMPT)[-1], top_k, top_p)
    joint, third = np.zeros((16, 16)), np.zeros(16)
    for t1 in np.flatnonzero(first):
        rows = llm.score(PROMPT + [int(t1), 0])
        second = reference_probs(rows[-2], top_k, top_p)
        joint[t1] = first[t1] * second
        for t2 in np.flatnonzero(second):
            third += joint[t1, t2] * reference_probs(llm.score(PROMPT + [int(t1), int(t2)])[-1], top_k, top_p)
    observed = np.zeros((16, 16))
    np.add.at(observed, (outs[:, 0], outs[:, 1]), 1)
    p_joint = chi_square_p_value(observed.ravel(), joint.ravel())
    p_third = chi_square_p_value(np.bincount(outs[:, 2], minlength=16), third)
    print(f"{filters or 'plain'}: chi-square p-values, first two tokens {p_joint:.3f}, "
          f"third {p_third:.3f}")  # -rP
    assert p_joint > MIN_P_VALUE, f"first two tokens: chi-square p-value {p_joint:.2e}"
    assert p_third > MIN_P_VALUE, f"third token: chi-square p-value {p_third:.2e}"


@pytest.mark.parametrize("method, mode", [("ngram", "on"), ("draft", "on"), ("draft", "auto"),
                                          ("medusa", "on"), ("medusa-tree", "on"), ("eagle", "on"),
                                          ("eagle-tree", "on")])
def test_seeded_sampling_with_drafts_gives_the_tokens_of_no_speculation(vocab16, vocab16_medusa,
                                                                        vocab16_eagle, method, mode,
                                                                        memory_bound_costs):
    """Drafts only decide how many of the target's own keyed draws a step makes
    (scheduling/sampling/step_sampler.py)."""
    target, _ = vocab16
    model, extra = vocab16_setup(method, vocab16, vocab16_medusa, vocab16_eagle)
    prompts = [random_prompt(n, seed=n, vocab=16) for n in range(4, 36)]
    params = [ns.SamplingParams(max_tokens=24, temperature=1.0, seed=s, ignore_eos=True,
                                top_p=0.9 if s % 2 else 1.0,
                                **({"top_k": 8, "repetition_penalty": 1.2} if s % 3 == 0 else {}))
              for s in range(len(prompts))]
    reference = [o.token_ids for o in ns.LLM(target, **FP32).generate(prompts, params)]
    spec = {"method": method.removesuffix("-tree"), "mode": mode, "prompt_lookup_min": 1} | extra
    llm = ns.LLM(model, **FP32, speculation=spec)
    if method.endswith("-tree"):
        with_tree_proposer(llm, 3)
    assert [o.token_ids for o in llm.generate(prompts, params)] == reference
    stats = llm.stats()
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"], stats


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_the_policy_widens_trees_where_they_keep_more_and_tokens_stay_the_same(vocab16, vocab16_medusa,
                                                                               vocab16_eagle, method,
                                                                               memory_bound_costs):
    """Random heads over 16 tokens: a head's top 4 holds the next token 4 times as often as its top 1, and on
    a memory-bound step extra tree nodes are nearly free, so the measured counts widen the tree."""
    prompts = [random_prompt(n, seed=n, vocab=16) for n in range(4, 36)]
    params = [ns.SamplingParams(max_tokens=24, temperature=1.0, seed=s, ignore_eos=True)
              for s in range(len(prompts))]
    reference = [o.token_ids for o in ns.LLM(vocab16[0], **FP32).generate(prompts, params)]
    model, _ = vocab16_setup(method, vocab16, vocab16_medusa, vocab16_eagle)
    llm = ns.LLM(model, **FP32, speculation={"method": method, "mode": "on"})
    assert [o.token_ids for o in llm.generate(prompts, params)] == reference
    widths = [d["choice"] for d in llm.diagnostics() if d["choice"].startswith("tree width")]
    assert widths and widths[-1] != "tree width 1", widths
    assert llm.engine.speculation.proposer.accepted_counts.sum(axis=1)[0] >= 16


@pytest.mark.parametrize("method, mode", [("ngram", "auto"), ("draft", "on"), ("draft", "auto"),
                                          ("medusa", "on"), ("eagle", "on")])
def test_same_seed_same_tokens_alone_or_batched(vocab16, vocab16_medusa, vocab16_eagle, method, mode,
                                                memory_bound_costs):
    target, extra = vocab16_setup(method, vocab16, vocab16_medusa, vocab16_eagle)
    spec = {"method": method, "mode": mode} | extra
    params = ns.SamplingParams(max_tokens=20, temperature=0.9, seed=42, ignore_eos=True)
    prompt = random_prompt(6, seed=5, vocab=16)
    alone = ns.LLM(target, **FP32, speculation=spec).generate(prompt, params)[0].token_ids
    others = [random_prompt(3 + i, seed=50 + i, vocab=16) for i in range(15)]
    other_params = [ns.SamplingParams(max_tokens=10 + i, temperature=0.7, seed=i) for i in range(15)]
    llm = ns.LLM(target, **FP32, speculation=spec)
    batched = llm.generate(others[:7] + [prompt] + others[7:], other_params[:7] + [params] + other_params[7:])
    assert batched[7].token_ids == alone
    assert llm.stats()["spec_num_draft_tokens"] > 0


# ---- depth 0 is a plain decode step; figures ------------------------------------------------------

class Untouchable(Proposer):
    def propose(self, requests, depths):
        raise AssertionError("a step with every depth 0 must not call the proposer")


def test_depth_0_calls_no_proposer_and_changes_nothing(llama_dir, mixed, reference):
    llm = ns.LLM(llama_dir, **FP32, speculation={"method": "ngram", "mode": "auto"})
    llm.engine.speculation.proposer = Untouchable()
    llm.engine.speculation.pushed_policy = SpeculationPolicy.off()  # as a scheduler would push it: depth 0
    assert_same(outcome(run(llm.engine, *mixed)), reference)
    stats = llm.stats()
    assert stats["spec_num_drafts"] == stats["spec_depth"] == 0


def test_stats_report_the_counters_and_the_goodput_inputs(llama_dir):
    llm = ns.LLM(llama_dir, **FP32,
                 speculation={"method": "ngram", "mode": "on", "num_speculative_tokens": 3})
    llm.generate([[5, 6, 7, 8] * 6], ns.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    stats = llm.stats()
    assert stats["spec_num_drafts"] > 0 and stats["spec_num_draft_tokens"] >= stats["spec_num_drafts"]
    assert sum(stats["spec_accepted_per_position"]) == stats["spec_num_accepted_tokens"]
    assert len(stats["spec_accept_rate_ema"]) == 3 and stats["spec_step_fixed_s"] >= 0
    assert {"spec_step_per_token_s", "spec_draft_s_per_position", "spec_draft_cost_factor",
            "spec_depth"} <= set(stats)
    # depth changes are logged with reasons
    assert any(d["topic"] == "speculation" for d in llm.diagnostics())
    off = ns.LLM(llama_dir, **FP32).stats()
    assert off["spec_num_drafts"] == 0 and off["spec_method"] == "off"
