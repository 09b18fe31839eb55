"""SpeculationConfig refuses fields that do not fit together, naming the field and the fix."""

import pytest
from pydantic import ValidationError

import numaserve as ns


@pytest.mark.parametrize("fields, message", [
    ({"method": "ngram", "tree_width": 2}, "tree_width is set but method='ngram'"),
    ({"method": "eagle", "tree_width": 5}, "less than or equal to 4"),
    ({"method": "medusa", "tree_width": 0}, "greater than or equal to 1"),
    ({"method": "eagle", "num_heads": 2}, "num_heads is set but method='eagle'"),
    ({"method": "draft"}, "draft_model is required"),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "must be <= prompt_lookup_max"),
    ({"method": "beam"}, "method"),
])
def test_bad_speculation_fields_name_the_problem(fields, message):
    with pytest.raises(ValidationError, match=message):
        ns.SpeculationConfig(**fields)


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_tree_width_is_taken_by_the_tree_drafters(method):
    assert ns.SpeculationConfig(method=method, tree_width=3).tree_width == 3


def test_method_auto_takes_every_methods_fields_and_hands_each_method_its_own():
    auto = ns.SpeculationConfig(method="auto", draft_model="d", num_heads=2, tree_width=3,
                                num_speculative_tokens=6)
    assert auto.for_method("draft").draft_model == "d" and auto.for_method("draft").tree_width is None
    assert auto.for_method("medusa").num_heads == 2 and auto.for_method("medusa").draft_model is None
    assert auto.for_method("eagle").tree_width == 3 and auto.for_method("eagle").num_heads is None
    assert {auto.for_method(m).num_speculative_tokens for m in ("ngram", "medusa", "eagle", "draft")} == {6}
