"""KV formats: fp8 codes against torch's float8 casts, the Hadamard rotation, int4 packing, per-layer dtypes
and their bytes (the pool's block count), and the config's checks."""

import numpy as np
import pydantic
import pytest
import torch
from numba import njit

from cluster_configs.engine_config import EngineConfig
from kernels.attention.gauss4 import FIT_GRID, GAUSS4, GAUSS4_LEVELS
from kernels.attention.hadamard import hadamard_inplace
from kernels.attention.kv_quant import INT4, write_kv_scaled
from kernels.attention.score_noise import row_kappa
from kernels.formats.fp8 import E4M3, E5M2, fp8_decode, fp8_encode
from memory.kv_cache import KVCache, kv_bytes_per_token
from memory.kv_formats import KV_FORMATS
from tests.support.kv_reference import TORCH_FP8, sylvester

FORMATS = {"fp8_e4m3": E4M3, "fp8_e5m2": E5M2}


@njit(cache=True)
def _encode_all(x, man_bits, bias, max_code):
    out = np.empty(x.shape[0], np.uint8)
    for i in range(x.shape[0]):
        out[i] = fp8_encode(x[i], man_bits, bias, max_code)
    return out


@njit(cache=True)
def _decode_all(codes, man_bits):
    out = np.empty(codes.shape[0], np.float32)
    for i in range(codes.shape[0]):
        out[i] = fp8_decode(codes[i], man_bits)
    return out


def _torch_values(kv_dtype: str) -> np.ndarray:
    """float32 [256]: torch's value of every code (NaN and inf where the format has them)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return codes.view(TORCH_FP8[kv_dtype]).to(torch.float32).numpy()


def _finite_values(kv_dtype: str) -> np.ndarray:
    values = _torch_values(kv_dtype)
    return np.unique(values[np.isfinite(values)].astype(np.float64))


@pytest.mark.parametrize("kv_dtype", list(FORMATS))
def test_fp8_decoding_is_torchs_for_every_finite_code(kv_dtype):
    expected = _torch_values(kv_dtype)
    finite = np.flatnonzero(np.isfinite(expected))  # the others are never written
    assert len(finite) == {"fp8_e4m3": 254, "fp8_e5m2": 248}[kv_dtype]
    ours = _decode_all(finite.astype(np.uint8), FORMATS[kv_dtype][0])
    np.testing.assert_array_equal(ours, expected[finite])
    assert np.array_equal(np.signbit(ours), np.signbit(expected[finite]))  # -0 too


@pytest.mark.parametrize("kv_dtype", list(FORMATS))
def test_fp8_encoding_rounds_to_nearest_even_as_torch_does(kv_dtype):
    params = FORMATS[kv_dtype]
    values = _finite_values(kv_dtype)
    # ties (exact in float32: one more mantissa bit) and their float32 neighbours
    midpoints = ((values[1:] + values[:-1]) / 2).astype(np.float32)
    rng = np.random.default_rng(0)
    top = values.max()
    spread = rng.standard_normal(20000) * 2.0 ** rng.integers(-20, 8, 20000)  # subnormals to the top
    x = np.concatenate([values, midpoints, np.nextafter(midpoints, np.float32(0)),
                        np.nextafter(midpoints, np.float32(np.inf)), rng.uniform(-top, top, 20000), spread])
    x = x[(np.abs(x) <= top) & (x != 0)].astype(np.float32)  # torch's cast is NaN / inf past the top
    ours = _encode_all(x, *params)
    theirs = torch.from_numpy(x).to(TORCH_FP8[kv_dtype]).view(torch.uint8).numpy()
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("kv_dtype", list(FORMATS))
def test_fp8_encoding_of_signed_zeros_and_nans_is_torchs(kv_dtype):
    # a sweep of all 2^32 float32 bit patterns found these the only codes unlike torch's (-0.0 lost its sign,
    # NaN became an arbitrary code); every other pattern within the largest finite value matched
    nan_bits = np.array([0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0xFFC00000, 0xFF800001], np.uint32)
    x = np.concatenate([np.array([-0.0, 0.0], np.float32), nan_bits.view(np.float32)])
    theirs = torch.from_numpy(x).to(TORCH_FP8[kv_dtype]).view(torch.uint8).numpy()
    np.testing.assert_array_equal(_encode_all(x, *FORMATS[kv_dtype]), theirs)


def test_fp8_e4m3_encoding_past_the_top_is_torchs_saturation():
    x = np.array([449.0, 463.99, 464.0, 1e30, np.inf, -500.0, -np.inf], np.float32)
    theirs = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(_encode_all(x, *E4M3), theirs)


@pytest.mark.parametrize("kv_dtype", list(FORMATS))
def test_fp8_encoding_saturates_at_the_largest_finite_value(kv_dtype):
    params = FORMATS[kv_dtype]
    top = np.float32(_finite_values(kv_dtype).max())
    ours = _encode_all(np.array([top * 1.01, -top * 4, 3e38, -0.0, 0.0], np.float32), *params)
    np.testing.assert_array_equal(_decode_all(ours, params[0]), [top, -top, top, 0, 0])


def _write_rows(x: np.ndarray, codes: int) -> tuple[np.ndarray, np.ndarray]:
    # x [N, D] f32 as one kv head's rows of N slots -> (nibble codes [N, D], scales [N])
    N, D = x.shape
    cache, scales = np.zeros((N, 1, 1, D // 2), np.uint8), np.zeros((N, 1, 1), np.float32)
    rows = x[:, None, :].copy()
    write_kv_scaled(rows, rows.copy(), np.arange(N), cache, cache.copy(), scales, scales.copy(), codes,
                    0, 0, 0)
    nibbles = np.stack([cache[:, 0, 0] & 15, cache[:, 0, 0] >> 4], axis=-1).reshape(N, D)
    return nibbles, scales[:, 0, 0]


@pytest.mark.parametrize("head_dim", [32, 128])
def test_gaussian_int4_rows_are_the_best_fit_of_the_grid_then_least_squares(head_dim):
    rng = np.random.default_rng(head_dim)
    x = (rng.standard_normal((2000, head_dim)) * 2.0 ** rng.integers(-6, 6, (2000, 1))).astype(np.float32)
    codes, scales = _write_rows(x, GAUSS4)
    # the reference in float64: every fraction's nearest levels, the least-erring fraction, least squares
    levels, x64 = GAUSS4_LEVELS.astype(np.float64), x.astype(np.float64)
    midpoints = (levels[1:] + levels[:-1]) / 2
    steps = np.abs(x64).max(1, keepdims=True) * FIT_GRID.astype(np.float64) / levels[-1]  # [N, grid]
    candidates = np.searchsorted(midpoints, x64[:, None, :] / steps[..., None])  # [N, grid, D]
    errors = ((levels[candidates] * steps[..., None] - x64[:, None, :]) ** 2).sum(-1)
    best = candidates[np.arange(len(x)), errors.argmin(1)]
    assert np.mean(np.all(codes == best, axis=1)) > 0.999  # float32 rounding may tip a value at a midpoint
    fitted = levels[codes]
    np.testing.assert_allclose(scales, (fitted * x64).sum(1) / (fitted ** 2).sum(1), rtol=1e-5)
    stored_error = ((fitted * scales[:, None] - x64) ** 2).sum(1)
    assert np.all(stored_error <= errors.min(1) * (1 + 1e-4) + 1e-30)  # no worse than any fraction
    # and on these Gaussian rows, well below the uniform -7..7 grid's error at the same bytes
    uniform_codes, uniform_scales = _write_rows(x, INT4)
    uniform_error = (((uniform_codes - 8.0) * uniform_scales[:, None] - x64) ** 2).sum(1)
    assert np.mean(stored_error / uniform_error) < 0.75


@pytest.mark.parametrize("head_dim", [24, 32, 64, 128, 256])
@pytest.mark.parametrize("kv_dtype", ["int4", "int4_hadamard"])
def test_kappa_is_the_mean_squared_error_a_coordinate_over_the_squared_scale(kv_dtype, head_dim):
    # what the kernels' score correction assumes (kernels/attention/score_noise.py), on Gaussian rows
    fmt = KV_FORMATS[kv_dtype]
    if fmt.rotated and head_dim & (head_dim - 1):
        pytest.skip("rotated rows need a power of two")
    x = np.random.default_rng(head_dim).standard_normal((4000, head_dim)).astype(np.float32)
    codes, scales = _write_rows(x, fmt.row_code if fmt.codebook else INT4)
    values = GAUSS4_LEVELS[codes] if fmt.codebook else codes - np.float32(8.0)
    errors = ((values * scales[:, None] - x) ** 2).astype(np.float64).mean(1)
    kappa = row_kappa(fmt.row_elements(head_dim), fmt.row_code, head_dim)
    assert np.mean(errors / scales.astype(np.float64) ** 2) == pytest.approx(kappa, rel=0.04)
    for wide in ("int8", "fp8_e4m3", "fp8_e5m2", "bfloat16"):  # one code a value: no correction
        assert row_kappa(KV_FORMATS[wide].row_elements(head_dim), KV_FORMATS[wide].row_code, head_dim) == 0


def test_gaussian_int4_rows_of_zeros_and_of_one_value():
    x = np.zeros((3, 32), np.float32)
    x[1, 5] = -3.0  # one nonzero value: the codebook has no zero, so the others sit on its smallest levels
    x[2] = 0.5  # a constant row
    codes, scales = _write_rows(x, GAUSS4)
    values = GAUSS4_LEVELS[codes] * scales[:, None]
    assert scales[0] == 0 and np.all(values[0] == 0)
    assert abs(values[1, 5] + 3.0) < 0.3 and np.abs(np.delete(values[1], 5)).max() < 0.15
    np.testing.assert_allclose(values[2], 0.5, rtol=1e-6)


@pytest.mark.parametrize("head_dim", [1, 2, 32, 128])
def test_hadamard_rotation_is_sylvesters_and_its_own_inverse(head_dim):
    rng = np.random.default_rng(head_dim)
    x = rng.standard_normal((5, 3, head_dim)).astype(np.float32) * 10
    rotated = x.copy()
    hadamard_inplace(rotated)
    exact = x.astype(np.float64) @ sylvester(head_dim)
    assert np.abs(rotated - exact).max() <= 4e-7 * np.log2(2 * head_dim) * np.abs(x).max()
    hadamard_inplace(rotated)
    assert np.abs(rotated - x).max() <= 8e-7 * np.log2(2 * head_dim) * np.abs(x).max()


def test_hadamard_rotates_strided_views_in_place():
    rng = np.random.default_rng(1)
    qkv = rng.standard_normal((4, 3 * 2 * 8)).astype(np.float32)
    k = qkv[:, 16:32].reshape(4, 2, 8)  # a view, as the decoder's k is
    expected = qkv[:, 16:32].reshape(4, 2, 8).astype(np.float64) @ sylvester(8)
    untouched = qkv[:, :16].copy()
    hadamard_inplace(k)
    assert np.abs(qkv[:, 16:32].reshape(4, 2, 8) - expected).max() < 1e-5
    np.testing.assert_array_equal(qkv[:, :16], untouched)


def test_bytes_per_value_of_each_format():
    D = 64
    per_value = {name: f.row_bytes(D) / D for name, f in KV_FORMATS.items()}
    assert per_value == {"float32": 4, "bfloat16": 2, "int8": 1 + 4 / D, "int8_hadamard": 1 + 4 / D,
                         "fp8_e4m3": 1 + 4 / D, "fp8_e5m2": 1 + 4 / D, "int4": 0.5 + 4 / D,
                         "int4_hadamard": 0.5 + 4 / D}


def test_each_layer_holds_its_own_dtype_and_the_bytes_add_up():
    overrides = {0: "bfloat16", 2: "fp8_e4m3"}
    kv = KVCache(4, 3, 16, 2, 32, "int4_hadamard", overrides)
    assert kv.layer_dtypes == ["bfloat16", "int4_hadamard", "fp8_e4m3", "int4_hadamard"]
    assert [a.dtype for a in kv.k] == [np.uint16, np.uint8, np.uint8, np.uint8]
    assert [a.shape for a in kv.v] == [(3, 16, 2, 32), (3, 16, 2, 16), (3, 16, 2, 32), (3, 16, 2, 16)]
    row = {"bfloat16": 64, "int4_hadamard": 16 + 4, "fp8_e4m3": 32 + 4}  # bytes of one head's row
    assert kv.bytes_per_token == 2 * 2 * (row["bfloat16"] + 2 * row["int4_hadamard"] + row["fp8_e4m3"])
    assert kv.bytes_per_token == kv_bytes_per_token(4, 2, 32, "int4_hadamard", overrides)
    # the arrays hold exactly bytes_per_token a slot, beside the (1, 1, 1) scale stand-in of bfloat16
    assert kv.nbytes - 2 * 4 == kv.bytes_per_token * 3 * 16


def test_a_tree_path_moves_in_every_layers_format():
    kv = KVCache(2, 2, 4, 1, 8, "int4", {1: "float32"})
    rng = np.random.default_rng(0)
    for arrays in (kv.k, kv.v, kv.k_scale):
        for a in arrays:
            a[...] = rng.integers(0, 200, a.shape)
    before = [a.copy() for a in kv.arrays]
    kv.move_slots([1, 0], src=[6], dst=[1])  # slot 6 (block 0, offset 2) to slot 1 (block 1, offset 1)
    for a, b in zip(kv.arrays, before):
        if a.shape[0] > 1:  # the float32 layer's scales are a stand-in
            np.testing.assert_array_equal(a[1, 1], b[0, 2])


def test_overrides_outside_the_model_are_refused():
    with pytest.raises(ValueError, match=r"names layers \[4\], but the model has 4 layers"):
        KVCache(4, 1, 16, 2, 32, "bfloat16", {4: "int8"})
    with pytest.raises(pydantic.ValidationError, match="count from 0"):
        EngineConfig(kv_dtype_overrides={-1: "int8"})
    with pytest.raises(pydantic.ValidationError, match="kv_dtype_overrides"):
        EngineConfig(kv_dtype_overrides={0: "int3"})


def test_hadamard_forms_refuse_a_head_dim_that_is_not_a_power_of_two():
    with pytest.raises(ValueError, match='"int4_hadamard" rotates .* head_dim is 48.*use "int4"'):
        KVCache(2, 1, 16, 2, 48, "bfloat16", {1: "int4_hadamard"})
    KVCache(2, 1, 16, 2, 48, "int4")  # unrotated int4 takes any even head_dim
