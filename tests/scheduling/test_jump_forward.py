"""Jump-forward for structured outputs: the tokens a grammar forces are appended without sampling and
computed in the next step, so the output equals constrained decoding without it token for token (greedy and
seeded, every schema of tests/scheduling/test_structured_outputs.py), a fixed-key schema takes fewer steps,
and the engine's stats count the forced tokens and the masked rows."""

import json

import jsonschema

import numaserve as ns
from scheduling.sampling.structured import Grammars, token_masks
from tests.scheduling.test_structured_outputs import PROMPT, SCHEMAS

FIXED_KEYS = {"type": "object", "additionalProperties": False, "required": ["first_name", "last_name", "age"],
              "properties": {"first_name": {"enum": ["Ada", "Alan"]}, "last_name": {"enum": ["Lovelace"]},
                             "age": {"type": "integer", "minimum": 0, "maximum": 99}}}


def params_for(schema: dict) -> list[ns.SamplingParams]:
    """Greedy and seeded requests of one schema."""
    return [ns.SamplingParams(max_tokens=80, temperature=0.0 if seed % 2 else 1.0, seed=seed,
                              structured_outputs=ns.StructuredOutputs(json=schema)) for seed in range(4)]


def test_forced_tokens_equal_constrained_decoding_without_jump_forward(llama_dir):
    params = [p for schema in [*SCHEMAS.values(), FIXED_KEYS] for p in params_for(schema)]
    with ns.LLM(llama_dir, num_threads=1, jump_forward=False) as plain:
        expected = plain.generate([PROMPT] * len(params), params)
        plain_stats = plain.stats()
    with ns.LLM(llama_dir, num_threads=1) as jumping:
        got = jumping.generate([PROMPT] * len(params), params)
        stats = jumping.stats()
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in expected]
    assert plain_stats["num_forced_tokens"] == 0 < stats["num_forced_tokens"]
    assert stats["num_generated_tokens"] == plain_stats["num_generated_tokens"]
    # every sampled token was sampled under its mask, each forced one without: the mask stats count them
    assert plain_stats["num_masked_rows"] == plain_stats["num_generated_tokens"]
    assert stats["num_masked_rows"] == stats["num_generated_tokens"] - stats["num_forced_tokens"]
    assert plain_stats["mask_seconds"] > 0 and plain_stats["mask_wait_seconds"] >= 0
    for c, p in zip(got, params):
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), p.structured_outputs.json)


def test_a_fixed_key_schema_takes_fewer_steps(llama_dir):
    params = params_for(FIXED_KEYS)[1]  # greedy
    runs = {}
    for jump in (False, True):
        with ns.LLM(llama_dir, num_threads=1, jump_forward=jump) as llm:
            [c] = llm.generate(PROMPT, params)
            runs[jump] = c, llm.stats()
    (plain, plain_stats), (jumped, stats) = runs[False], runs[True]
    assert jumped.token_ids == plain.token_ids and plain.finish_reason == "stop"
    text = plain.text
    assert text.startswith('{"first_name":"') and '"last_name":"Lovelace","age":' in text
    # each forced token saved a step
    assert stats["num_steps"] == plain_stats["num_steps"] - stats["num_forced_tokens"]
    assert stats["num_forced_tokens"] >= 5


def test_forced_tokens_are_the_single_allowed_ones(llama_dir):
    llm = ns.LLM(llama_dir, num_threads=1)
    grammars = Grammars(llm.tokenizer, llm.engine.spec.vocab_size, llm.engine.spec.eos_token_ids)
    matcher = grammars.matcher(ns.StructuredOutputs(json=FIXED_KEYS))
    forced = matcher.forced_tokens(100)
    assert llm.tokenizer.decode(forced) == '{"first_name":"A'  # the first name's choice is sampled
    assert matcher.forced_tokens(100) == forced  # the matcher is left where it was
    assert matcher.forced_tokens(3) == forced[:3]
    for token in forced:  # each was the one token the mask allowed
        [mask] = token_masks([(0, matcher, ())], llm.engine.spec.vocab_size).values()
        assert mask[0].nonzero()[0].tolist() == [token]
        matcher.advance(token)
    [mask] = token_masks([(0, matcher, ())], llm.engine.spec.vocab_size).values()
    assert mask[0].sum() > 1 and matcher.forced_tokens(100) == []  # "Ada" or "Alan" is sampled
    llm.close()
