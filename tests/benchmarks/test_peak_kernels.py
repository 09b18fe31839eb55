"""The peak probes' loops run the instructions they are said to: each loop's result equals a numpy model of
that many rounds of its instruction over the same operands (small operands: every sum exact)."""

import numpy as np
import pytest

from benchmarks.peak_kernels import INSTRUCTIONS, OPERAND_BYTES, available, loop_functions


def bf16_bytes(values: np.ndarray) -> np.ndarray:
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


def operands(ins, rng) -> np.ndarray:
    """[2, 64] bytes: small values of the instruction's operand types."""
    if ins.name == "vpdpbusd":  # unsigned bytes . signed bytes
        return np.stack([rng.integers(0, 4, 64).astype(np.uint8),
                         rng.integers(-3, 4, 64).astype(np.int8).view(np.uint8)])
    if ins.name == "vpmaddwd":  # int16 pairs (the chain's int32 values pass through as int16 pairs)
        return rng.integers(-1, 2, (2, 32)).astype(np.int16).view(np.uint8)
    if ins.name == "vdpbf16ps":
        return np.stack([bf16_bytes(rng.integers(-3, 4, 32)) for _ in range(2)])
    return rng.integers(-3, 4, (2, 16)).astype(np.float32).view(np.uint8)


PRODUCTS_PER_LANE = {"vpdpbusd": 4, "vpmaddwd": 2, "vdpbf16ps": 2, "vfmadd": 1}


def model(ins, ops: np.ndarray, iterations: int, accs: int) -> np.ndarray:
    """The loop's result lanes, computed by numpy (int64 / float64, exact for these operands)."""
    n = ins.lanes
    a, b = (ops[i, : ins.bits // 8] for i in range(2))
    if ins.name == "vpdpbusd":
        dot = (a.astype(np.int64) * b.view(np.int8)).reshape(n, 4).sum(1)
    elif ins.name == "vdpbf16ps":
        fa, fb = ((x.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
                  for x in (a, b))
        dot = (fa * fb).reshape(n, 2).sum(1)
    elif ins.name == "vfmadd":
        dot = a.view(np.float32).astype(np.float64) * b.view(np.float32)
    else:
        total = np.zeros(n, np.int64)
        bb = b.view(np.int16).astype(np.int64).reshape(n, 2)
        for c in range(accs):
            acc = np.full(n, c, np.int32)
            for _ in range(iterations):
                acc = (acc.view(np.int16).astype(np.int64).reshape(n, 2) * bb).sum(1).astype(np.int32)
            total += acc
        return total
    return sum(c + iterations * dot for c in range(accs))


@pytest.mark.parametrize("ins", INSTRUCTIONS, ids=lambda i: i.label.replace(" ", "-"))
@pytest.mark.parametrize("accs", [1, 12])
def test_a_loop_equals_that_many_rounds_of_its_instruction(ins, accs):
    if ins not in available():
        pytest.skip(f"this CPU lacks {', '.join(ins.features)}")
    rng = np.random.default_rng(INSTRUCTIONS.index(ins))
    ops = operands(ins, rng)
    assert ops.shape == (2, OPERAND_BYTES)
    assert ins.macs == ins.lanes * PRODUCTS_PER_LANE[ins.name], "the multiply-adds the peak counts"
    one, every = loop_functions(ins, accs)
    for iterations in (0, 1, 3):
        out = np.zeros(OPERAND_BYTES, np.uint8)
        one(ops, out, iterations)
        lanes = out[: ins.bits // 8].view(np.float32 if ins.kind in ("bf16", "f32") else np.int32)
        np.testing.assert_array_equal(lanes, model(ins, ops, iterations, accs))
        outs = np.zeros((3, OPERAND_BYTES), np.uint8)
        every(ops, outs, iterations)
        assert (outs == out).all(), "every thread's loop gives the one-thread result"
