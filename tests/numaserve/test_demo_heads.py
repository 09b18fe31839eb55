"""The demo family's trained draft heads (scripts/train_heads.py: Medusa, scripts/train_eagle.py: EAGLE):
greedy tokens unchanged, drafts accepted and rejected."""

from pathlib import Path

import pytest

import numaserve as ns


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_the_shipped_demo_heads_draft_tokens_the_demo_base_accepts(method):
    base = Path(ns.__file__).parent / "assets" / "demo" / "base"
    prompts = ["def parse_args(argv):\n    ", "class Queue:\n    def __init__(self",
               "import os\n\ndef walk(path):\n"]
    params = ns.SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    llm = ns.LLM(base, speculation={"method": method, "mode": "on"})
    assert [o.token_ids for o in llm.generate(prompts, params)] == \
        [o.token_ids for o in ns.LLM(base).generate(prompts, params)]
    stats = llm.stats()
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"], stats
