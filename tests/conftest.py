import os
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.llm_factory import LLMFactory
from tests.support.model_factory import VARIANTS, build_model
from tests.support.no_internals import ErrorBodies
from tests.support.stress import cpu_burner, pytest_addoption, pytest_configure, pytest_generate_tests  # noqa: F401

torch.set_num_threads(1)
# engines the tests build repack at every start and write nothing to ~/.cache (EngineConfig's default reads
# this); tests/models/test_packed_cache.py turns the packed cache on in tmp_path
os.environ["NUMASERVE_CACHE_DIR"] = "off"

CLUSTER_TESTS = Path(__file__).parent / "cluster"


def pytest_collection_modifyitems(config, items):
    """The Ray tests (tests/cluster) run last, the others in their usual order. pytest collects tests/cluster
    first (it sorts "cluster" before "test_*"), so in a fresh clone each deployment's workers compiled the
    numba kernels (cache=True writes the cache at first use) beside the test process compiling the same ones
    for its reference outputs, and the session's Ray cluster then idled beside every other test. After the
    in-process tests the workers load their kernels from the cache (with none cached, a deployment's workers
    under the stress mode's burner did not start within 600 s; with them cached they did in ~3 min), and Ray
    runs only while needed."""
    items.sort(key=lambda item: CLUSTER_TESTS in item.path.parents)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict:
    """variant name -> directory of a tiny random float32 checkpoint."""
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for variant in VARIANTS:
        build_model(root / variant, variant)
        dirs[variant] = root / variant
    return dirs


@pytest.fixture(scope="session")
def hf_models(model_dirs) -> dict:
    # eager attention: the one transformers applies Gemma 2's soft-capping in
    return {v: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                    attn_implementation="eager").eval()
            for v, d in model_dirs.items()}


@pytest.fixture(scope="session")
def llama_dir(model_dirs):
    return model_dirs["llama"]


@pytest.fixture
def make_llm():
    """make_llm(model, **engine) -> an ns.LLM closed when the test ends."""
    factory = LLMFactory()
    yield factory
    factory.close()


@pytest.fixture(scope="module")
def module_llm():
    """module_llm(model, **engine) -> an ns.LLM closed when the module's tests end (a module's shared
    engine fixture builds it here)."""
    factory = LLMFactory()
    yield factory
    factory.close()


def random_prompt(n: int, seed: int, vocab: int = 384) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


@pytest.fixture(autouse=True)
def error_bodies_show_no_internals(monkeypatch):
    """Every 4xx/5xx body of our API that a test's HTTP client receives shows no traceback, path, address or
    Ray id (tests/support/no_internals.py)."""
    bodies = ErrorBodies()
    bodies.install(monkeypatch)
    yield bodies
    assert not bodies.found, "error bodies show internals:\n" + "\n".join(bodies.found)
