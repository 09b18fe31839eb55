"""Medusa heads (models/proposers/medusa_head.py) against a torch module built as the Medusa repository builds
them, and the files they load from refused by name when they do not fit."""

import json

import numpy as np
import pydantic
import pytest
import torch

import numaserve as ns
from cluster_configs.errors import CheckpointError
from models.model_spec import load_spec
from models.proposers.medusa_head import CONFIG_FILE, load_medusa_heads
from tests.support.medusa_factory import make_heads, save_heads


@pytest.fixture
def model_copy(llama_dir, tmp_path):
    import shutil
    return shutil.copytree(llama_dir, tmp_path / "model")


@pytest.mark.parametrize("num_heads, num_layers", [(4, 1), (2, 2)])
def test_medusa_heads_match_the_torch_module_float32(model_copy, num_heads, num_layers):
    spec = load_spec(model_copy)
    heads = make_heads(spec.hidden_size, spec.vocab_size, num_heads, num_layers, seed=num_heads)
    save_heads(model_copy, heads, num_layers)
    ours = load_medusa_heads(model_copy, spec, "float32")
    hidden = np.random.default_rng(0).standard_normal((5, spec.hidden_size)).astype(np.float32)
    with torch.no_grad():
        expected = np.stack([h(torch.from_numpy(hidden)).numpy() for h in heads])
    got = ours.logits(hidden)
    assert got.shape == (num_heads, 5, spec.vocab_size)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


def test_quantized_heads_keep_the_targets_lm_head_format(model_copy):
    spec = load_spec(model_copy)
    save_heads(model_copy, make_heads(spec.hidden_size, spec.vocab_size, 2, 1, seed=0), 1)
    assert [p.dtype for p in load_medusa_heads(model_copy, spec, "q4_0").projections] == ["q8_0", "q8_0"]
    assert [p.dtype for p in load_medusa_heads(model_copy, spec, "bfloat16").projections] == ["bfloat16"] * 2


@pytest.mark.parametrize("breakage, message", [
    ("no heads", "no Medusa heads beside the model"),
    ("no config", "medusa_config.json: missing"),
    ("bad config", "medusa_num_heads must be an integer from 1 to 8, got 0"),
    ("more heads than saved", "tensor '3.0.linear.weight' is missing"),
    ("another model", "trained for another model"),
])
def test_heads_that_do_not_fit_raise_checkpoint_error_naming_the_problem(model_copy, breakage, message):
    spec = load_spec(model_copy)
    hidden, vocab = spec.hidden_size, spec.vocab_size
    if breakage == "another model":
        vocab += 1
    if breakage != "no heads":
        save_heads(model_copy, make_heads(hidden, vocab, 3, 1, seed=0), 1)
    config = {"no config": None, "bad config": {"medusa_num_heads": 0, "medusa_num_layers": 1},
              "more heads than saved": {"medusa_num_heads": 4, "medusa_num_layers": 1}}.get(breakage, {
                  "medusa_num_heads": 3, "medusa_num_layers": 1})
    if config is None:
        (model_copy / CONFIG_FILE).unlink()
    else:
        (model_copy / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        load_medusa_heads(model_copy, spec, "float32")


def test_an_engine_asked_for_medusa_names_what_is_missing_or_does_not_fit(llama_dir, model_copy):
    with pytest.raises(CheckpointError, match="no Medusa heads beside the model|medusa_config.json: missing"):
        ns.LLM(llama_dir, speculation={"method": "medusa"})
    spec = load_spec(model_copy)
    save_heads(model_copy, make_heads(spec.hidden_size, spec.vocab_size, 2, 1, seed=0), 1)
    with pytest.raises(CheckpointError, match="num_heads=3 but its Medusa heads file has 2"):
        ns.LLM(model_copy, speculation={"method": "medusa", "num_heads": 3})
    with pytest.raises(pydantic.ValidationError, match="num_heads is set but method='ngram'"):
        ns.SpeculationConfig(method="ngram", num_heads=2)
    llm = ns.LLM(model_copy, speculation={"method": "medusa", "num_heads": 1, "mode": "on"})
    assert llm.engine.speculation.proposer.heads.num_heads == 1
