"""Import order does not change numba's threading layer or the engine's recorded threading decision; the
thread count an engine or a worker asks for."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numba
import pytest

from kernels import resolve_num_threads

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "numaserve" / "assets" / "demo" / "base"

# torch (which brings its own libgomp) is imported first, or not at all
SCRIPT = ("""
import json, sys
if sys.argv[1] == "torch":
    import torch  # noqa: F401
import numba
import numaserve as ns
llm = ns.LLM(sys.argv[2], max_num_seqs=2)
out = llm.generate(["def fib(n):", "x = "], ns.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
print(json.dumps({"layer": numba.threading_layer(), "torch": "torch" in sys.modules,
                  "decisions": [(d["choice"], d["reason"]) for d in llm.diagnostics() """
          """if d["topic"] == "threading"],
                  "tokens": [c.token_ids for c in out]}))
""")


def run_generate(first: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_THREADING_LAYER", "OMP_WAIT_POLICY")}
    # the layer is pinned, not numba's first choice
    env["NUMBA_THREADING_LAYER_PRIORITY"] = "omp workqueue tbb"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, first, str(DEMO)], check=False, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    return {first: run_generate(first) for first in ("numaserve", "torch")}


def test_torch_imported_first_uses_the_same_threading_layer_and_decision(runs):
    plain, torch_first = runs["numaserve"], runs["torch"]
    assert (plain["torch"], torch_first["torch"]) == (False, True)
    assert torch_first["layer"] == plain["layer"]
    assert len(plain["decisions"]) == 1
    assert torch_first["decisions"] == plain["decisions"]
    assert torch_first["tokens"] == plain["tokens"]


def test_the_pinned_layer_is_not_an_openmp_runtime_someone_else_loaded(runs):
    for run in runs.values():
        assert run["layer"] in ("tbb", "workqueue")
        assert run["decisions"][0][0].startswith(run["layer"])


def test_the_thread_count_is_the_one_asked_for_else_one_per_core_and_never_beyond_numbas_pool():
    pool = numba.config.NUMBA_NUM_THREADS
    assert resolve_num_threads(None, [3]) == 1
    assert resolve_num_threads(1, range(pool + 4)) == 1
    assert resolve_num_threads(None, range(pool + 4)) == pool
    assert resolve_num_threads(pool + 1, [0]) == pool
