"""Structured outputs under EAGLE speculation: a constrained request's drafts (the head's chain, or a tree's
chain of best guesses) are cut to what its grammar admits, so its tokens equal constrained decoding without
speculation, greedy and seeded, for a JSON Schema, a regex and a choice list, with jump-forward on and off;
a request whose grammar admits none of the head's drafts decodes as without too."""

import json

import jsonschema
import pytest

import numaserve as ns
from tests.scheduling.test_structured_outputs import PROMPT, SCHEMAS
from tests.support.eagle_factory import model_with_eagle, record_drafts

CONSTRAINTS = {"json": ns.StructuredOutputs(json=SCHEMAS["nested_objects"]),
               "regex": ns.StructuredOutputs(regex=r"[a-z]{2,5}-\d{3}(\.[A-Z])?"),
               "choice": ns.StructuredOutputs(choice=["yes", "no", "maybe later", "not today"])}


def params_of(constraint: ns.StructuredOutputs) -> list[ns.SamplingParams]:
    return [ns.SamplingParams(max_tokens=60, temperature=0.0 if seed % 2 else 1.0, seed=seed,
                              structured_outputs=constraint) for seed in range(4)]


PARAMS = [p for constraint in CONSTRAINTS.values() for p in params_of(constraint)]


@pytest.fixture(scope="module")
def expected(llama_dir):
    """The constrained outputs without speculation."""
    with ns.LLM(llama_dir, num_threads=1, jump_forward=False) as llm:
        return llm.generate([PROMPT] * len(PARAMS), PARAMS)


@pytest.fixture(scope="module")
def eagle_dir(llama_dir, expected, tmp_path_factory):
    """The model with an EAGLE head fitted to its constrained outputs (so its drafts pass often and fail
    sometimes: the model's own continuations past them differ)."""
    return model_with_eagle(llama_dir, tmp_path_factory.mktemp("eagle") / "model",
                            prompts=[c.prompt_token_ids + c.token_ids for c in expected])


def eagle_llm(eagle_dir, jump_forward: bool, tree_width: int | None = None) -> ns.LLM:
    return ns.LLM(eagle_dir, num_threads=1, jump_forward=jump_forward,
                  speculation={"method": "eagle", "mode": "on", "tree_width": tree_width})


@pytest.mark.parametrize("jump_forward, tree_width", [(False, None), (False, 2), (True, None)])
def test_constrained_requests_under_eagle_decode_as_without(eagle_dir, expected, jump_forward, tree_width):
    with eagle_llm(eagle_dir, jump_forward, tree_width) as llm:
        got = llm.generate([PROMPT] * len(PARAMS), PARAMS)
        stats = llm.stats()
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in expected]
    for c, p in zip(got, PARAMS):
        assert c.finish_reason == "stop", c.text
        if p.structured_outputs.json is not None:
            jsonschema.validate(json.loads(c.text), p.structured_outputs.json)
    assert stats["spec_num_accepted_tokens"] > 0, stats
    if not jump_forward:  # and some drafts rejected (under jump-forward, forced tokens leave few to draft)
        assert stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"], stats
    else:
        assert stats["num_forced_tokens"] > 0


@pytest.mark.parametrize("jump_forward", [False, True])
def test_a_grammar_admitting_none_of_the_drafts_decodes_as_without(llama_dir, eagle_dir, jump_forward):
    """The head, fitted to the outputs above, never drafts a Q, X or Z token: every draft is cut."""
    constraint = ns.StructuredOutputs(regex="[QXZ]{12}")
    params = [ns.SamplingParams(max_tokens=30, temperature=t, seed=3, structured_outputs=constraint)
              for t in (0.0, 1.0)]
    with ns.LLM(llama_dir, num_threads=1, jump_forward=jump_forward) as plain:
        want = plain.generate([PROMPT] * 2, params)
    with eagle_llm(eagle_dir, jump_forward) as llm:
        drafted = record_drafts(llm)
        got = llm.generate([PROMPT] * 2, params)
        stats = llm.stats()
    assert len(drafted) > 0 and stats["spec_num_draft_tokens"] == 0  # drafted, and none admitted
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert all(c.finish_reason == "stop" and len(c.text) == 12 and set(c.text) <= set("QXZ") for c in got)
