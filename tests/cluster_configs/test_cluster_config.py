"""ClusterConfig: the shipped YAMLs load, placements and Ray resources follow the topology, bad values name
their field."""

import socket
from pathlib import Path

import pytest
from pydantic import ValidationError

import numaserve as ns
from cluster_configs.cluster_config import HttpConfig, numa_resource

CONFIGS = Path(__file__).parents[2] / "cluster_configs"


def test_the_shipped_configs_load_and_point_at_the_demo_model():
    for name in ("local", "two_numa_sim", "two_node_sim"):
        config = ns.ClusterConfig.from_yaml(CONFIGS / f"{name}.yaml")
        assert (Path(config.model) / "config.json").exists()
    assert ns.ClusterConfig.from_yaml(CONFIGS / "local.yaml").has_auto_topology


def test_two_numa_sim_places_one_single_core_worker_per_simulated_node():
    config = ns.ClusterConfig.from_yaml(CONFIGS / "two_numa_sim.yaml")
    placements = config.placements()
    assert [(p.worker_id, p.cpu_ids, p.resource) for p in placements] == [
        ("local-numa0-0", (0,), "numa_local_0"), ("local-numa1-0", (1,), "numa_local_1")]
    assert config.ray_resources("local") == {"numa_local_0": 1.0, "numa_local_1": 1.0}
    assert [config.worker_engine_config(p).num_threads for p in placements] == [1, 1]


def test_two_node_sim_declares_each_machines_nodes_as_its_own_resources():
    config = ns.ClusterConfig.from_yaml(CONFIGS / "two_node_sim.yaml")
    assert len(config.placements()) == 4
    assert set(config.ray_resources("sim1")) == {numa_resource("sim1", 0), numa_resource("sim1", 1)}


def test_auto_topology_is_resolved_before_placement_and_workers_per_node_multiplies():
    config = ns.ClusterConfig(workers_per_node=2, engine={"num_threads": 2})
    with pytest.raises(ValueError, match="auto"):
        config.placements()
    resolved = config.with_topology([(0, (0, 1, 2, 3)), (1, (4, 5, 6, 7))])
    placements = resolved.placements()
    assert [p.worker_id for p in placements] == ["local-numa0-0", "local-numa0-1", "local-numa1-0",
                                                 "local-numa1-1"]
    assert resolved.worker_engine_config(placements[0]).num_threads == 2  # asked for fewer than the node's 4


def test_tensor_parallel_groups_take_the_nodes_of_one_machine_in_order():
    """A machine of 4 nodes at tensor_parallel_size 2 runs 2 groups, each over 2 nodes (rank 0 the worker on
    the first); each group holds every node's resource; auto machines are grouped once resolved."""
    nodes = [{"id": i, "cpus": [2 * i, 2 * i + 1]} for i in range(4)]
    config = ns.ClusterConfig.model_validate({"machines": [{"name": "m", "numa_nodes": nodes}],
                                              "engine": {"tensor_parallel_size": 2}})
    placements = config.placements()
    assert [(p.worker_id, p.cpu_ids, p.rank_node_ids, p.rank_cpu_ids) for p in placements] == [
        ("m-numa0-0", (0, 1), (1,), ((2, 3),)), ("m-numa2-0", (4, 5), (3,), ((6, 7),))]
    assert placements[1].resources == ("numa_m_2", "numa_m_3")
    auto = ns.ClusterConfig.model_validate({"engine": {"tensor_parallel_size": 2}})
    with pytest.raises(ValueError, match="machine 'local' has 1 NUMA node"):
        auto.with_topology([(0, (0, 1))]).placements()
    assert [p.rank_node_ids for p in auto.with_topology([(0, (0,)), (1, (1,))]).placements()] == [(1,)]


def test_relative_paths_in_yaml_are_taken_from_the_files_folder(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.yaml").write_text("model: ../m\nadapter_registry: reg.json\n")
    config = ns.ClusterConfig.from_yaml(tmp_path / "sub" / "c.yaml")
    assert (config.model == str(tmp_path / "m")
            and config.adapter_registry == str(tmp_path / "sub" / "reg.json"))


@pytest.mark.parametrize("yaml_text, field", [
    ("workers_per_node: 0", "workers_per_node"),
    ("max_queued_per_worker: -1", "max_queued_per_worker"),
    ("telemetry_interval_s: 0", "telemetry_interval_s"),
    ("target_step_ms: -5", "target_step_ms"),
    ("engine: {block_size: 12}", "engine.block_size"),
    # a tensor-parallel group takes whole nodes of one machine
    (("machines: [{numa_nodes: [{id: 0, cpus: [0]}, {id: 1, cpus: [1]}, {id: 2, cpus: [2]}]}]\n"
     "engine: {tensor_parallel_size: 2}"), "engine.tensor_parallel_size 2: machine 'local' has 3 NUMA"),
    ("engine: {tensor_parallel_size: 0}", "engine.tensor_parallel_size"),
    ("engine: {max_lenght: 5}", "engine.max_lenght"),
    ("machines: []", "machines"),
    ("machines: [{name: 'bad name'}]", "machines.0.name"),
    ("machines: [{name: a}, {name: a}]", "machines"),
    ("machines: [{numa_nodes: sometimes}]", "machines.0.numa_nodes"),
    ("machines: [{numa_nodes: [{id: 0, cpus: []}]}]", "machines.0.numa_nodes"),
    ("machines: [{numa_nodes: [{id: 0, cpus: [0]}, {id: 0, cpus: [1]}]}]", "machines.0.numa_nodes"),
    ("machines: [{numa_nodes: [{id: 0, cpus: [0, 1]}, {id: 1, cpus: [1]}]}]", "machines.0.numa_nodes"),
    ("machines: [{numa_nodes: [{id: -1, cpus: [0]}]}]", "machines.0.numa_nodes"),
    ("workers: 2", "workers"),
    ("http: {port: 0}", "http.port"),
    ("http: {port: 70000}", "http.port"),
    ("http: {host: ''}", "http.host"),
    ("http: {prot: 8000}", "http.prot"),
    ("http: {served_model_name: ''}", "http.served_model_name"),
    ("http: {replicas: 0}", "http.replicas"),
    ("router: {replicas: 0}", "router.replicas"),
    ("router: {sweep_grace_s: 1}", "router.sweep_grace_s"),
    ("router: {replicas: 2, colour: red}", "router.colour"),
    ("- just\n- a list", "ClusterConfig"),
    # wrong types and unknown keys (the bad-input matrix)
    ("workers_per_node: two", "workers_per_node"),
    ("engine: 5", "engine"),
    ("engine: {max_num_seqs: many}", "engine.max_num_seqs"),
    ("engine: {enable_prefix_caching: [1]}", "engine.enable_prefix_caching"),
    ("http: {port: '80a'}", "http.port"),
    ("engine: {block_size: 16, colour: red}", "engine.colour"),
])
def test_bad_yaml_values_raise_a_validation_error_naming_the_field(tmp_path, yaml_text, field):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ValidationError, match=field.replace(".", r"\.")):
        ns.ClusterConfig.from_yaml(path)


def test_broken_yaml_says_which_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("machines: [unclosed\n")
    with pytest.raises(ValueError, match="broken.yaml: not valid YAML"):
        ns.ClusterConfig.from_yaml(path)


def test_unknown_machine_and_unresolved_auto_are_refused_by_ray_resources():
    config = ns.ClusterConfig()
    with pytest.raises(ValueError, match="no machine named 'elsewhere'"):
        config.ray_resources("elsewhere")
    with pytest.raises(ValueError, match="auto"):
        config.ray_resources("local")


def test_a_config_is_frozen():
    with pytest.raises(ValidationError):
        ns.ClusterConfig().workers_per_node = 3


def test_the_http_server_is_off_unless_configured_and_binds_loopback_by_default(tmp_path):
    assert ns.ClusterConfig().http is None
    path = tmp_path / "http.yaml"
    path.write_text("http: {port: 8123}")
    http = ns.ClusterConfig.from_yaml(path).http
    assert (http.host, http.port, http.served_model_name, http.enable_lora_loading) == (
        "127.0.0.1", 8123, None, False)


def test_one_router_and_one_http_actor_per_machine_unless_replicas_say_otherwise():
    two_machines = ns.ClusterConfig.from_yaml(CONFIGS / "two_node_sim.yaml")
    assert two_machines.router.replicas == 1 and two_machines.num_http_actors == 0  # no `http:`: none
    assert two_machines.model_copy(update={"http": HttpConfig()}).num_http_actors == 2
    config = ns.ClusterConfig.model_validate({"http": {"replicas": 3}, "router": {"replicas": 2}})
    assert (config.num_http_actors, config.router.replicas) == (3, 2)
    assert ns.ClusterConfig.model_validate({"http": {}}).num_http_actors == 1


def test_http_actors_sharing_a_port_need_so_reuseport(monkeypatch):
    monkeypatch.delattr(socket, "SO_REUSEPORT", raising=False)
    with pytest.raises(ValidationError, match=r"SO_REUSEPORT.*set http: \{replicas: 1\}"):
        ns.ClusterConfig.model_validate({"http": {"replicas": 2}})
    assert ns.ClusterConfig.model_validate({"http": {"replicas": 1}}).num_http_actors == 1
