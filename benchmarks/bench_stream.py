"""The 1-token weight stream of the int8 kernels: how fast matmul_vnni reads TinyLlama-shaped q8_0 and q4_0
matrices at 1 token, against a read probe of the same bytes, by where the weights start past a cache line
(kernels/placement.py) and with or without the software prefetch at 1 token (kernels/simd/vnni.py).

Kernel-level, in one process (no engine, no llama.cpp): every variant alternates with the others and with
the probe, the order flipping each repeat, so a variant's figure and its ratio to the probe come from the same
memory phase (this VM's bandwidth swings up to 2x within seconds). The weights are random bytes in the packed
layout (the kernel's time does not depend on their values) with real fp16 scales; 1.1 GB (q8_0) / 0.62 GB
(q4_0) per pass, well past the caches. The "no prefetch below 4 tokens" variant is the same kernel compiled
with simd_vnni.PREFETCH_MIN_TOKENS = 4, the shipped value before 2026-12-02 (the code generator reads it when
it lowers a block).

    python -m benchmarks.bench_stream [--offsets 0,8,16,24,32,48] [--repeats 8] [--threads 2]

Writes benchmarks/results/stream.json and stream.png.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
from numba import njit, prange, set_num_threads

import kernels  # noqa: F401  (pins numba's threading layer first)
from benchmarks.machine import cpu_name
from kernels.formats.int8_layout import padded_k, quantize_activations
from kernels.linear import int8 as linear_int8
from kernels.linear.chunking import linear_tiles
from kernels.placement import LINE, STREAM_OFFSET
from kernels.simd import vnni as simd_vnni

RESULTS = Path(__file__).parent / "results"
CHUNK = linear_tiles().x_chunk_bytes  # x's bytes per pass over the weights, this CPU's
# TinyLlama-1.1B: per layer qkv, o, gate_up, down; then the LM head
SHAPES = [(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632)] * 22 + [(32000, 2048)]


@njit(cache=True, nogil=True, parallel=True)
def _probe(b):
    # b: uint8 [n]; one byte of every cache line, the lines split between the threads
    acc = 0
    for i in prange(b.shape[0] // 64):
        acc += b[i * 64]
    return acc


def _matrices(bits: int, rng) -> list[tuple]:
    """The kernel's operands for every matrix, 1 token: (xq, xd, xsum, data, scales, out)."""
    out = []
    for n, k in SHAPES:
        kp, n4 = padded_k(k), -(-n // 4) * 4
        data = rng.integers(0, 256, (n4, kp if bits == 8 else kp // 2), dtype=np.uint8)
        scales = (rng.random((n4, kp // 32), dtype=np.float32) * 0.01).astype(np.float16).view(np.uint16)
        x = rng.standard_normal((1, k)).astype(np.float32)
        xq, xd, xsum = np.empty((1, kp), np.int8), np.empty((1, kp // 32), np.float32), \
            np.empty((1, kp // 32), np.int32)
        quantize_activations(x, xq, xd, xsum)
        out.append((xq, xd, xsum, data, scales, np.empty((1, n), np.float32)))
    return out


def _placed(a: np.ndarray, offset: int) -> np.ndarray:
    """A copy of a starting `offset` bytes past a cache line."""
    raw = np.empty(a.nbytes + 2 * LINE, np.uint8)
    start = (offset - raw.ctypes.data) % LINE
    out = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def _kernel_with_prefetch_below(min_tokens: int):
    """matmul_vnni compiled afresh with simd_vnni.PREFETCH_MIN_TOKENS = min_tokens."""
    shipped = simd_vnni.PREFETCH_MIN_TOKENS
    simd_vnni.PREFETCH_MIN_TOKENS = min_tokens
    try:
        kernel = njit(nogil=True, parallel=True)(linear_int8.matmul_vnni.py_func)
        xq = np.zeros((1, 256), np.int8)
        kernel(xq, np.zeros((1, 8), np.float32), np.zeros((1, 8), np.int32), np.zeros((4, 256), np.uint8),
               np.zeros((4, 8), np.uint16), np.zeros((1, 4), np.float32), 8, CHUNK)  # compiles now, with this
        kernel(xq, np.zeros((1, 8), np.float32), np.zeros((1, 8), np.int32), np.zeros((4, 128), np.uint8),
               np.zeros((4, 8), np.uint16), np.zeros((1, 4), np.float32), 4, CHUNK)
    finally:
        simd_vnni.PREFETCH_MIN_TOKENS = shipped
    return kernel


def run_format(bits: int, offsets: list[int], repeats: int, rng) -> dict:
    base = _matrices(bits, rng)
    nbytes = sum(m[3].nbytes + m[4].nbytes for m in base)
    variants = {f"offset {o}": (linear_int8.matmul_vnni, [(*m[:3], _placed(m[3], o), *m[4:]) for m in base])
                for o in offsets}
    shipped = variants[f"offset {STREAM_OFFSET}"][1]
    variants["offset 16, no prefetch below 4 tokens"] = (_kernel_with_prefetch_below(4), shipped)
    del base
    probe_bytes = [m[3].reshape(-1) for m in shipped] + [m[4].reshape(-1).view(np.uint8) for m in shipped]

    def timed(name):
        kernel, mats = variants[name]
        start = time.perf_counter()
        for m in mats:
            kernel(*m, bits, CHUNK)
        return nbytes / (time.perf_counter() - start)

    def probe():
        start = time.perf_counter()
        for b in probe_bytes:
            _probe(b)
        return nbytes / (time.perf_counter() - start)

    for name in variants:  # warm: compile and first touch
        timed(name)
    probe()
    rates = {name: [] for name in variants}
    probes = []
    for r in range(repeats):
        names = list(variants) if r % 2 == 0 else list(variants)[::-1]
        probes.append(probe())
        for name in names:
            rates[name].append(timed(name))
    return {"format": "q8_0" if bits == 8 else "q4_0", "bytes_per_pass": nbytes,
            "probe_gb_s": [p / 1e9 for p in probes],
            "variants": {name: {"gb_s": [v / 1e9 for v in vs], "median_gb_s": statistics.median(vs) / 1e9,
                                "median_of_probe": statistics.median(v / p for v, p in zip(vs, probes))}
                         for name, vs in rates.items()}}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(result["formats"]), figsize=(6 * len(result["formats"]), 4))
    for ax, fmt in zip(np.atleast_1d(axes), result["formats"]):
        names = list(fmt["variants"])
        ax.bar(range(len(names)), [fmt["variants"][n]["median_gb_s"] for n in names])
        ax.axhline(statistics.median(fmt["probe_gb_s"]), color="k", linestyle="--", label="read probe")
        ax.set_xticks(range(len(names)), [n.replace(", ", "\n") for n in names], fontsize=7)
        ax.set_ylabel("GB/s at 1 token (median)")
        ax.set_title(f"{fmt['format']}: matmul_vnni, 1 token")
        ax.legend()
    fig.suptitle(f"{result['meta']['cpu']}, {result['meta']['threads']} threads, {result['meta']['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--offsets", default="0,8,16,24,32,48")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    set_num_threads(args.threads)
    offsets = [int(o) for o in args.offsets.split(",")]
    if STREAM_OFFSET not in offsets:
        offsets.append(STREAM_OFFSET)
    rng = np.random.default_rng(0)
    result = {"meta": {"cpu": cpu_name(), "threads": args.threads, "repeats": args.repeats,
                       "date": time.strftime("%Y-%m-%d %H:%M"), "shapes": "TinyLlama-1.1B, 1 token",
                       "order": "variants and probe alternate, the order flipping each repeat"},
              "formats": [run_format(bits, offsets, args.repeats, rng) for bits in (8, 4)]}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "stream.json").write_text(json.dumps(result, indent=1))
    plot(result, RESULTS / "stream.png")
    for fmt in result["formats"]:
        print(fmt["format"], f"probe {statistics.median(fmt['probe_gb_s']):.1f} GB/s",
              {n: round(v["median_gb_s"], 1) for n, v in fmt["variants"].items()})


if __name__ == "__main__":
    main()
