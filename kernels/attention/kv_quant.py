"""KV-cache writes: float32 and bfloat16 rows as they are; int8, 8-bit float and 4-bit integer codes with one
float32 scale per (slot, kv head).

FP8 rows are scaled so their largest magnitude lands on the format's largest finite value: the rows' ranges
differ by orders of magnitude across heads and layers (keys after RoPE with outliers, small values), and a
per-row scale keeps every row clear of saturation and of the subnormal range for 4 bytes per row (1/16 byte
a value at head_dim 64). A fixed per-tensor scale (vLLM's, default 1.0) would need calibrating per model.
int4: symmetric codes -7..7 (scale = max|x| / 7) stored with an offset of 8, two a byte, the even
coordinate in the low nibble; GAUSS4 (int4_hadamard's rows): indices into a 16-level Gaussian codebook, two a
byte, with a fitted scale (kernels/attention/gauss4.py).
"""

import numpy as np
from numba import njit, types
from numba.extending import overload

from kernels.attention.gauss4 import GAUSS4, gauss4_row
from kernels.formats.bf16 import f32_to_bf16
from kernels.formats.fp8 import fp8_encode, fp8_max


@njit(inline="always", nogil=True)
def row_scale(x, top):
    # x: [D] f32 -> (scale = max|x| / top, its reciprocal or 0 for an all-zero row): every KV row quantizer's
    amax = np.float32(0.0)
    for d in range(x.shape[0]):
        amax = max(amax, abs(x[d]))
    scale = amax / np.float32(top)
    inv = np.float32(1.0) / scale if scale > 0 else np.float32(0.0)
    return scale, inv


INT8, INT4, FP8 = 0, 1, 2  # write_kv_scaled's row codes, and GAUSS4 (3, kernels/attention/gauss4.py)


@njit(cache=True, nogil=True)
def write_kv_scaled(k, v, slot_mapping, k_cache, v_cache, k_scale, v_scale, codes, man_bits, bias, max_code):
    # k, v: [T, n_kv, D] f32 -> uint8 caches [num_blocks, block_size, n_kv, D] (INT8: the bytes of int8
    # codes; FP8: codes of fp8(man_bits, bias, max_code)) or [.., D // 2] (INT4, GAUSS4: nibbles); scales
    # [.., n_kv] f32; man_bits, bias and max_code are read for FP8 only (0 otherwise)
    block_size = k_cache.shape[1]
    top = np.float32(fp8_max(man_bits, bias, max_code)) if codes == FP8 else np.float32(0.0)
    for t in range(k.shape[0]):
        b = slot_mapping[t] // block_size
        o = slot_mapping[t] % block_size
        for h in range(k.shape[1]):
            k_scale[b, o, h] = _scaled_row(k[t, h], k_cache[b, o, h], codes, top, man_bits, bias, max_code)
            v_scale[b, o, h] = _scaled_row(v[t, h], v_cache[b, o, h], codes, top, man_bits, bias, max_code)


@njit(inline="always", nogil=True)
def _scaled_row(x, dst, codes, top, man_bits, bias, max_code):
    # one row's codes into dst -> its scale
    if codes == INT8:
        return _quantize_row(x, dst)
    if codes == INT4:
        return _int4_row(x, dst)
    if codes == GAUSS4:
        return gauss4_row(x, dst)
    return _fp8_row(x, dst, top, man_bits, bias, max_code)


@njit(inline="always", nogil=True)
def _fp8_row(x, dst, top, man_bits, bias, max_code):
    scale, inv = row_scale(x, top)
    for d in range(x.shape[0]):
        dst[d] = fp8_encode(x[d] * inv, man_bits, bias, max_code)
    return scale


@njit(inline="always", nogil=True)
def _int4_row(x, dst):
    scale, inv = row_scale(x, 7.0)
    for i in range(dst.shape[0]):
        lo = min(max(np.rint(x[2 * i] * inv), -7.0), 7.0) + 8.0
        hi = min(max(np.rint(x[2 * i + 1] * inv), -7.0), 7.0) + 8.0
        dst[i] = np.uint8(int(lo) | (int(hi) << 4))
    return scale


@njit(cache=True, nogil=True)
def write_kv(k, v, slot_mapping, k_cache, v_cache):
    # k, v: [T, n_kv, D] f32 -> caches [num_blocks, block_size, n_kv, D] (float32 or uint16 bf16 bits)
    block_size = k_cache.shape[1]
    for t in range(k.shape[0]):
        b = slot_mapping[t] // block_size
        o = slot_mapping[t] % block_size
        for h in range(k.shape[1]):
            for d in range(k.shape[2]):
                k_cache[b, o, h, d] = _store(k[t, h, d], k_cache[b, o, h, d])
                v_cache[b, o, h, d] = _store(v[t, h, d], v_cache[b, o, h, d])


def _store(value, like):
    raise NotImplementedError("numba-only")


@overload(_store, inline="always")
def _store_impl(value, like):
    if like == types.uint16:
        return lambda value, like: f32_to_bf16(value)
    return lambda value, like: value


# int8: symmetric per (token, kv head), x ~= q * scale, scale = max|x| / 127
@njit(inline="always", nogil=True)
def _quantize_row(x, dst):
    scale, inv = row_scale(x, 127.0)
    for d in range(x.shape[0]):
        dst[d] = np.uint8(np.int8(round(x[d] * inv)))  # the int8 code's byte
    return scale


@njit(cache=True, nogil=True)
def write_kv_shadows(k, v, slot_mapping, block_size, shadow_of, k_wide, v_wide):
    # k, v: [T, n_kv, D] f32 -> bfloat16 bits into the shadow of each slot's block, k_wide, v_wide
    # [num_shadows, block_size, n_kv, D] uint16 (kernels/attention/chunks.py's recent window); blocks without
    # one (shadow_of -1) skipped
    for t in range(k.shape[0]):
        s = shadow_of[slot_mapping[t] // block_size]
        if s < 0:
            continue
        o = slot_mapping[t] % block_size
        for h in range(k.shape[1]):
            for d in range(k.shape[2]):
                k_wide[s, o, h, d] = f32_to_bf16(k[t, h, d])
                v_wide[s, o, h, d] = f32_to_bf16(v[t, h, d])
