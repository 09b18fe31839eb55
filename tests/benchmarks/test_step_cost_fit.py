"""benchmarks/simulate/step_cost_fit.py: the least-squares fit of the simulator's step-cost model."""

import json

import pytest

from benchmarks.simulate.step_cost_fit import fit, relative_errors, sample_shape
from numaserve.simulate.step_cost import FITTED, StepCostModel, StepShape, default_step_cost, prefill_pairs

TRUTH = StepCostModel(fixed_s=0.015, weights_s=0.03, row_s=0.004, sharpness=3.0, context_token_s=8e-6,
                      prefill_pair_s=5e-6)


def test_the_fit_recovers_a_step_cost_model_and_the_simulator_reads_it(tmp_path):
    """Samples on benchmarks/fit_step_cost.py's grid, their seconds the model's own: the fit finds its
    constants (to 1e-6) and every group's relative error is zero; the simulator reads the JSON."""
    samples = [{"decode_rows": b, "prefill_tokens": p, "context_tokens": b * c}
               for b in (1, 2, 4, 8, 16, 32) for c in (64, 512) for p in (0, 32, 128, 512)]
    for s in samples:
        s["seconds"] = TRUTH.seconds(sample_shape(s))
    model = fit(samples, source="synthetic")
    for name in FITTED:
        assert getattr(model, name) == pytest.approx(getattr(TRUTH, name), rel=1e-6), name
    errors = relative_errors(model, samples)
    assert set(errors) == {"decode_batch_1", "decode_batched", "prefill"}
    assert all(e["max"] < 1e-9 for e in errors.values())
    path = tmp_path / "step_cost.json"
    path.write_text(json.dumps({"model": {k: getattr(model, k) for k in FITTED}}))
    read = default_step_cost(path)
    shape = StepShape(8, 32, 2, 1000, prefill_pairs(32, 100))
    assert read.seconds(shape) == pytest.approx(TRUTH.seconds(shape))
    assert read.source == "step_cost.json"
    assert default_step_cost(tmp_path / "absent.json").source == "built-in guess"
