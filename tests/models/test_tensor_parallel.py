"""One model sharded over tensor-parallel ranks (real processes and their shared segment): each rank holds its
part of every tensor, and the sharded forward gives the whole model's logits and hidden states (within float32
rounding: the partial sums add in another order), the same bits on a rerun."""

import re

import numpy as np
import pytest

from cluster_configs.errors import CheckpointError
from models.checkpoint import TensorReader, expected_shapes, load_weights
from models.decoder import DecoderModel
from models.lora.adapter import load_lora
from models.lora.slots import LoraSlots
from models.model_spec import load_spec
from models.safetensors_io import read_tensor
from models.tensor_parallel.shard import TensorShard
from tests.models.test_lora import make_adapter
from tests.support.tp_ranks import run_forward, run_ranks, two_sequence_batches

# dense with GQA (llama), one KV head replicated on both ranks and tied, vocabulary-parallel embeddings
# (llama_tied), per-head q/k norms (qwen3), post-norms and soft-caps (gemma3), experts sharded (qwen3_moe) or
# whole on ranks (qwen3_moe_ep: expert parallelism), q|k|v and gate|up stored fused (phi3)
TP_VARIANTS = ("llama", "llama_tied", "qwen3", "gemma3", "qwen3_moe", "qwen3_moe_ep", "phi3")


def _model(variant: str) -> tuple[str, bool]:
    """-> (the checkpoint's name, expert parallel)"""
    return variant.removesuffix("_ep"), variant.endswith("_ep")


@pytest.fixture(scope="module")
def sharded_runs(model_dirs):
    """variant -> (the whole model's outputs, rank -> (outputs, rerun outputs, weight bytes, KV heads)), from
    one pair of rank processes running every variant."""
    jobs = [(model_dirs[_model(v)[0]], two_sequence_batches(384, seed=i), _model(v)[1])
            for i, v in enumerate(TP_VARIANTS)]
    ranks = run_ranks(2, jobs)
    runs = {}
    for i, (variant, (model_dir, batches, _)) in enumerate(zip(TP_VARIANTS, jobs)):
        spec, weights = load_weights(model_dir, "float32")
        whole = run_forward(DecoderModel(spec, weights), batches)
        runs[variant] = (whole, weights.nbytes, {r: ranks[r][i] for r in ranks})
    return runs


@pytest.mark.parametrize("variant", TP_VARIANTS)
def test_two_ranks_give_the_whole_models_logits_and_hidden_states_and_the_same_bits_again(variant,
                                                                                          sharded_runs):
    whole, _, ranks = sharded_runs[variant]
    for step, (logits, hidden) in enumerate(whole):
        tp_logits, tp_hidden = ranks[0][0][step]
        np.testing.assert_allclose(tp_logits, logits, atol=1e-4, rtol=0)
        assert (tp_logits.argmax(-1) == logits.argmax(-1)).all()
        np.testing.assert_allclose(tp_hidden, hidden, atol=1e-4, rtol=0)
        assert ranks[1][0][step][0] is None  # logits are gathered on rank 0 only
        assert ranks[1][0][step][1].tobytes() == tp_hidden.tobytes()  # every rank holds the same residual
        for r in ranks:  # the rerun: the same bits (sums in rank order, whatever the timing)
            again = ranks[r][1][step]
            assert again[1].tobytes() == ranks[r][0][step][1].tobytes()
            if r == 0:
                assert again[0].tobytes() == tp_logits.tobytes()


@pytest.mark.parametrize("variant", TP_VARIANTS)
def test_each_rank_holds_about_half_the_weights_and_its_kv_heads(variant, sharded_runs, model_dirs):
    _, whole_bytes, ranks = sharded_runs[variant]
    spec = load_spec(model_dirs[_model(variant)[0]])
    for _, _, weight_bytes, kv_heads in ranks.values():
        # norms and routers stay whole on every rank: tiny beside the matrices
        assert weight_bytes <= 0.55 * whole_bytes
        assert kv_heads == max(1, spec.num_kv_heads // 2)  # a single KV head is replicated
    assert sum(r[2] for r in ranks.values()) >= whole_bytes  # nothing is lost between the shards


@pytest.mark.parametrize("variant", TP_VARIANTS)
def test_the_ranks_parts_of_every_tensor_put_together_are_the_tensor(variant, model_dirs):
    """The parts of the two ranks, each cut at its spans and put side by side kind by kind along their axis
    (q | k | v and gate | up stored fused), are the tensor; a lone KV head's rows are whole on both ranks."""
    name, expert_parallel = _model(variant)
    spec = load_spec(model_dirs[name])
    reader = TensorReader(model_dirs[name], spec)
    shards = [TensorShard(r, 2, expert_parallel) for r in range(2)]
    for name in expected_shapes(spec):
        whole = reader(name)
        parts = [reader.part(name, spec, s) for s in shards]
        plans = [s.pieces(name, spec) for s in shards]
        if plans[0] is None or (spec.num_kv_heads == 1 and re.search(r"\.[kv]_proj\.", name)):
            assert all(p.tobytes() == whole.tobytes() for p in parts), name
            continue
        axis = plans[0][0]
        kinds = [np.split(p, np.cumsum([hi - lo for lo, hi in plan[1]])[:-1], axis=axis)
                 for p, plan in zip(parts, plans)]
        together = np.concatenate([np.concatenate([k[i] for k in kinds], axis=axis)
                                   for i in range(len(kinds[0]))], axis=axis)
        assert together.tobytes() == whole.tobytes(), name
    reader.close()


def test_expert_parallel_ranks_hold_disjoint_whole_experts_covering_all_and_split_the_rest(model_dirs):
    """Under expert parallelism each rank holds half the experts, each one's matrices whole (as the file
    has them), the two halves all of them; attention and the dense layer are split as without it."""
    spec = load_spec(model_dirs["qwen3_moe"])  # 8 experts, the first layer dense
    reader = TensorReader(model_dirs["qwen3_moe"], spec)
    expert_5 = reader("model.layers.1.mlp.experts.5.down_proj.weight")
    reader.close()
    held = []
    for r in range(2):
        shard = TensorShard(r, 2, expert_parallel=True)
        local = shard.local_spec(spec)
        assert local.moe_intermediate_size == spec.moe_intermediate_size  # whole experts
        assert (local.num_heads, local.intermediate_size) == \
            (TensorShard(r, 2).local_spec(spec).num_heads, spec.intermediate_size // 2)
        held.append(local.held_experts)
        _, weights = load_weights(model_dirs["qwen3_moe"], "float32", shard)
        experts = weights.layers[1].experts
        assert experts.held == local.held_experts and experts.router.shape == (8, spec.hidden_size)
        if experts.held[0] <= 5 < experts.held[1]:
            assert experts.expert(5)[1].data.tobytes() == expert_5.tobytes()
    assert held == [(0, 4), (4, 8)]
    with pytest.raises(CheckpointError, match="tensor_parallel_size 16"):
        TensorShard(0, 16, expert_parallel=True).local_spec(spec)


def test_a_row_span_read_from_the_file_equals_those_rows_of_the_whole_tensor(model_dirs):
    reader = TensorReader(model_dirs["llama"], load_spec(model_dirs["llama"]))
    entry = reader.entries["model.embed_tokens.weight"]
    whole = read_tensor(entry)
    for lo, hi in ((0, 1), (5, 17), (383, 384), (0, 384)):
        assert read_tensor(entry, (lo, hi)).tobytes() == whole[lo:hi].tobytes()
    reader.close()


def test_a_shard_the_heads_or_sizes_do_not_allow_is_refused_naming_tensor_parallel_size(model_dirs):
    spec = load_spec(model_dirs["llama"])  # 4 query heads, 2 KV heads, intermediate 96
    with pytest.raises(CheckpointError, match="tensor_parallel_size 3 must divide the query heads"):
        TensorShard(0, 3).local_spec(spec)
    with pytest.raises(CheckpointError, match="tensor_parallel_size 1"):
        TensorShard(0, 2).local_spec(load_spec(model_dirs["olmo2"]))  # q/k normed over all heads at once
    with pytest.raises(ValueError, match="rank 2 of a group of 2"):
        TensorShard(2, 2)


def test_lora_slots_hold_each_ranks_part_and_only_rank_0_keeps_a_journal_for_the_followers(model_dirs,
                                                                                          tmp_path):
    """A rank's slots hold its part of each adapter (put side by side the two ranks' parts are the adapter);
    rank 0 records what it loads for the followers until taken; a follower, loading what rank 0 sends into
    the slots rank 0 chose, keeps neither a journal nor the names rank 0 evicted."""
    spec = load_spec(model_dirs["llama"])
    adapters = [load_lora(n, make_adapter(model_dirs["llama"], tmp_path / n, seed=i), spec)
                for i, n in enumerate("abc")]
    ranks = [LoraSlots(spec, 2, 8, "float32", TensorShard(r, 2)) for r in range(2)]
    for r, slots in enumerate(ranks):
        for i, adapter in enumerate(adapters):
            slots.load(adapter, i % 2)  # c replaces a in slot 0
        assert slots.held == {"b": 1, "c": 0}
        assert [(s, a.name) for s, a in slots.take_loads()] == ([(0, "a"), (1, "b"), (0, "c")] if r == 0
                                                                else [])
        assert slots.take_loads() == []
    lora = adapters[2].module_layers[0]
    q = lambda slots: slots.bt["q_proj"][0, 0, :lora["q_proj"].rank]
    o = lambda slots: slots.a["o_proj"][0, 0, :lora["o_proj"].rank]
    np.testing.assert_array_equal(np.concatenate([q(s) for s in ranks], axis=1), lora["q_proj"].b.T)
    np.testing.assert_array_equal(np.concatenate([o(s) for s in ranks], axis=1), lora["o_proj"].a)
