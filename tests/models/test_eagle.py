"""The EAGLE head (models/proposers/eagle_head.py) against the torch module it is trained as
(scripts/head_modules.py), over scattered KV blocks, and its files refused by name when they do not fit."""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from cluster_configs.errors import CheckpointError
from memory.kv_cache import KVCache
from models.batch import ForwardBatch
from models.loader import load_model
from models.proposers.eagle_head import CONFIG_FILE, HEAD_FILE, eagle_spec, load_eagle_head
from scripts.head_modules import EagleHead


def save_head(directory, head: EagleHead, config: dict | None = None) -> None:
    save_file(head.head_state_dict(), directory / HEAD_FILE)
    (directory / CONFIG_FILE).write_text(json.dumps(config or {"eagle_num_layers": 1}))


@pytest.fixture
def target(model_dirs, tmp_path, request):
    variant = getattr(request, "param", "llama")
    directory = shutil.copytree(model_dirs[variant], tmp_path / variant)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return directory, hf, random_head(hf.config)


def random_head(config) -> EagleHead:
    """A seeded EAGLE head of config's shape, its parameters moved away from the initial ones (norms at 1,
    zero biases)."""
    torch.manual_seed(3)
    head = EagleHead(config).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape) * 0.05)
    return head


def head_against_torch(directory, hf, head: EagleHead):
    """The head saved beside the target in directory, run by numaserve (float32) and by its torch module
    over the same tokens and features, its KV in scattered blocks: ((hidden, logits) ours, (hidden, logits)
    torch's), and the target's spec."""
    save_head(directory, head)
    spec, weights, _ = load_model(directory, "float32")
    ours = load_eagle_head(directory, spec, weights, "float32")
    S, block = 21, 4
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, spec.vocab_size, S)
    features = rng.standard_normal((S, spec.hidden_size)).astype(np.float32)
    kv = KVCache(1, 16, block, spec.num_kv_heads, spec.head_dim, "float32")
    table = rng.permutation(16)[:8].astype(np.int32)[None]  # [1, 8] scattered blocks
    positions = np.arange(S, dtype=np.int32)
    slots = table[0, positions // block].astype(np.int64) * block + positions % block
    batch = ForwardBatch(tokens, positions, np.zeros(S, np.int32), slots, table, np.arange(S),
                         hidden_indices=np.arange(S))
    logits, hidden = ours.forward(batch, kv, features)
    with torch.no_grad():
        expected = head(hf.model.embed_tokens(torch.tensor(tokens)[None]),
                        torch.from_numpy(features)[None])[0]
        expected_logits = hf.lm_head(expected)
    return (hidden, logits), (expected.numpy(), expected_logits.numpy()), spec


@pytest.mark.parametrize("target", ["llama", "qwen2"], indirect=True)
def test_the_eagle_head_matches_its_torch_module_float32(target):
    (hidden, logits), (expected, expected_logits), spec = head_against_torch(*target)
    np.testing.assert_allclose(hidden, expected, atol=1e-4, rtol=0)
    np.testing.assert_allclose(logits, expected_logits, atol=1e-4, rtol=0)
    assert eagle_spec(spec).num_layers == 1


@pytest.mark.parametrize("breakage, message", [
    ("no head", "no EAGLE head beside the model"),
    ("no config", "eagle_config.json: missing"),
    ("two layers", "eagle_num_layers must be 1"),
    ("another model", "trained for another model"),
    ("a tensor missing", "tensor 'fc.bias' is missing"),
])
def test_heads_that_do_not_fit_raise_checkpoint_error_naming_the_problem(target, breakage, message):
    directory, _, head = target
    state = head.head_state_dict()
    if breakage == "another model":
        state["fc.weight"] = state["fc.weight"][:, 1:].contiguous()
    if breakage == "a tensor missing":
        del state["fc.bias"]
    if breakage != "no head":
        save_file(state, directory / HEAD_FILE)
    if breakage != "no config":
        (directory / CONFIG_FILE).write_text(json.dumps(
            {"eagle_num_layers": 2 if breakage == "two layers" else 1}))
    spec, weights, _ = load_model(directory, "float32")
    with pytest.raises(CheckpointError, match=message):
        load_eagle_head(directory, spec, weights, "float32")


def with_draft_vocabulary(directory, head: EagleHead, draft_ids) -> None:
    state = head.head_state_dict()
    state["d2t"] = torch.as_tensor(draft_ids, dtype=torch.int64) - torch.arange(len(draft_ids))
    save_file(state, directory / HEAD_FILE)
    (directory / CONFIG_FILE).write_text(json.dumps({"eagle_num_layers": 1}))


@pytest.mark.parametrize("weight_dtype", ["float32", "q8_0"])
def test_a_draft_vocabulary_keeps_the_full_heads_logits_of_its_tokens(target, weight_dtype):
    directory, _, head = target
    spec, weights, _ = load_model(directory, weight_dtype)
    save_head(directory, head)
    full = load_eagle_head(directory, spec, weights, weight_dtype, "auto")
    draft_ids = np.sort(np.random.default_rng(1).choice(spec.vocab_size, 40, replace=False))
    with_draft_vocabulary(directory, head, draft_ids)
    small = load_eagle_head(directory, spec, weights, weight_dtype, "auto")
    assert np.array_equal(small.draft_ids, draft_ids) and full.draft_ids is None
    S = 6
    rng = np.random.default_rng(2)
    tokens, features = (rng.integers(3, spec.vocab_size, S),
                        rng.standard_normal((S, spec.hidden_size)).astype(np.float32))
    outs = []
    for ours in (full, small):
        kv = KVCache(1, 4, 4, spec.num_kv_heads, spec.head_dim, "float32")
        table = np.array([[2, 0]], np.int32)
        positions = np.arange(S, dtype=np.int32)
        slots = table[0, positions // 4].astype(np.int64) * 4 + positions % 4
        outs.append(ours.forward(ForwardBatch(tokens, positions, np.zeros(S, np.int32), slots, table,
                                              np.arange(S), hidden_indices=np.arange(S)), kv, features))
    (full_logits, full_hidden), (small_logits, small_hidden) = outs
    assert np.array_equal(small_hidden, full_hidden)
    assert np.array_equal(small_logits, full_logits[:, draft_ids])  # each row's dot products, computed alone
    assert np.array_equal(small.target_ids(np.array([[0, 39]])), draft_ids[[[0, 39]]])


@pytest.mark.parametrize("d2t, message", [
    (np.array([0, 5, 3]), "distinct ascending"),  # ids 0, 6, 5
    (np.array([0, 0, 10 ** 6]), "distinct ascending"),  # past the vocabulary
    (np.zeros((2, 2), np.int64), "has shape"),
    (np.array([0.5, 1.5]), "holds indices"),
])
def test_a_draft_vocabulary_that_does_not_fit_raises_checkpoint_error(target, d2t, message):
    directory, _, head = target
    state = head.head_state_dict()
    state["d2t"] = torch.as_tensor(d2t)
    save_file(state, directory / HEAD_FILE)
    (directory / CONFIG_FILE).write_text(json.dumps({"eagle_num_layers": 1}))
    spec, weights, _ = load_model(directory, "float32")
    with pytest.raises(CheckpointError, match=message):
        load_eagle_head(directory, spec, weights, "float32")
