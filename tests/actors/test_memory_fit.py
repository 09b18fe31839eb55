"""A rank's memory: TinyLlama's shapes (hidden 2048, 32 query and 4 KV heads, intermediate 5632, vocabulary
32000; 2 of its 22 layers, so the vocabulary's rows weigh more than in the real model) at q8_0, loaded whole
and as the two shards of tensor_parallel_size 2: each shard at most 0.55 of the whole, and the estimate a
deployment checks node memory with (scheduling/memory_fit.py) within 1% of what loads. A deployment whose
ranks do not fit a node's declared memory is refused, naming the tensor_parallel_size that fits."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import numaserve as ns
from actors.deploy import DeploymentError, check_memory
from models.checkpoint import load_weights
from models.model_spec import load_spec
from models.tensor_parallel.shard import TensorShard
from numaserve.demo import DEMO_DIR
from scheduling.memory_fit import rank_memory

TINYLLAMA_SHAPE = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
                   "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 4,
                   "max_position_embeddings": 2048}


@pytest.fixture(scope="module")
def tinyllama_shaped(tmp_path_factory):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINYLLAMA_SHAPE, torch_dtype=torch.bfloat16)).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("tinyllama_shaped")
    model.save_pretrained(path)
    return path


def test_each_of_two_ranks_holds_at_most_0_55_of_the_weights_and_the_estimate_is_within_1_percent(
        tinyllama_shaped):
    spec, whole = load_weights(tinyllama_shaped, "q8_0")
    config = ns.EngineConfig(weight_dtype="q8_0")
    assert rank_memory(spec, config).weight_bytes == pytest.approx(whole.nbytes, rel=0.01)
    estimate = rank_memory(spec, config.model_copy(update={"tensor_parallel_size": 2})).weight_bytes
    for rank in range(2):
        _, shard = load_weights(tinyllama_shaped, "q8_0", TensorShard(rank, 2))
        assert shard.nbytes <= 0.55 * whole.nbytes
        assert estimate == pytest.approx(shard.nbytes, rel=0.01)


def four_nodes(memory_gib: float, size: int) -> ns.ClusterConfig:
    nodes = [{"id": i, "cpus": [i], "memory_gib": memory_gib} for i in range(4)]
    return ns.ClusterConfig.model_validate({
        "model": str(DEMO_DIR / "base"), "machines": [{"name": "m", "numa_nodes": nodes}],
        "engine": {"tensor_parallel_size": size, "max_num_seqs": 16, "kv_cache_bytes": 64 << 20}})


def test_a_deployment_whose_ranks_do_not_fit_their_nodes_is_refused_naming_the_size_that_fits():
    spec = load_spec(DEMO_DIR / "base")
    need = {n: rank_memory(spec, four_nodes(1, n).engine).total for n in (1, 2, 4)}
    assert need[1] > need[2] > need[4]
    gib = (need[2] + need[4]) / 2 / (1 << 30)  # a node holds a rank of 4, not of 2
    with pytest.raises(DeploymentError, match="node 0 of machine 'm' at tensor_parallel_size 1 .* "
                                              "set engine.tensor_parallel_size: 4"):
        check_memory(four_nodes(gib, 1), four_nodes(gib, 1).placements())
    check_memory(four_nodes(gib, 4), four_nodes(gib, 4).placements())  # fits
    tiny = need[4] / 4 / (1 << 30)
    with pytest.raises(DeploymentError, match="no tensor_parallel_size up to its 4 nodes fits; lower "
                                              "engine.kv_cache_bytes"):
        check_memory(four_nodes(tiny, 2), four_nodes(tiny, 2).placements())
    two_per_node = four_nodes(gib, 4).model_copy(update={"workers_per_node": 2})  # two ranks a node
    with pytest.raises(DeploymentError, match="2 worker\\(s\\) a node"):
        check_memory(two_per_node, two_per_node.placements())
