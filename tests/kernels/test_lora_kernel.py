"""The low-rank kernel (kernels/lora.py) against a float64 reference of the A and B it stores, per storage
dtype, and a row's delta bit for bit the same alone and in any batch."""

import numpy as np
import pytest

from kernels.formats.bf16 import from_bf16
from kernels.formats.quant import QK
from kernels.lora import lora_shrink_expand
from models.lora.adapter import LoraModule
from models.lora.slots import STORED, padded, store

K, WIDTHS, S, R = 96, (64, 32), 3, 8  # input width, two modules' output widths, slots, max rank
RANKS = np.array([[8, 3, 0], [5, 8, 2]], np.int32)  # [module, slot]: 0 = the slot's adapter skips the module


def stored_slots(dtype: str, seed: int = 0):
    """Per module: a [S, R, K], a_scales, bt [S, R, N], bt_scales (kernels/lora.py's layout) from random
    adapters, written the way LoraSlots writes them."""
    rng = np.random.default_rng(seed)
    a, a_scales, bt, bt_scales = [], [], [], []
    for m, n in enumerate(WIDTHS):
        a.append(np.zeros((S, R, K), STORED[dtype]))
        bt.append(np.zeros((S, R, n), STORED[dtype]))
        a_scales.append(np.zeros((S, R, K // QK) if dtype == "q8_0" else (S, 1, 1), np.uint16))
        bt_scales.append(np.zeros((S, R, n // QK) if dtype == "q8_0" else (S, 1, 1), np.uint16))
        for s in range(S):
            r = RANKS[m, s]
            lora = LoraModule(rng.standard_normal((r, K)).astype(np.float32),
                              rng.standard_normal((n, r)).astype(np.float32), 0.5)
            store(dtype, lora.a, a[m][s, :r], a_scales[m][s, :r])
            store(dtype, lora.b.T, bt[m][s, :r], bt_scales[m][s, :r])
    return tuple(a), tuple(a_scales), tuple(bt), tuple(bt_scales)


def as_float64(data: np.ndarray, scales: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return data.astype(np.float64)
    if dtype == "bfloat16":
        return from_bf16(data).astype(np.float64)
    return data.astype(np.float64) * np.repeat(scales.view(np.float16).astype(np.float64), QK, axis=-1)


def run(x, row_slots, stored) -> np.ndarray:
    """out [T, sum(WIDTHS)] = the kernel's delta for rows grouped by slot (row_slots [T], -1: no adapter)."""
    starts = np.flatnonzero(np.diff(row_slots, prepend=-2) != 0)
    ends = np.append(starts[1:], len(row_slots))
    keep = row_slots[starts] >= 0
    out = np.zeros((len(x), sum(WIDTHS)), np.float32)
    offsets = np.cumsum([0, *WIDTHS]).astype(np.int64)
    lora_shrink_expand(x, starts[keep].astype(np.int64), ends[keep].astype(np.int64),
                       row_slots[starts[keep]].astype(np.int32), *map(padded, stored), padded(list(RANKS)),
                       padded([np.full(S, 0.5, np.float32) for _ in WIDTHS]), offsets, out)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "q8_0"])
def test_the_low_rank_kernel_equals_float64_over_the_weights_it_stores(dtype):
    rng = np.random.default_rng(1)
    row_slots = np.array([0] * 9 + [-1] * 2 + [2] * 5 + [1] * 3, np.int32)  # runs of 9, 5 and 3 rows
    x = rng.standard_normal((len(row_slots), K)).astype(np.float32)
    stored = stored_slots(dtype)
    a, a_scales, bt, bt_scales = stored
    expected = np.zeros((len(x), sum(WIDTHS)))
    c0 = 0
    for m, n in enumerate(WIDTHS):
        for t, s in enumerate(row_slots):
            r = RANKS[m, s] if s >= 0 else 0
            if r:
                a64 = as_float64(a[m][s, :r], a_scales[m][s, :r], dtype)
                bt64 = as_float64(bt[m][s, :r], bt_scales[m][s, :r], dtype)
                expected[t, c0:c0 + n] = 0.5 * (x[t].astype(np.float64) @ a64.T) @ bt64
        c0 += n
    got = run(x, row_slots, stored)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    assert not got[9:11].any()  # rows without an adapter are left alone


@pytest.mark.parametrize("dtype", ["bfloat16", "q8_0"])
def test_rounded_slots_keep_the_delta_close_to_float32s(dtype):
    """What storing A and B rounded costs: the delta moves by about 2^-8 (bf16) / q8_0's step of its size."""
    rng = np.random.default_rng(2)
    row_slots = np.zeros(6, np.int32)
    x = rng.standard_normal((6, K)).astype(np.float32)
    exact, rounded = run(x, row_slots, stored_slots("float32")), run(x, row_slots, stored_slots(dtype))
    error = np.abs(rounded - exact).max() / np.abs(exact).max()
    assert 0 < error < (0.01 if dtype == "bfloat16" else 0.03), error


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "q8_0"])
def test_a_rows_delta_is_the_same_bits_alone_and_in_any_batch(dtype):
    rng = np.random.default_rng(3)
    stored = stored_slots(dtype)
    row_slots = np.array([1] * 7 + [0] * 6 + [2] * 2, np.int32)
    x = rng.standard_normal((len(row_slots), K)).astype(np.float32)
    batch = run(x, row_slots, stored)
    for t in range(len(x)):
        assert np.array_equal(run(x[t:t + 1], row_slots[t:t + 1], stored)[0], batch[t])
    assert np.array_equal(run(x[3:10], row_slots[3:10], stored), batch[3:10])
