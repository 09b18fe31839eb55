"""StepCostModel's constants from measured steps: nonlinear least squares on log time (scipy), so a 44 ms
batch-1 step counts as much as a 3 s prefill; each sample's relative error, summarized per group.

A sample (benchmarks/fit_step_cost.py) is one measured step shape: decode_rows B with context_tokens in all,
prefill_tokens P of one fresh prompt (its pairs P(P+1)/2), and its median seconds.
"""

import numpy as np
from scipy.optimize import least_squares

from numaserve.simulate.step_cost import FITTED, StepCostModel, StepShape, prefill_pairs

# the starting point: BUILT_IN's magnitudes (x_scale too, so every constant moves in its own units)
_START = np.array([0.01, 0.03, 0.004, 2.0, 5e-6, 5e-6])
_LOWER = np.array([0.0, 0.0, 0.0, 1.0, 0.0, 0.0])
_UPPER = np.array([1.0, 1.0, 1.0, 64.0, 1.0, 1.0])


def sample_shape(sample: dict) -> StepShape:
    return StepShape(sample["decode_rows"], sample["prefill_tokens"], 0, round(sample["context_tokens"]),
                     prefill_pairs(sample["prefill_tokens"], 0))


def sample_group(sample: dict) -> str:
    if sample["prefill_tokens"]:
        return "prefill"
    return "decode_batch_1" if sample["decode_rows"] == 1 else "decode_batched"


def fit(samples: list[dict], source: str) -> StepCostModel:
    """The model minimizing the squared log ratio of modelled to measured seconds over the samples."""
    shapes = [sample_shape(s) for s in samples]
    log_seconds = np.log([s["seconds"] for s in samples])

    def model(x: np.ndarray) -> StepCostModel:
        return StepCostModel(**dict(zip(FITTED, map(float, x))), source=source)

    def residuals(x: np.ndarray) -> np.ndarray:
        m = model(x)
        return np.log([max(m.seconds(s), 1e-12) for s in shapes]) - log_seconds

    result = least_squares(residuals, _START, bounds=(_LOWER, _UPPER), x_scale=_START, xtol=1e-12,
                           ftol=1e-12, gtol=1e-12)
    return model(result.x)


def relative_errors(model: StepCostModel, samples: list[dict]) -> dict[str, dict[str, float]]:
    """Per group (decode_batch_1, decode_batched, prefill): the median and max |modelled / measured - 1|."""
    errors: dict[str, list[float]] = {}
    for s in samples:
        errors.setdefault(sample_group(s), []).append(abs(model.seconds(sample_shape(s)) / s["seconds"] - 1))
    return {g: {"median": float(np.median(e)), "max": float(max(e)), "samples": len(e)}
            for g, e in sorted(errors.items())}
