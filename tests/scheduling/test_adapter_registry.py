"""AdapterRegistry: registrations are kept per deployment name and base model. Another model deployed under
the same name neither serves nor loses them (logged with both identities); the first model deployed again
serves them again; a registry written before identities is kept but served by no one."""

import json
import logging
import shutil

import pytest

from models.model_spec import load_spec
from scheduling.lora.adapter_registry import AdapterRegistry, model_identity
from scheduling.lora.adapter_store import AdapterSource, AdapterState


@pytest.fixture
def identities(model_dirs, tmp_path):
    llama = model_dirs["llama"]
    copy = shutil.copytree(llama, tmp_path / "llama-copy")  # same shapes, another checkpoint
    return {"a": model_identity(llama, load_spec(llama)), "a_again": model_identity(llama, load_spec(llama)),
            "copy": model_identity(copy, load_spec(copy)),
            "other": model_identity(model_dirs["qwen3"], load_spec(model_dirs["qwen3"]))}


def test_a_models_identity_is_its_path_architecture_and_adapter_shapes(identities):
    a, copy, other = identities["a"], identities["copy"], identities["other"]
    assert a == identities["a_again"] and a.key == identities["a_again"].key
    assert copy.module_shapes == a.module_shapes and copy.path != a.path and copy.key != a.key
    assert (other.architecture, other.module_shapes) != (a.architecture, a.module_shapes)
    assert other.key != a.key


def test_registrations_are_served_only_by_their_deployment_over_their_model(identities, tmp_path, caplog):
    path = tmp_path / "adapters.json"
    one = AdapterState({"x": AdapterSource(path="/adapters/x@2"),
                        "mix": AdapterSource(weights=(("x", 1.0),), combination="svd")},
                       versions={"x": 2, "gone": 3}, retired={"x": AdapterSource(path="/adapters/x")},
                       digests={"x": "d1", "x@2": "d2"})
    AdapterRegistry(path, "d", identities["a"]).write(one)
    with caplog.at_level(logging.WARNING, logger="numaserve"):
        assert AdapterRegistry(path, "d", identities["copy"]).read() == AdapterState()
    [record] = caplog.records
    assert str(identities["a"]) in record.getMessage() and str(identities["copy"]) in record.getMessage()
    assert "['mix', 'x']" in record.getMessage()
    caplog.clear()
    y = AdapterState({"y": AdapterSource(path="/adapters/y")})
    AdapterRegistry(path, "d", identities["copy"]).write(y)
    z = AdapterState({"z": AdapterSource(path="/adapters/z")})
    AdapterRegistry(path, "e", identities["a"]).write(z)
    with caplog.at_level(logging.WARNING, logger="numaserve"):
        assert AdapterRegistry(path, "d", identities["a_again"]).read() == one  # the first model again
        assert AdapterRegistry(path, "e", identities["a"]).read() == z
    assert len(caplog.records) == 1  # d's registration over the copy; e's is another deployment's
    assert AdapterRegistry(path, "d", identities["other"]).read() == AdapterState()
    assert len(json.loads(path.read_text())["registrations"]) == 3


def test_a_registry_written_before_identities_is_kept_and_served_by_no_one(identities, tmp_path, caplog):
    path = tmp_path / "adapters.json"
    path.write_text(json.dumps({"old": "/adapters/old"}))
    registry = AdapterRegistry(path, "d", identities["a"])
    with caplog.at_level(logging.WARNING, logger="numaserve"):
        assert registry.read() == AdapterState()
    assert "unknown model" in caplog.records[0].getMessage()
    registry.write(AdapterState({"new": AdapterSource(path="/adapters/new")}))
    assert registry.read() == AdapterState({"new": AdapterSource(path="/adapters/new")})
    registrations = json.loads(path.read_text())["registrations"]
    assert {"deployment": None, "model": None, "adapters": {"old": "/adapters/old"}} in registrations
