"""Structured outputs: every output of a constrained request matches its JSON Schema (checked by jsonschema),
regex (re.fullmatch), choice list or Lark grammar, sampled at temperature 1 from a tiny random model over 8
seeds, and ends "stop" when complete or "length" when max_tokens cuts it; an unconstrained request batched
with constrained ones decodes as alone; invalid constraints are an InvalidRequest naming the problem; a
constrained request under n-gram speculation decodes as without."""

import json
import re

import jsonschema
import numpy as np
import pytest

import numaserve as ns
from scheduling.sampling.structured import Grammars, token_masks

PROMPT = "data: "
SEEDS = range(8)

# closed objects (additionalProperties false) and bounded strings: a random model otherwise wanders in
# extra keys and endless strings past any max_tokens
SCHEMAS = {
    "nested_objects": {
        "type": "object", "additionalProperties": False, "required": ["user"],
        "properties": {"user": {
            "type": "object", "additionalProperties": False, "required": ["id", "tag"],
            "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                           "tag": {"type": "string", "maxLength": 4}}}}},
    "array_min_max_items": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
                            "minItems": 2, "maxItems": 4},
    "enums": {"type": "object", "additionalProperties": False, "required": ["color", "size"],
              "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]}}},
    "integer_bounds": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                       "properties": {"a": {"type": "integer", "minimum": -20, "maximum": 20},
                                      "b": {"type": "integer", "exclusiveMinimum": 100, "maximum": 105}}},
    "required_and_optional": {
        "type": "object", "additionalProperties": False, "required": ["a"],
        "properties": {"a": {"type": "boolean"}, "b": {"type": "integer", "minimum": 0, "maximum": 9},
                       "c": {"type": "string", "maxLength": 3}}},
    "defs_and_ref": {
        "$defs": {"point": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                            "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "y": {"type": "integer", "minimum": 0, "maximum": 9}}}},
        "type": "object", "additionalProperties": False, "required": ["from", "to"],
        "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}}},
    "any_of": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "string", "maxLength": 5},
                         {"type": "null"}]},
    "string_pattern": {"type": "object", "additionalProperties": False, "required": ["code"],
                       "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}},
}

CONSTRAINTS = [ns.StructuredOutputs(json=schema) for schema in SCHEMAS.values()]


@pytest.fixture(scope="module")
def llm(module_llm, llama_dir):
    return module_llm(llama_dir, num_threads=1)


def generate(llm, constraint: ns.StructuredOutputs, max_tokens: int = 200, **params) -> list:
    """One completion per seed, all in one batch, at temperature 1."""
    return llm.generate([PROMPT] * len(SEEDS), [ns.SamplingParams(
        max_tokens=max_tokens, seed=seed, structured_outputs=constraint, **params) for seed in SEEDS])


@pytest.mark.parametrize("name", SCHEMAS)
def test_json_outputs_validate_against_their_schema(llm, name):
    schema = SCHEMAS[name]
    for c in generate(llm, ns.StructuredOutputs(json=schema)):
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)
        assert not re.search(r"\s", re.sub(r'"(\\.|[^"\\])*"', '""', c.text))  # compact outside strings


def test_a_schema_given_as_json_text_is_the_same_constraint(llm):
    schema = SCHEMAS["enums"]
    as_dict = [c.token_ids for c in generate(llm, ns.StructuredOutputs(json=schema))]
    assert [c.token_ids for c in generate(llm, ns.StructuredOutputs(json=json.dumps(schema)))] == as_dict


def test_regex_outputs_fullmatch(llm):
    pattern = r"[a-z]{2,5}-\d{3}(\.[A-Z])?"
    for c in generate(llm, ns.StructuredOutputs(regex=pattern)):
        assert c.finish_reason == "stop" and re.fullmatch(pattern, c.text), c.text


def test_choice_outputs_are_one_of_the_choices(llm):
    choices = ["yes", "no", "maybe later", "ünïcode ✓", "a \"quoted\" \\ word"]
    outputs = [c.text for c in generate(llm, ns.StructuredOutputs(choice=choices))]
    assert set(outputs) <= set(choices)
    assert len(set(outputs)) > 1  # sampled, not stuck on one


def test_lark_grammar_outputs_parse(llm):
    grammar = """
        start: greeting " " name "!" | "(" NUMBER "+" NUMBER ")"
        greeting: "hello" | "hi"
        name: /[A-Z][a-z]{1,6}/
        NUMBER: /[0-9]{1,3}/
    """
    language = r"(hello|hi) [A-Z][a-z]{1,6}!|\([0-9]{1,3}\+[0-9]{1,3}\)"  # the same language, written out
    for c in generate(llm, ns.StructuredOutputs(grammar=grammar)):
        assert c.finish_reason == "stop" and re.fullmatch(language, c.text), c.text


def test_json_object_starts_an_object(llm):
    for c in generate(llm, ns.StructuredOutputs(json_object=True), max_tokens=4):
        assert c.text.startswith("{"), c.text


def test_a_constraint_cut_by_max_tokens_ends_length(llm):
    schema = SCHEMAS["defs_and_ref"]  # at least 25 characters, more than 3 tokens
    for c in generate(llm, ns.StructuredOutputs(json=schema), max_tokens=3):
        assert c.finish_reason == "length" and len(c.token_ids) == 3
        assert c.text.startswith('{"')
        with pytest.raises(json.JSONDecodeError):
            json.loads(c.text)


def test_an_unconstrained_request_batched_with_constrained_ones_decodes_as_alone(llm):
    free = [ns.SamplingParams(max_tokens=24, seed=7), ns.SamplingParams(max_tokens=24, temperature=0)]
    alone = [c.token_ids for c in llm.generate([PROMPT] * 2, free)]
    constrained = [ns.SamplingParams(max_tokens=24, seed=s, structured_outputs=json_constraint)
                   for s, json_constraint in enumerate(CONSTRAINTS)]
    batched = llm.generate([PROMPT] * (2 + len(constrained)), free + constrained)
    assert [c.token_ids for c in batched[:2]] == alone


def test_logprobs_of_a_constrained_request_are_the_models(llm):
    """Logprobs are the model's distribution before the grammar's mask, as they are before penalties."""
    params = ns.SamplingParams(max_tokens=6, temperature=0, logprobs=3,
                               structured_outputs=ns.StructuredOutputs(regex="[0-9]{6}"))
    [c] = llm.generate([PROMPT], params)
    [free] = llm.generate([PROMPT], ns.SamplingParams(max_tokens=1, temperature=0, logprobs=3))
    top = free.logprobs[0]  # the model's 3 most likely tokens (its greedy token among them)
    assert c.token_ids[0] not in top  # no digit among them: the mask chose another token
    assert {t: c.logprobs[0][t] for t in top} == pytest.approx(top)
    assert c.logprobs[0][c.token_ids[0]] < min(top.values())


@pytest.mark.parametrize("constraint, problem", [
    (ns.StructuredOutputs(regex="a(b"), "unclosed group"),
    (ns.StructuredOutputs(grammar="start: foo"), "unknown name"),
    (ns.StructuredOutputs(json={"type": "frob"}), "frob"),
    (ns.StructuredOutputs(json="{not json"), "not valid JSON"),
    (ns.StructuredOutputs(json="[1, 2]"), "JSON Schema object"),
    (ns.StructuredOutputs(choice=[]), "at least one"),
    (ns.StructuredOutputs(grammar="start: <|nosuch|>"), "unknown special token"),  # known to the tokenizer
])
def test_an_invalid_constraint_is_an_invalid_request_naming_the_problem(llm, constraint, problem):
    with pytest.raises(ns.InvalidRequest, match=re.escape(problem)) as e:
        llm.generate([PROMPT, PROMPT], [ns.SamplingParams(max_tokens=4),
                                        ns.SamplingParams(max_tokens=4, structured_outputs=constraint)])
    assert e.value.param == "structured_outputs"
    assert not llm.engine.has_unfinished()  # nothing was queued
    assert len(llm.generate(PROMPT, ns.SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4


def test_structured_outputs_sets_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        ns.StructuredOutputs(json={}, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        ns.StructuredOutputs()


def test_masks_allow_eos_only_where_the_grammar_accepts(llm):
    engine = llm.engine
    grammars = Grammars(engine.tokenizer, engine.spec.vocab_size, engine.spec.eos_token_ids)
    matcher = grammars.matcher(ns.StructuredOutputs(regex="ab+"))
    [eos] = engine.spec.eos_token_ids
    tokenizer = engine.tokenizer
    [allowed] = token_masks([(0, matcher, ())], engine.spec.vocab_size)[0]
    assert not allowed[eos] and all(tokenizer.decode([t]) in ("a", "ab", "abb") or not tokenizer.decode([t])
                                    for t in np.flatnonzero(allowed))
    for text, accepting in (("a", False), ("b", True), ("b", True)):
        [token] = tokenizer.hf_tokenizer.encode(text, add_special_tokens=False).ids
        assert not matcher.advance(token)  # "ab+" may always grow
        assert token_masks([(0, matcher, ())], engine.spec.vocab_size)[0][0, eos] == accepting


def test_a_complete_grammar_stops_without_sampling_eos(llm):
    [c] = llm.generate([PROMPT], ns.SamplingParams(max_tokens=50, seed=0,
                                                   structured_outputs=ns.StructuredOutputs(choice=["done"])))
    assert c.text == "done" and c.finish_reason == "stop"
    assert llm.engine.spec.eos_token_ids[0] not in c.token_ids


def test_constrained_requests_under_ngram_speculation_decode_as_without(llm, llama_dir):
    """Their drafts are cut to what the grammar admits, each row masked after the drafts before it."""
    # no jump-forward: these schemas force tokens after every sampled one, which leaves no step for drafts
    spec = ns.LLM(llama_dir, num_threads=1, speculation={"method": "ngram", "mode": "on"}, jump_forward=False)
    example = '{"color":"red","size":1} {"color":"blue","size":3} {"a":true,"b":4} '
    schemas = [SCHEMAS[name] for name in ("enums", "required_and_optional", "nested_objects")]
    params = [ns.SamplingParams(max_tokens=60, temperature=t, seed=s,
                                structured_outputs=ns.StructuredOutputs(json=schemas[s % 3]))
              for s, t in enumerate([0.0, 1.0] * 4)]
    expected = llm.generate([example * 3] * len(params), params)
    got = spec.generate([example * 3] * len(params), params)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for c, p in zip(got, params):
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), p.structured_outputs.json)
    stats = spec.stats()
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"], stats


def test_constrained_requests_preempted_in_a_small_kv_pool_decode_as_without(llama_dir):
    """A preempted request keeps its matcher: recomputed, it goes on from its output so far."""
    roomy = ns.LLM(llama_dir, num_threads=1, block_size=4)
    block_bytes = 4 * roomy.engine.kv_cache.bytes_per_token
    small = ns.LLM(llama_dir, num_threads=1, block_size=4, kv_cache_bytes=24 * block_bytes,
                   max_num_batched_tokens=64)
    params = [ns.SamplingParams(max_tokens=60, seed=s, structured_outputs=constraint)
              for s, constraint in enumerate(CONSTRAINTS)]
    expected = [c.token_ids for c in roomy.generate([PROMPT] * len(params), params)]
    assert [c.token_ids for c in small.generate([PROMPT] * len(params), params)] == expected
    assert small.stats()["num_preemptions"] > 0
