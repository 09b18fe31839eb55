"""Static int8 activation scales from observed activations: `minmax`, `percentile` and `kl`.

Each linear layer's input x is summarized by its largest |x| and a histogram of |x| over [0, absmax] in
NUM_BINS bins (a first pass finds absmax, a second fills the histogram). A scale s quantizes x to
clip(rint(x / s), -127, 127) (kernels/formats/int8_layout.py):
- minmax:     s = absmax / 127 (nothing clipped; a single outlier coarsens every other value);
- percentile: s = P-th percentile of |x| / 127 (the top 100 - P % clipped), read off the histogram;
- kl:         TensorRT's entropy calibration (Migacz, "8-bit Inference with TensorRT", GTC 2017): the
              threshold whose 128-level quantized histogram Q is closest to the clipped histogram P in
              KL divergence, with zero bins smoothed as MXNet's and TVM's implementations do.
Implemented here with numpy: the libraries that ship KL calibration (TensorRT, NVIDIA's
pytorch-quantization / ModelOpt, onnxruntime's calibrator) need torch, CUDA or an ONNX graph, for a
search of about 40 lines.
"""

import numpy as np

NUM_BINS = 2048  # TensorRT's histogram size
NUM_LEVELS = 128  # |q| in 0..127
METHODS = ("minmax", "percentile", "kl")
_SMOOTH_EPS = 1e-4


class RangeStats:
    """absmax and the |x| histogram of one matrix's inputs, accumulated over calls."""

    def __init__(self):
        self.absmax = 0.0
        self.hist: np.ndarray | None = None  # [NUM_BINS] int64 over [0, absmax], once absmax is fixed

    def add_absmax(self, x: np.ndarray) -> None:
        self.absmax = max(self.absmax, float(np.abs(x).max(initial=0.0)))

    def add_histogram(self, x: np.ndarray) -> None:
        if self.hist is None:
            self.hist = np.zeros(NUM_BINS, np.int64)
        if self.absmax == 0.0:
            self.hist[0] += x.size
            return
        bins = np.minimum((np.abs(x).ravel() * (NUM_BINS / self.absmax)).astype(np.int64), NUM_BINS - 1)
        self.hist += np.bincount(bins, minlength=NUM_BINS)


def static_scale(stats: RangeStats, method: str, percentile: float = 99.99) -> float:
    """-> the int8 scale s (x ~ q * s) of one matrix's inputs; 0.0 if they were all zero."""
    if stats.absmax == 0.0:
        return 0.0
    if method == "minmax":
        return stats.absmax / 127
    bin_width = stats.absmax / NUM_BINS
    if method == "percentile":
        return percentile_threshold(stats.hist, bin_width, percentile) / 127
    if method == "kl":
        return kl_threshold(stats.hist, bin_width) / 127
    raise ValueError(f"unknown calibration method {method!r}; use one of {', '.join(METHODS)}")


def percentile_threshold(hist: np.ndarray, bin_width: float, percentile: float) -> float:
    """The value below which `percentile` % of the histogram's mass lies, interpolated within its bin."""
    cdf = np.cumsum(hist, dtype=np.float64)
    target = cdf[-1] * percentile / 100
    b = int(np.searchsorted(cdf, target))  # first bin whose cumulative count reaches the target
    before = cdf[b - 1] if b else 0.0
    within = (target - before) / hist[b] if hist[b] else 1.0
    return (b + within) * bin_width


def kl_threshold(hist: np.ndarray, bin_width: float) -> float:
    """The clipping threshold minimizing KL(P || Q) over thresholds of NUM_LEVELS..NUM_BINS bins."""
    hist = hist.astype(np.float64)
    outliers = np.cumsum(hist[::-1])[::-1]  # outliers[i] = sum(hist[i:])
    best_i, best_kl = len(hist), np.inf
    for i in range(NUM_LEVELS, len(hist) + 1):
        p = hist[:i].copy()  # reference: the first i bins, the clipped mass folded into the last
        if i < len(hist):
            p[i - 1] += outliers[i]
        nonzero = p != 0
        # candidate: hist[:i] merged into NUM_LEVELS levels, each spread back evenly over its nonzero bins
        starts = np.arange(NUM_LEVELS) * (i // NUM_LEVELS)  # the last level takes the remainder
        sizes = np.diff(starts, append=i)
        level_mass = np.add.reduceat(hist[:i], starts)
        level_nonzero = np.add.reduceat(nonzero, starts)
        per_bin = np.divide(level_mass, level_nonzero, out=np.zeros(NUM_LEVELS), where=level_nonzero > 0)
        q = np.repeat(per_bin, sizes) * nonzero
        kl = _kl_divergence(_smooth(p), _smooth(q))
        if kl < best_kl:
            best_i, best_kl = i, kl
    return best_i * bin_width


def _smooth(counts: np.ndarray) -> np.ndarray:
    # MXNet's _smooth_distribution on counts: zero bins get eps, taken evenly from the nonzero ones
    zero = counts == 0
    num_zero = int(zero.sum())
    if num_zero == counts.size:
        return np.full(counts.size, 1.0 / counts.size)
    eps1 = _SMOOTH_EPS * num_zero / (counts.size - num_zero)
    out = np.where(zero, _SMOOTH_EPS, np.maximum(counts - eps1, _SMOOTH_EPS))
    return out / out.sum()


def _kl_divergence(p: np.ndarray, q: np.ndarray) -> float:
    # p, q: normalized, every entry > 0
    return float(np.sum(p * np.log(p / q)))
