"""`numaserve serve --config --detach`, `numaserve stats`, `numaserve shutdown`, and their bad input."""

import json

import pytest
import requests

import numaserve as ns
from actors.deploy import DeploymentError
from benchmarks.ports import free_port
from numaserve.cli import main
from tests.cluster.conftest import CONFIGS

NAME = "cli"


def test_serve_stats_shutdown(ray_cluster, llama_dir, capsys):
    port = free_port()
    assert main(["serve", "--config", str(CONFIGS / "two_numa_sim.yaml"), "--model", str(llama_dir),
                 "--name", NAME, "--http-port", str(port), "--served-model-name", "tiny", "--detach"]) == 0
    out = capsys.readouterr().out
    assert f"'{NAME}' serves {llama_dir} with 2 workers" in out
    assert "local-numa0-0: cores [0], 1 threads" in out and "local-numa1-0: cores [1], 1 threads" in out
    assert f"OpenAI-compatible API at http://127.0.0.1:{port}/v1" in out
    assert f"detached; stop with `numaserve shutdown --name {NAME}`" in out  # the session's Ray: not its own
    assert "Ray instance" not in out
    try:
        models = requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        done = ns.connect(NAME).generate("The quick brown fox",
                                         ns.SamplingParams(max_tokens=4, temperature=0))
        assert len(done.token_ids) == 4
        assert main(["stats", "--name", NAME]) == 0
        stats = json.loads(capsys.readouterr().out)
        assert sorted(stats["workers"]) == ["local-numa0-0", "local-numa1-0"]
        assert sum(w["num_requests"] for w in stats["workers"].values()) == 1
        assert set(stats["policies"]) == {"local-numa0-0", "local-numa1-0"}  # telemetry reached the scheduler
    finally:
        assert main(["shutdown", "--name", NAME]) == 0
    assert f"'{NAME}' shut down" in capsys.readouterr().out
    with pytest.raises(DeploymentError):
        ns.connect(NAME)


@pytest.mark.parametrize("yaml_text, message", [
    ("workers_per_node: 0", "workers_per_node"),
    ("engine: {block_size: 12}", "engine.block_size"),
    ("machines: [{name: a, numa_nodes: [{id: 0, cpus: [0]}], cores: 4}]", "machines.0.cores"),
])
def test_serve_with_a_bad_config_exits_2_naming_the_field(tmp_path, capsys, yaml_text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    assert main(["serve", "--config", str(path), "--name", NAME]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--http-port", "0"], "http.port"),
    (["--http-port", "70000"], "http.port"),
    (["--http-host", "0.0.0.0"], "without an HTTP port"),
    (["--served-model-name", "x"], "without an HTTP port"),
    (["--http-port", "8000", "--served-model-name", ""], "http.served_model_name"),
])
def test_serve_with_bad_http_options_exits_2_naming_the_fix(capsys, args, message):
    assert main(["serve", "--config", str(CONFIGS / "two_numa_sim.yaml"), "--name", NAME, *args]) == 2
    assert message in capsys.readouterr().err


def test_serve_with_a_non_integer_http_port_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--http-port", "eighty"])
    assert exit_.value.code == 2 and "--http-port: invalid int value" in capsys.readouterr().err


def test_stats_and_shutdown_of_an_unknown_deployment_exit_2(ray_cluster, capsys):
    assert main(["stats", "--name", "nope"]) == 2
    assert "no numaserve deployment named 'nope'" in capsys.readouterr().err
    assert main(["shutdown", "--name", "nope"]) == 2
