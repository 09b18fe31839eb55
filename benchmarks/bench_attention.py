"""One layer's decode attention as the model calls it (memory/kv_formats.attend_as: paged_attention, rotations
included), TinyLlama's heads (32 query, 4 KV, head_dim 64) at the engine's block size, per KV dtype, batch
and context: each sequence's context in consecutive blocks (a fresh engine's), one decode token each at the
last position.

Every timed call is preceded by an untimed read of a buffer larger than the last-level cache ("cold", the
default): in a model step the layer's weights stream between two attention calls, so its KV is never
cached; "hot" leaves out the read (what the arithmetic costs). The configurations are timed round-robin, one
call each a round, so drift reaches all alike; each row is the median over the rounds. Kernels compile (or
load from numba's cache) in an untimed first round. Prints one line a configuration; run it alone.

    python -m benchmarks.bench_attention [--dtypes bfloat16,int8,fp8_e4m3,int4_hadamard]
                                         [--contexts 1024,4096] [--batches 1,8] [--rounds 40] [--hot]
"""

import argparse
import statistics
import time

import numpy as np

from memory.kv_formats import KV_FORMATS, attend_as, write_kv_as

N_HEADS, N_KV, HEAD_DIM, BLOCK_SIZE = 32, 4, 64, 16  # TinyLlama; cluster_configs/engine_config.py's default
EVICT_BYTES = 256 << 20  # read between calls in the cold mode: several times the 32 MB L3 of the test box


class Layer:
    """One layer's cache holding `batch` sequences of `context` random keys and values, and their queries."""

    def __init__(self, kv_dtype: str, batch: int, context: int, rng):
        self.fmt = fmt = KV_FORMATS[kv_dtype]
        blocks = -(-context // BLOCK_SIZE)
        shape = (batch * blocks, BLOCK_SIZE, N_KV)
        self.k_cache, self.v_cache = (np.zeros((*shape, fmt.row_elements(HEAD_DIM)), fmt.storage)
                                      for _ in range(2))
        self.k_scale, self.v_scale = np.ones(shape, np.float32), np.ones(shape, np.float32)
        self.tables = np.arange(batch * blocks, dtype=np.int32).reshape(batch, blocks)
        slots = (self.tables[:, :, None] * BLOCK_SIZE + np.arange(BLOCK_SIZE)).reshape(batch, -1)[:, :context]
        k, v = (rng.standard_normal((batch * context, N_KV, HEAD_DIM)).astype(np.float32) for _ in range(2))
        write_kv_as(fmt, k, v, slots.reshape(-1).astype(np.int64), self.k_cache, self.v_cache, self.k_scale,
                    self.v_scale)
        self.q = rng.standard_normal((batch, N_HEADS, HEAD_DIM)).astype(np.float32)
        self.token_seq = np.arange(batch, dtype=np.int32)
        self.positions = np.full(batch, context - 1, np.int32)
        self.out = np.empty_like(self.q)

    def __call__(self) -> float:
        start = time.perf_counter()
        attend_as(self.fmt, self.q, self.k_cache, self.v_cache, self.k_scale, self.v_scale, self.tables,
                  self.token_seq, self.positions, 0, 1.0 / np.sqrt(HEAD_DIM), self.out)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--dtypes", default="bfloat16,int8,fp8_e4m3,int4_hadamard")
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--rounds", type=int, default=40, help="timed calls of each configuration")
    parser.add_argument("--hot", action="store_true", help="no cache eviction between calls")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    layers = {(d, int(b), int(c)): Layer(d, int(b), int(c), rng) for d in args.dtypes.split(",")
              for b in args.batches.split(",") for c in args.contexts.split(",")}
    evict = np.ones(0 if args.hot else EVICT_BYTES // 8)
    times = {key: [] for key in layers}
    for r in range(args.rounds + 1):
        for key, layer in layers.items():
            evict.sum()
            seconds = layer()
            if r:
                times[key].append(seconds)
    mode = "hot" if args.hot else "cold"
    for (kv_dtype, batch, context), samples in times.items():
        ms = statistics.median(samples) * 1e3
        print(f"{kv_dtype:14s} batch {batch:2d} context {context:5d} {mode}: {ms:7.3f} ms a call, "
              f"{ms * 1e6 / (batch * context * N_KV):6.1f} ns per (position, kv head)", flush=True)


if __name__ == "__main__":
    main()
