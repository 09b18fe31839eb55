"""Exact output against Hugging Face transformers: logits and greedy tokens, per architecture variant."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

import numaserve as ns
from tests.conftest import random_prompt
from tests.support.model_factory import VARIANTS

PROMPT_LENGTHS = (1, 9, 37, 70)  # mistral's window is 8: every prompt but the first crosses it
# phi3 is served past its original context (the long rope factors): HF rotates a sequence by them only once it
# is longer than that (32), so its prompts start past it (tests/models/test_architectures.py serves it within
# 32)
VARIANT_PROMPT_LENGTHS = {"phi3": (33, 37, 70)}


def hf_logits(model, token_ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float().numpy()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    config = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             generation_config=config)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("variant", VARIANTS)
def test_score_matches_hf_logits_float32(variant, model_dirs, hf_models):
    llm = ns.LLM(model_dirs[variant], weight_dtype="float32", kv_dtype="float32")
    tokens = random_prompt(90, seed=1)
    ours = llm.score(tokens)
    assert ours.shape == (90, 384) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, hf_logits(hf_models[variant], tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_generate_matches_hf_token_for_token(variant, model_dirs, hf_models):
    llm = ns.LLM(model_dirs[variant], weight_dtype="float32", kv_dtype="float32")
    prompts = [random_prompt(n, seed=n) for n in VARIANT_PROMPT_LENGTHS.get(variant, PROMPT_LENGTHS)]
    outs = llm.generate(prompts, ns.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt
        assert out.token_ids == hf_greedy(hf_models[variant], prompt, 32)
        assert out.finish_reason == "length"


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v not in ("qwen3_moe", "mixtral")])
def test_default_kv_int8_stays_within_its_bound_of_hf(variant, model_dirs, hf_models):
    # the default kv_dtype ("auto") stores int8 codes with a float32 scale per row: each cached key and value
    # moves by at most half a step of max|row| / 127, so the logits stay within int8's bounds of
    # tests/models/test_architectures.py (units of the logits' std); a dense family: no router to tip
    from tests.models.test_architectures import KV_BOUNDS, logit_scale, relative_errors
    llm = ns.LLM(model_dirs[variant], weight_dtype="float32")
    assert llm.config.kv_dtype == "auto" and llm.config.resolved_kv_dtype == "int8"
    tokens = random_prompt(90, seed=1)
    max_err, mean_err = relative_errors(llm.score(tokens), hf_logits(hf_models[variant], tokens))
    bound_max, bound_mean = (b * logit_scale(llm) for b in KV_BOUNDS["int8"])
    assert 0 < max_err < bound_max and mean_err < bound_mean, (max_err, mean_err)


def test_score_with_chunked_prefill_matches_one_pass(llama_dir):
    tokens = random_prompt(100, seed=5)
    whole = ns.LLM(llama_dir, weight_dtype="float32", kv_dtype="float32").score(tokens)
    chunked = ns.LLM(llama_dir, weight_dtype="float32", kv_dtype="float32",
                     max_num_batched_tokens=7).score(tokens)
    # chunks of 7 rows take the streaming kernel, the whole prompt takes BLAS: only summation order differs
    np.testing.assert_allclose(chunked, whole, atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_bfloat16_weights_match_hf_on_the_same_rounded_weights(variant, model_dirs, hf_models):
    # Served bf16 weights are exactly the bf16-rounded checkpoint values and every activation stays
    # float32, so against HF run in float32 on those rounded weights only summation order differs:
    # the float32 tolerance holds.
    hf = hf_models[variant]
    rounded = type(hf)(hf.config).eval()
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in hf.state_dict().items()})
    tokens = random_prompt(60, seed=2)
    reference = hf_logits(rounded, tokens)
    ours = ns.LLM(model_dirs[variant], weight_dtype="bfloat16", kv_dtype="float32").score(tokens)
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)
    # bf16 KV on top rounds each cached key/value to 8 mantissa bits (relative error <= 2^-9): logits of
    # unit scale move by a few 1e-3; 3e-2 leaves margin while still catching any real error (logit std ~1).
    ours_bf16_kv = ns.LLM(model_dirs[variant], weight_dtype="bfloat16", kv_dtype="bfloat16").score(tokens)
    assert np.abs(ours_bf16_kv - reference).max() < 3e-2


def test_bfloat16_checkpoint_loads_exactly(tmp_path, llama_dir):
    # a checkpoint stored in bf16 serves the same numbers as the float32 one rounded to bf16 (its own copy
    # of the model: rounding the session's shared one in place would change every later test's reference)
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    hf.to(torch.bfloat16).save_pretrained(tmp_path, safe_serialization=True)
    hf.float()
    from tests.support.model_factory import build_tokenizer
    build_tokenizer(tmp_path)
    tokens = random_prompt(20, seed=3)
    rounded = type(hf)(hf.config).eval()
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in hf.state_dict().items()})
    ours = ns.LLM(tmp_path, weight_dtype="float32", kv_dtype="float32").score(tokens)
    np.testing.assert_allclose(ours, hf_logits(rounded, tokens), atol=1e-4, rtol=0)


def test_text_prompt_uses_the_checkpoint_tokenizer(llama_dir):
    from transformers import AutoTokenizer
    hf_tok = AutoTokenizer.from_pretrained(llama_dir)
    llm = ns.LLM(llama_dir, weight_dtype="float32", kv_dtype="float32")
    text = "The quick brown fox"
    out = llm.generate(text, ns.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert out.prompt_token_ids == hf_tok(text)["input_ids"]
    assert out.prompt_token_ids[0] == 1  # the BOS its post-processor declares
    assert out.text == hf_tok.decode(out.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_last_hidden_states_of_chosen_rows_match_hf_from_the_same_pass(variant, model_dirs, hf_models):
    """What trained draft heads read (Medusa, EAGLE): the final norm's output at the rows asked for, two
    sequences in one flat batch, beside the logits of the same pass."""
    from memory.kv_cache import KVCache
    from models.batch import ForwardBatch
    from models.decoder import DecoderModel
    from models.loader import load_model

    spec, weights, _ = load_model(model_dirs[variant], "float32")
    model, block = DecoderModel(spec, weights), 16
    kv = KVCache(spec.num_layers, 8, block, spec.num_kv_heads, spec.head_dim, "float32")
    # both longer than phi3's original context (HF's long rope factors: test_greedy_generate_matches_hf...)
    prompts = [random_prompt(35, seed=2), random_prompt(40, seed=3)]
    tables = np.array([[0, 1, 2, 7], [3, 4, 5, 6]], np.int32)  # [S, max_blocks]
    token_seq = np.repeat([0, 1], [35, 40]).astype(np.int32)
    positions = np.concatenate([np.arange(35), np.arange(40)]).astype(np.int32)
    slots = tables[token_seq, positions // block].astype(np.int64) * block + positions % block
    rows = np.array([0, 34, 35, 53, 74])  # first and last of each, one in the middle
    batch = ForwardBatch(np.array(prompts[0] + prompts[1]), positions, token_seq, slots, tables,
                         np.array([34, 74]), hidden_indices=rows)
    logits, hidden = model.forward_hidden(batch, kv)
    hf_model = hf_models[variant]
    with torch.no_grad():
        hf = [hf_model.model(torch.tensor([p])).last_hidden_state[0].numpy() for p in prompts]
    np.testing.assert_allclose(hidden, np.concatenate(hf)[rows], atol=1e-4, rtol=0)
    np.testing.assert_allclose(logits, np.stack([hf_logits(hf_model, p)[-1] for p in prompts]),
                               atol=1e-4, rtol=0)
