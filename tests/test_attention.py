"""Paged attention against a float64 softmax reference over the same (dequantized) cache contents."""

import numpy as np
import pytest

from kernels import attention
from kernels.attention import paged_attention, write_kv, write_kv_int8
from kernels.bf16 import from_bf16


def reference(q, keys, values, positions, window, scale):
    # q: [T, H, D]; keys/values: per token, its sequence's [L, n_kv, D] float64
    T, H, D = q.shape
    out = np.empty((T, H, D))
    for t in range(T):
        k, v = keys[t], values[t]
        group = H // k.shape[1]
        end = positions[t] + 1
        start = max(0, end - window) if window else 0
        for h in range(H):
            s = k[start:end, h // group] @ q[t, h] * scale
            p = np.exp(s - s.max())
            out[t, h] = p @ v[start:end, h // group] / p.sum()
    return out


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("parallel", [True, False])
def test_paged_attention_matches_float64_softmax(kv_dtype, window, parallel, monkeypatch):
    monkeypatch.setattr(attention, "PARALLEL_MIN_WORK", 0 if parallel else 1 << 62)
    rng = np.random.default_rng(0)
    H, n_kv, D, block_size, num_blocks = 6, 2, 24, 4, 40
    lengths = [1, 13, 37]  # three sequences; every token of each is a query (chunked-prefill shape)
    cache_shape = (num_blocks, block_size, n_kv, D)
    dtype = {"float32": np.float32, "bfloat16": np.uint16, "int8": np.int8}[kv_dtype]
    k_cache, v_cache = np.zeros(cache_shape, dtype), np.zeros(cache_shape, dtype)
    k_scale, v_scale = np.ones(cache_shape[:3], np.float32), np.ones(cache_shape[:3], np.float32)
    free = list(rng.permutation(num_blocks))  # scattered, out-of-order blocks
    tables = np.full((len(lengths), 16), -1, np.int32)
    token_seq, positions, slots = [], [], []
    for s, n in enumerate(lengths):
        for b in range((n + block_size - 1) // block_size):
            tables[s, b] = free.pop()
        for p in range(n):
            token_seq.append(s)
            positions.append(p)
            slots.append(tables[s, p // block_size] * block_size + p % block_size)
    T = len(positions)
    token_seq, positions, slots = (np.array(a, np.int32) for a in (token_seq, positions, slots))
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    k = rng.standard_normal((T, n_kv, D)).astype(np.float32)
    v = rng.standard_normal((T, n_kv, D)).astype(np.float32)
    if kv_dtype == "int8":
        write_kv_int8(k, v, slots, k_cache, v_cache, k_scale, v_scale)
    else:
        write_kv(k, v, slots, k_cache, v_cache)

    def stored(cache, scales):  # what the cache holds, as float64 [num_blocks * block_size, n_kv, D]
        values = from_bf16(cache) if kv_dtype == "bfloat16" else cache.astype(np.float64)
        return (values * scales[..., None]).reshape(-1, n_kv, D).astype(np.float64)

    k_all, v_all = stored(k_cache, k_scale), stored(v_cache, v_scale)
    seq_slots = [np.array([tables[s, p // block_size] * block_size + p % block_size for p in range(n)])
                 for s, n in enumerate(lengths)]
    keys = [k_all[seq_slots[s]] for s in token_seq]
    values = [v_all[seq_slots[s]] for s in token_seq]
    out = np.empty((T, H, D), np.float32)
    paged_attention(q, k_cache, v_cache, k_scale, v_scale, kv_dtype == "int8", tables, token_seq, positions,
                    window, 0.2, out)
    ref = reference(q.astype(np.float64), keys, values, positions, window, 0.2)
    assert np.abs(out - ref).max() < 1e-5 * np.abs(ref).max() + 1e-6
