"""The int8-activation layout: activations quantized per 32-value block, weights repacked to match.

Columns are taken in groups of 8 blocks (GROUP = 256 values; K is zero-padded to a whole number of
groups). Inside a group, value e of pair j of block b (original column 32 b + 2 j + e) moves to
position 16 j + 2 b + e, so one 16-value vector holds a pair from each of the 8 blocks and a
pairwise multiply-add (vpmaddwd) leaves block b's partial sum in int32 lane b: 16 of them give the
8 blocks' exact dot products without any shuffle (kernels/simd_int8.py).

  activations: xq int16 [T, Kp] (values -127..127), xd f32 [T, Kp // 32] block scales,
               xsum int32 [T, Kp // 32] block sums of xq (q4_0's offset of 8 is corrected with them)
  q8_0 weights: int8 [N, Kp] in the same order; q4_0 weights: uint8 [N, Kp // 2], per group 8 chunks
               of 16 bytes, chunk c holding vector 2c in its low nibbles and vector 2c + 1 in its high
               nibbles (the GGML nibble 0..15 = value + 8); scales: fp16 bits uint16 [N, Kp // 32].
Dynamic quantization (per block): d = max|x| / 127, q = rint(x * (1 / d)); static (calibrated,
per tensor): d = s, q = clip(rint(x * (1 / s)), -127, 127).
"""

import numpy as np
from numba import njit, prange

QK = 32
BLOCKS_PER_GROUP = 8
GROUP = QK * BLOCKS_PER_GROUP
PARALLEL_MIN_TOKENS = 16  # waking the thread pool costs more than quantizing a few rows


def padded_k(k: int) -> int:
    return -(-k // GROUP) * GROUP


@njit(inline="always", nogil=True)
def _packed_index(k):
    # original column k (within the padded row) -> its position in the packed row
    g, r = divmod(k, GROUP)
    b, within = divmod(r, QK)
    j, e = divmod(within, 2)
    return g * GROUP + j * 16 + b * 2 + e


@njit(inline="always", nogil=True)
def _quantize_row(x, t, xq, xd, xsum, inv_static, static_scale):
    # one token row, a group of 8 blocks at a time: quantize in column order (vectorizes), then move
    # the 256 values to the packed order
    K = x.shape[1]
    q = np.empty(GROUP, np.int16)
    for g in range(xq.shape[1] // GROUP):
        for b in range(BLOCKS_PER_GROUP):
            blk = g * BLOCKS_PER_GROUP + b
            c0 = blk * QK
            n = max(0, min(QK, K - c0))  # columns of this block inside the row (0 for padding)
            if static_scale > 0:
                d = np.float32(static_scale)
                inv = np.float32(inv_static)
            else:
                amax = np.float32(0.0)
                for k in range(n):
                    amax = max(amax, abs(x[t, c0 + k]))
                d = amax / np.float32(127.0)
                inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            total = 0
            for k in range(n):
                v = min(max(np.rint(x[t, c0 + k] * inv), np.float32(-127.0)), np.float32(127.0))
                q[b * QK + k] = np.int16(v)
                total += np.int32(v)
            for k in range(n, QK):
                q[b * QK + k] = 0
            xd[t, blk] = d
            xsum[t, blk] = total
        base = g * GROUP
        for j in range(16):
            for b in range(BLOCKS_PER_GROUP):
                xq[t, base + j * 16 + b * 2] = q[b * QK + 2 * j]
                xq[t, base + j * 16 + b * 2 + 1] = q[b * QK + 2 * j + 1]


@njit(cache=True, nogil=True)
def _quantize_serial(x, xq, xd, xsum, inv_static, static_scale):
    for t in range(x.shape[0]):
        _quantize_row(x, t, xq, xd, xsum, inv_static, static_scale)


@njit(cache=True, nogil=True, parallel=True)
def _quantize_parallel(x, xq, xd, xsum, inv_static, static_scale):
    for t in prange(x.shape[0]):
        _quantize_row(x, t, xq, xd, xsum, inv_static, static_scale)


def quantize_activations(x: np.ndarray, xq: np.ndarray, xd: np.ndarray, xsum: np.ndarray,
                         static_scale: float = 0.0) -> None:
    # x: [T, K] f32 -> xq: [T, Kp] int16, xd: [T, Kp // 32] f32, xsum: [T, Kp // 32] int32
    # static_scale > 0: every block uses that scale (calibrated); 0: per-block dynamic scales
    inv = np.float32(1.0) / np.float32(static_scale) if static_scale > 0 else np.float32(0.0)
    run = _quantize_parallel if x.shape[0] >= PARALLEL_MIN_TOKENS else _quantize_serial
    run(x, xq, xd, xsum, inv, np.float32(static_scale))


@njit(cache=True, nogil=True, parallel=True)
def pack_q8_0(qs, out):
    # qs: [N, K] int8 (GGML q8_0 values) -> out: [N, Kp] int8 in the packed order, zero-padded
    K = qs.shape[1]
    for n in prange(qs.shape[0]):
        for k in range(out.shape[1]):
            out[n, _packed_index(k)] = qs[n, k] if k < K else 0


@njit(cache=True, nogil=True, parallel=True)
def pack_q4_0(qs, out):
    # qs: [N, K // 2] uint8 (GGML nibbles: byte i of a block = element i | element i + 16 << 4)
    # -> out: [N, Kp // 2] uint8, per group chunk c = vector 2c (low nibbles) | vector 2c + 1 (high)
    K = qs.shape[1] * 2
    for n in prange(qs.shape[0]):
        for k in range(out.shape[1] * 2):
            nibble = np.int64(8)  # padding: value 0 (its block scale is 0 too)
            if k < K:
                blk, i = divmod(k, QK)
                byte = np.int64(qs[n, blk * 16 + i % 16])
                nibble = byte & 15 if i < 16 else byte >> 4
            p = _packed_index(k)
            g, r = divmod(p, GROUP)
            j, m = divmod(r, 16)  # vector j of the group, lane m
            dst = g * (GROUP // 2) + (j // 2) * 16 + m
            out[n, dst] |= nibble << (4 * (j % 2))


def pad_scales(scales: np.ndarray, kp: int) -> np.ndarray:
    # scales: [N, K // 32] uint16 -> [N, Kp // 32], padded blocks with scale 0
    out = np.zeros((scales.shape[0], kp // QK), np.uint16)
    out[:, :scales.shape[1]] = scales
    return out


@njit(cache=True, nogil=True, parallel=True)
def unpack_int8_weights(packed, is_q4, K, out):
    # the inverse of pack_q8_0 / pack_q4_0 as values: packed -> out: [N, K] int8 (q4_0: nibble - 8)
    for n in prange(packed.shape[0]):
        for k in range(K):
            p = _packed_index(k)
            if is_q4:
                g, r = divmod(p, GROUP)
                j, m = divmod(r, 16)
                byte = np.int64(packed[n, g * (GROUP // 2) + (j // 2) * 16 + m])
                out[n, k] = ((byte >> (4 * (j % 2))) & 15) - 8
            else:
                out[n, k] = packed[n, p]
