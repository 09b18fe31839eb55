"""Paged attention against a float64 softmax reference over the same (dequantized, rotated back) cache
contents, for every KV dtype through the layer's write / attend pair (memory/kv_formats.py)."""

import numpy as np
import pytest

from kernels.attention import paged as attention
from memory.kv_formats import KV_FORMATS, attend_as, write_kv_as
from tests.support.kv_reference import KV_DTYPES, empty_cache, head_dim_for, score_noise, stored

# stored against written keys, relative RMS over standard normal rows; measured 0.0016 (bfloat16), 0.0049 and
# 0.0054 (int8, rotated), 0.023 (e4m3), 0.047 (e5m2), 0.092 (int4), 0.076 (int4_hadamard's Gaussian codebook)
RELATIVE_RMS_ERROR = {"float32": 0.0, "bfloat16": 0.003, "int8": 0.01, "int8_hadamard": 0.01,
                      "fp8_e4m3": 0.03,
                      "fp8_e5m2": 0.06, "int4": 0.12, "int4_hadamard": 0.09}


def reference(q, keys, values, positions, window, scale, noises):
    # q: [T, H, D]; keys/values: per token, its sequence's [L, n_kv, D] float64; noises: per token, its
    # sequence's [L, n_kv] score_noise (each score less half its noise's variance)
    T, H, D = q.shape
    out = np.empty((T, H, D))
    for t in range(T):
        k, v = keys[t], values[t]
        group = H // k.shape[1]
        end = positions[t] + 1
        start = max(0, end - window) if window else 0
        for h in range(H):
            s = k[start:end, h // group] @ q[t, h] * scale
            s -= 0.5 * scale ** 2 * (q[t, h] @ q[t, h]) * noises[t][start:end, h // group]
            p = np.exp(s - s.max())
            out[t, h] = p @ v[start:end, h // group] / p.sum()
    return out


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("parallel", [True, False])
def test_paged_attention_matches_float64_softmax(kv_dtype, window, parallel, monkeypatch):
    monkeypatch.setattr(attention, "PARALLEL_MIN_WORK", 0 if parallel else 1 << 62)
    rng = np.random.default_rng(0)
    H, n_kv, D, block_size, num_blocks = 6, 2, head_dim_for(kv_dtype), 4, 40
    lengths = [1, 13, 37]  # three sequences; every token of each is a query (chunked-prefill shape)
    k_cache, v_cache, k_scale, v_scale = empty_cache(kv_dtype, num_blocks, block_size, n_kv, D)
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
    fmt = KV_FORMATS[kv_dtype]
    write_kv_as(fmt, k.copy(), v.copy(), slots, k_cache, v_cache, k_scale, v_scale)
    k_all, v_all = stored(kv_dtype, k_cache, k_scale, D), stored(kv_dtype, v_cache, v_scale, D)
    # the stored values are close to what was written (the reference below is over the stored ones)
    k_seen = k_all.reshape(num_blocks, block_size, n_kv, D)[slots // block_size, slots % block_size]
    assert np.sqrt(np.mean((k_seen - k) ** 2) / np.mean(k ** 2)) <= RELATIVE_RMS_ERROR[kv_dtype]
    seq_slots = [np.array([tables[s, p // block_size] * block_size + p % block_size for p in range(n)])
                 for s, n in enumerate(lengths)]
    keys = [k_all[seq_slots[s]] for s in token_seq]
    values = [v_all[seq_slots[s]] for s in token_seq]
    noise = score_noise(kv_dtype, k_scale, D)
    noises = [noise[seq_slots[s]] for s in token_seq]
    out = np.empty((T, H, D), np.float32)
    attend_as(fmt, q.copy(), k_cache, v_cache, k_scale, v_scale, tables, token_seq, positions, window, 0.2,
              out)
    ref = reference(q.astype(np.float64), keys, values, positions, window, 0.2, noises)
    assert np.abs(out - ref).max() < 1e-5 * np.abs(ref).max() + 1e-6
