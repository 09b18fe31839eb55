"""Every bad input gets its typed error naming the problem, and the engine keeps serving."""

import asyncio
import json
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

import numaserve as ns
from actors.request_stream import Ingress
from actors.router import Router
from models.safetensors_io import read_header
from models.tokenizer import Tokenizer
from scheduling.validation import TEXT_CHARS_PER_TOKEN_SLACK, RequestLimits, validate_request
from tests.conftest import random_prompt

GOOD = ns.SamplingParams(max_tokens=3, temperature=0)


@pytest.fixture(scope="module")
def llm(module_llm, llama_dir):
    return module_llm(llama_dir, weight_dtype="float32", kv_dtype="float32", max_model_len=64)


@pytest.fixture(scope="module")
def llama_tokenizer(llama_dir):
    return Tokenizer.from_dir(llama_dir)


@pytest.mark.parametrize("fields, name", [
    ({"block_size": 12}, "block_size"),
    ({"block_size": 0}, "block_size"),
    ({"weight_dtype": "fp8"}, "weight_dtype"),
    ({"kv_dtype": "int3"}, "kv_dtype"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_batched_tokens": -5}, "max_num_batched_tokens"),
    ({"kv_cache_bytes": 0}, "kv_cache_bytes"),
    ({"num_threads": 0}, "num_threads"),
    ({"max_lenght": 5}, "max_lenght"),
])
def test_engine_config_rejects_bad_values_naming_the_field(fields, name):
    with pytest.raises(ValidationError, match=name):
        ns.EngineConfig(**fields)


@pytest.mark.parametrize("fields, name", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"stop": [""]}, "stop"),
    ({"logprobs": -1}, "logprobs"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": 5e-324}, "repetition_penalty"),  # 0 as a float32: logits / penalty failed
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"temprature": 1.0}, "temprature"),
])
def test_sampling_params_reject_bad_values_naming_the_field(fields, name):
    with pytest.raises(ValidationError, match=name):
        ns.SamplingParams(**fields)


def test_configs_are_frozen():
    with pytest.raises(ValidationError):
        ns.SamplingParams().max_tokens = 3
    with pytest.raises(ValidationError):
        ns.EngineConfig().block_size = 32


@pytest.mark.parametrize("prompt, message", [
    ("", "empty"),
    ([], "prompt"),
    ([[]], "empty"),
    ([5, 384], "outside the vocabulary"),
    ([-1, 5], "outside the vocabulary"),
    ([random_prompt(64, seed=0)], "max_model_len"),
    ([{"text": "hi"}], "str or a list of int"),
    ([[1.5, 2.0]], "str or a list of int"),
    (None, "prompts must be"),
])
def test_bad_prompts_raise_invalid_request_and_engine_keeps_serving(llm, prompt, message):
    with pytest.raises(ns.InvalidRequest, match=message):
        llm.generate(prompt, GOOD)
    assert llm.generate([5, 6, 7], GOOD)[0].finish_reason == "length"
    assert not llm.engine.has_unfinished()


def test_one_bad_prompt_in_a_batch_rejects_the_batch_before_any_work(llm):
    free_before = llm.stats()["num_free_blocks"]
    with pytest.raises(ns.InvalidRequest, match="outside the vocabulary"):
        llm.generate([[5, 6], [7, 999]], GOOD)
    assert llm.stats()["num_free_blocks"] == free_before and not llm.engine.has_unfinished()


def test_bad_request_arguments(llm):
    with pytest.raises(ns.InvalidRequest, match="unknown adapter"):
        llm.generate([5, 6], GOOD, adapter="nope")
    with pytest.raises(ns.InvalidRequest, match="one per prompt"):
        llm.generate([[5], [6]], [GOOD])
    with pytest.raises(ns.InvalidRequest, match="SamplingParams"):
        llm.generate([5, 6], {"max_tokens": 3})
    with pytest.raises(ns.InvalidRequest, match="outside the vocabulary"):
        llm.score([5, 1000])
    with pytest.raises(ns.InvalidRequest, match="empty"):
        list(llm.stream(""))
    assert ns.InvalidRequest.__mro__[1:3] == (ns.NumaserveError, ValueError)
    assert llm.generate([5, 6], GOOD)[0].finish_reason == "length"


def test_request_that_cannot_fit_the_kv_pool_is_refused(llama_dir):
    small = ns.LLM(llama_dir, weight_dtype="float32", kv_dtype="float32", block_size=4,
                   kv_cache_bytes=2 * 4 * 2 * 2 * 24 * 4 * 4)  # 4 blocks of 4 tokens
    with pytest.raises(ns.InvalidRequest, match="KV blocks"):
        small.generate([5] * 10, ns.SamplingParams(max_tokens=20))
    assert len(small.generate([5] * 10, ns.SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids) == 6


# ---- scheduling/validation.py: the one validation, as the router and the function itself apply it -----

VOCAB, MAX_MODEL_LEN = 384, 64  # the test model's vocabulary; the llm fixture's max_model_len
BAD_REQUESTS = [  # prompt, params, adapter, the message: the problem and the fix
    ("", None, None, "the prompt is empty; pass at least one character or token"),
    ([], None, None, "the prompt is empty; pass at least one token"),
    ([5, 384], None, None,
     r"token ids \[384\] are outside the vocabulary \[0, 384\); pass ids of this model's"),
    ([-1, 5], None, None, r"token ids \[-1\] are outside the vocabulary"),
    ([1.5, 2.0], None, None, "a prompt is a str or a list of int token ids, got list"),
    ([True, 3], None, None, "a prompt is a str or a list of int token ids, got list"),
    ({"text": "hi"}, None, None, "a prompt is a str or a list of int token ids, got dict"),
    (None, None, None, "a prompt is a str or a list of int token ids, got NoneType"),
    (random_prompt(64, seed=0), None, None,
     "prompt has 64 tokens but max_model_len=64 leaves room for at most 63; shorten the prompt"),
    ([5, 6], ns.SamplingParams(stop_token_ids=(3, 999)), None,
     r"stop_token_ids \[999\] are outside the vocabulary \[0, 384\); pass ids the model can generate"),
    ([5, 6], {"max_tokens": 3}, None, "params must be a numaserve.SamplingParams, got dict"),
    ([5, 6], None, "nope",
     r"unknown adapter 'nope' \(registered: a, b\); register it first with register_adapter"),
    ([5, 6], None, 7, r"adapter must be a registered adapter's name \(a str\) or None, got int"),
]


@pytest.mark.parametrize("prompt, params, adapter, message", BAD_REQUESTS)
def test_validation_names_the_problem_and_the_fix(llm, prompt, params, adapter, message):
    limits = RequestLimits(VOCAB, MAX_MODEL_LEN, block_size=16, num_kv_blocks=100)
    with pytest.raises(ns.InvalidRequest, match=message):
        validate_request(prompt, params, limits, tokenizer=llm.tokenizer, adapter=adapter,
                         adapters={"a", "b"})


def test_validation_of_lengths_kv_and_logprobs():
    limits = RequestLimits(VOCAB, MAX_MODEL_LEN)
    # prompt + max_tokens past max_model_len is allowed: generation stops at max_model_len ("length")
    assert validate_request([5] * 63, ns.SamplingParams(max_tokens=100), limits)[0] == [5] * 63
    # a scored prompt may fill max_model_len, not more
    assert len(validate_request([5] * 64, None, limits, prompt_only=True)[0]) == 64
    with pytest.raises(ns.InvalidRequest, match="at most 64; shorten the prompt"):
        validate_request([5] * 65, None, limits, prompt_only=True)
    # what the request may grow to must fit the KV pool: here min(64, 10 + 20) = 30 tokens, 8 blocks of 4
    small_pool = RequestLimits(VOCAB, MAX_MODEL_LEN, block_size=4, num_kv_blocks=7)
    with pytest.raises(ns.InvalidRequest, match="needs up to 8 KV blocks but the pool has 7; lower "
                                                "max_tokens or raise kv_cache_bytes"):
        validate_request([5] * 10, ns.SamplingParams(max_tokens=20), small_pool)
    validate_request([5] * 10, ns.SamplingParams(max_tokens=18), small_pool)  # 28 tokens, 7 blocks
    # the prompt's KV only
    validate_request([5] * 10, ns.SamplingParams(max_tokens=20), small_pool, prompt_only=True)
    with pytest.raises(ns.InvalidRequest,
                       match="logprobs=6 exceeds this engine's limit of 5; ask for at most 5"):
        validate_request([5], ns.SamplingParams(logprobs=6), RequestLimits(VOCAB, max_logprobs=5))


@pytest.mark.parametrize("prompt, params, adapter, message", [r for r in BAD_REQUESTS if r[2] != "nope"])
def test_the_engine_validates_through_the_same_function(llm, prompt, params, adapter, message):
    """Engine.make_request raises what validate_request raises for the engine's limits (vocabulary,
    max_model_len, KV pool, logprobs), before any work."""
    free_before = llm.stats()["num_free_blocks"]
    with pytest.raises(ns.InvalidRequest, match=message) as raised:
        llm.engine.make_request("bad", prompt, params, adapter=adapter)
    with pytest.raises(ns.InvalidRequest) as expected:
        validate_request(prompt, params, llm.engine.inputs.limits, tokenizer=llm.tokenizer, adapter=adapter,
                         adapters=llm.engine.adapters)
    assert (str(raised.value), raised.value.param) == (str(expected.value), expected.value.param)
    assert llm.stats()["num_free_blocks"] == free_before and not llm.engine.has_unfinished()


def test_the_engines_limits_are_its_vocabulary_length_and_kv_pool(llm):
    assert llm.engine.inputs.limits == RequestLimits(VOCAB, MAX_MODEL_LEN, block_size=16,
                                              num_kv_blocks=llm.stats()["num_blocks"])
    with pytest.raises(ns.InvalidRequest, match="unknown adapter 'nope' \\(registered: none\\)"):
        llm.engine.make_request("bad", [5, 6], GOOD, adapter="nope")


def test_validation_returns_the_prompt_ids_and_params():
    limits = RequestLimits(VOCAB)  # what the router knows without a configured max_model_len: no length check
    ids, params = validate_request(np.array([5, 6, 7]), None, limits, adapter="a", adapters=None)
    assert ids == [5, 6, 7] and all(type(t) is int for t in ids) and params == ns.SamplingParams()
    assert validate_request(tuple(random_prompt(500, seed=1)), None, limits)[0] == random_prompt(500, seed=1)


class _Remote:
    """A stand-in for an actor method: .remote(...) returns an awaitable of fn(...)."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        async def call():
            result = self.fn(*args)
            return await result if asyncio.iscoroutine(result) else result
        return call()


class _Stub:
    def __init__(self, **methods):
        for name, fn in methods.items():
            setattr(self, name, _Remote(fn))


def admit_once(tokenizer, prompt, params=None, adapter=None, session=None):
    """A caller's admission (actors/request_stream.py) through the Router actor's code, both run in this
    process with stub workers, scheduler and adapter cache: -> the admitted prompt's token ids, or the error
    raised."""
    registered = {"a": "/adapters/a", "b": "/adapters/b"}
    worker = _Stub(model_info=lambda: {"tokenizer": tokenizer, "vocab_size": VOCAB, "block_size": 16})
    cache = _Stub(path=registered.get, resolve=lambda name: name if name in registered else None,
                  adapters=lambda: dict(registered))
    router = Router.__ray_actor_class__(
        ns.ClusterConfig(engine={"max_model_len": MAX_MODEL_LEN}), {"w0": worker}, _Stub(policies=dict),
        cache)
    router_handle = _Stub(model_info=router.model_info, admit=router.admit, finish=router.finish)

    async def admit():
        stream = await Ingress([router_handle], cache).open(prompt, params, adapter, session)
        assert router.routing.num_calls == {"admit": 1, "finish": 0, "reroute": 0}
        return stream.admission.prompt_token_ids
    return asyncio.run(admit())


@pytest.mark.parametrize("prompt, params, adapter, message", BAD_REQUESTS)
def test_callers_validate_with_the_same_rules(llm, prompt, params, adapter, message):
    with pytest.raises(ns.InvalidRequest, match=message):
        admit_once(llm.tokenizer, prompt, params, adapter)


def test_a_caller_admits_a_good_request(llm):
    assert admit_once(llm.tokenizer, [5, 6, 7], GOOD, adapter="b") == [5, 6, 7]
    assert admit_once(llm.tokenizer, "hello world") == llm.tokenizer.encode("hello world")
    with pytest.raises(ns.InvalidRequest, match="session must be a str"):
        admit_once(llm.tokenizer, [5, 6, 7], session=7)


def test_a_text_too_long_for_any_tokenization_is_refused_before_it_is_tokenized(llm, monkeypatch):
    limits = RequestLimits(VOCAB, MAX_MODEL_LEN)
    monkeypatch.setattr(type(llm.tokenizer), "encode", lambda self, text: pytest.fail("tokenized"))
    with pytest.raises(ns.InvalidRequest, match=r"prompt has 5000000 characters, more than max_model_len=64"):
        validate_request("a" * 5_000_000, None, limits, tokenizer=llm.tokenizer)


def test_a_token_list_too_long_is_refused_before_its_ids_are_checked():
    class Unread(list):
        def __iter__(self):
            pytest.fail("the ids were read")

    with pytest.raises(ns.InvalidRequest, match=r"prompt has 700000 tokens but max_model_len=64"):
        validate_request(Unread([5] * 700_000), None, RequestLimits(VOCAB, MAX_MODEL_LEN))


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=400))
def test_the_text_bound_never_refuses_a_text_that_tokenizes_within_the_limit(llama_tokenizer, text):
    """check_text_length's bound is a lower bound on the tokens: characters <= tokens x the longest token's
    characters x the slack, whatever the text."""
    num_tokens = len(llama_tokenizer.encode(text))
    assert len(text) <= num_tokens * llama_tokenizer.max_token_chars * TEXT_CHARS_PER_TOKEN_SLACK


# ---- checkpoints ----------------------------------------------------------------------------------

def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def edit_config(directory, **changes):
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def test_pickle_checkpoint_is_refused(tmp_path, llama_dir, hf_models):
    shutil.copy(llama_dir / "config.json", tmp_path)
    torch.save(hf_models["llama"].state_dict(), tmp_path / "pytorch_model.bin")  # the legacy format
    with pytest.raises(ns.CheckpointError, match="pickle.*arbitrary code.*safe_serialization=True"):
        ns.LLM(tmp_path)


def test_missing_tensor_is_named(tmp_path, llama_dir):
    d = copy_model(llama_dir, tmp_path / "m")
    entries = read_header(d / "model.safetensors")
    from safetensors.torch import load_file, save_file
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    assert "model.layers.1.mlp.up_proj.weight" in entries
    with pytest.raises(ns.CheckpointError,
                       match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing.*\(96, 64\)"):
        ns.LLM(d)


def test_wrong_shape_is_named(tmp_path, llama_dir):
    d = copy_model(llama_dir, tmp_path / "m")
    from safetensors.torch import load_file, save_file
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 10)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ns.CheckpointError, match=r"o_proj\.weight.*shape \(64, 10\), expected \(64, 96\)"):
        ns.LLM(d)


def test_unknown_architecture_is_named(tmp_path, llama_dir):
    d = copy_model(llama_dir, tmp_path / "m")
    edit_config(d, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ns.CheckpointError, match="GPT2LMHeadModel.*not supported.*LlamaForCausalLM"):
        ns.LLM(d)


@pytest.mark.parametrize("content, message", [("{not json", "not valid JSON"), (None, "missing")])
def test_unreadable_or_missing_config(tmp_path, llama_dir, content, message):
    d = copy_model(llama_dir, tmp_path / "m")
    if content is None:
        (d / "config.json").unlink()
    else:
        (d / "config.json").write_text(content)
    with pytest.raises(ns.CheckpointError, match=f"config.json.*{message}"):
        ns.LLM(d)


def test_config_missing_field_and_not_a_directory(tmp_path, llama_dir):
    d = copy_model(llama_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["hidden_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ns.CheckpointError, match="'hidden_size' is missing"):
        ns.LLM(d)
    with pytest.raises(ns.CheckpointError, match="not a directory"):
        ns.LLM(tmp_path / "nowhere")


def test_truncated_shard_is_refused(tmp_path, llama_dir):
    d = copy_model(llama_dir, tmp_path / "m")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ns.CheckpointError, match="truncated"):
        ns.LLM(d)
