"""The mixture-of-experts layer (models/moe/layer.py, kernels/moe/route.py): transformers' own MoE blocks, a
plain float64 reference over every weight format, reading only the routed experts, batch invariance, ranks
holding parts of the experts (expert parallelism) summing to the layer, and the fused path of VNNI-packed
experts (kernels/moe/fused.py) bit for bit against one linear call per (token, slot)."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from kernels.formats.bf16 import from_bf16, to_bf16
from kernels.formats.int8_layout import padded_k
from kernels.linear.chunking import linear_tiles
from kernels.moe import fused
from kernels.moe.route import group_by_expert
from kernels.norms import silu_mul
from kernels.simd.bf16 import BF16_FEATURES
from kernels.simd.cpu import missing_features
from kernels.simd.vnni import VNNI_FEATURES
from memory.experts import ExpertWeights
from memory.matrices import Bf16Matrix, Int8Matrix, WeightMatrix, row_block
from models.linear import dequantize, linear
from models.moe.buffers import MoeBuffers, _allocate
from models.moe.layer import ExpertLog, moe_forward, route

HIDDEN, INTER = 64, 32  # whole q8_0 / q4_0 blocks, and whole 4-row packed blocks per expert
# (weight dtype, packing): None = WeightMatrix with float32 activations, "int8" / "vnni" = Int8Matrix for
# int8 activations (AVX2 / VNNI kernel), "bf16" = Bf16Matrix for bf16 activations
FORMATS = ([("float32", None), ("bfloat16", None), ("q8_0", None), ("q4_0", None), ("q8_0", "int8"),
            ("q4_0", "int8")]
           + ([("q8_0", "vnni"), ("q4_0", "vnni")] if not missing_features(VNNI_FEATURES) else [])
           + ([("bfloat16", "bf16")] if not missing_features(BF16_FEATURES) else []))
# max |out - reference| / max |reference|, the reference float64 on the dequantized weights. With activations
# rounded as the kernels round them (ROUNDING): float32 rounding only, for every format. Against
# the unrounded reference, int8 activations: x and SiLU(gate) * up are each rounded per block of 32 to steps
# of max|block| / 127 (up to 1/254 of the block's largest value; SiLU(gate) * up is heavy-tailed, so its
# steps are coarse for typical values); 45 random cases measured 1.2% median, 2.1% max: bound 4%. bf16
# activations: each rounded to 8 significant bits (2^-9 relative): measured 0.3% median, 0.54% max: bound 1%.
TOLERANCE = {None: 1e-4, "int8": 4e-2, "vnni": 4e-2, "bf16": 1e-2}
ROUNDED_TOLERANCE = 1e-4


def float_experts(rng, E, dominant=None):
    """(router [E, H], gate_up [E, 2I, H], down [E, H, I]) float32; dominant: an expert every token's x
    (from inputs) prefers by far."""
    router = (rng.standard_normal((E, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)  # logits ~ N(0, 1)
    gate_up = (rng.standard_normal((E, 2 * INTER, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)
    down = (rng.standard_normal((E, HIDDEN, INTER)) / np.sqrt(INTER)).astype(np.float32)
    if dominant is not None:
        router[dominant] += 10 * _direction()
    return router, gate_up, down


def inputs(rng, T, dominant=None):
    x = rng.standard_normal((T, HIDDEN)).astype(np.float32)
    return x if dominant is None else x + 4 * _direction()


def _direction():
    return (np.ones(HIDDEN) / np.sqrt(HIDDEN)).astype(np.float32)


def packed(experts: ExpertWeights, how: str | None) -> ExpertWeights:
    if how is None:
        return experts
    pack = Bf16Matrix.pack if how == "bf16" else lambda w: Int8Matrix.pack(w, vnni=how == "vnni")
    return experts.with_matrices(pack(experts.gate_up), pack(experts.down))


def reference(x, router, gate_up, down, top_k, normalize, rounded=lambda v: v):
    """float64, one (token, slot) at a time: (out [T, H], ids [T, k]); rounded(v): the experts' inputs as
    their linear layers see them."""
    x, router, gate_up, down = (a.astype(np.float64) for a in (x, router, gate_up, down))
    logits = x @ router.T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        w = probs[t, ids[t]]
        w = w / w.sum() if normalize else w
        for j, e in enumerate(ids[t]):
            g, u = np.split(gate_up[e] @ rounded(x[t]), 2)
            out[t] += w[j] * (down[e] @ rounded(g / (1 + np.exp(-g)) * u))
    return out, ids


def int8_rounded(v):
    # v: [K] -> its values after int8 quantization per block of 32 (kernels/formats/int8_layout.py), as
    # float64
    blocks = v.astype(np.float32).reshape(-1, 32)
    d = (np.abs(blocks).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    return (np.rint(blocks * inv).astype(np.float64) * d).reshape(-1)


def bf16_rounded(v):
    return from_bf16(to_bf16(v.astype(np.float32)[None]))[0].astype(np.float64)


ROUNDING = {None: lambda v: v, "int8": int8_rounded, "vnni": int8_rounded, "bf16": bf16_rounded}


def relative_error(got, ref):
    return np.abs(got - ref).max() / np.abs(ref).max()


# ---- (a) transformers' own blocks


def hf_block(kind: str, E: int, top_k: int, normalize: bool, seed: int):
    common = {"hidden_size": HIDDEN, "num_experts_per_tok": top_k, "experts_implementation": "eager"}
    if kind == "mixtral":
        block = MixtralSparseMoeBlock(MixtralConfig(intermediate_size=INTER, num_local_experts=E, **common))
    else:
        block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(moe_intermediate_size=INTER, num_experts=E,
                                                      norm_topk_prob=normalize, **common))
    router, gate_up, down = float_experts(np.random.default_rng(seed), E)
    with torch.no_grad():
        block.gate.weight.copy_(torch.from_numpy(router))
        block.experts.gate_up_proj.copy_(torch.from_numpy(gate_up))
        block.experts.down_proj.copy_(torch.from_numpy(down))
    return block.eval(), ExpertWeights.from_float(router, gate_up, down, "float32", top_k, normalize)


@pytest.mark.parametrize("kind, normalize", [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False)])
@pytest.mark.parametrize("E, top_k", [(8, 2), (64, 8)])
def test_block_equals_transformers(kind, normalize, E, top_k):
    block, experts = hf_block(kind, E, top_k, normalize, seed=E + top_k)
    x = inputs(np.random.default_rng(1), 37)
    with torch.no_grad():
        want = block(torch.from_numpy(x)[None])[0].numpy()
        logits, want_weights, want_ids = block.gate(torch.from_numpy(x))
    ids, weights = route(logits.numpy(), top_k, normalize)
    assert np.array_equal(ids, want_ids.numpy())
    np.testing.assert_allclose(weights, want_weights.numpy(), rtol=1e-6, atol=1e-7)
    out, ids = moe_forward(x, experts, linear)
    assert np.array_equal(ids, want_ids.numpy())
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_equal_probabilities_go_to_the_lower_expert_id():
    # torch.topk leaves the order of equal values unspecified (not by id on CPU): our documented rule
    logits = np.array([[0, 1, 0, 1, 1, 0], [2, 2, 2, 2, 2, 2]], np.float32)
    ids, weights = route(logits, 4, normalize=False)
    assert ids.tolist() == [[1, 3, 4, 0], [0, 1, 2, 3]]
    assert np.all(weights[1] == weights[1, 0])


# ---- (b) a float64 reference in every format


# (E, top_k, T, dominant: the expert every token ranks first, or None). Experts with no rows in all but
# 4-1-37, 4-2-37 and 64-8-37; with dominant and top_k 1, all rows go to one expert.
CASES = [
    (4, 1, 1, None), (4, 1, 37, None), (4, 1, 37, 2), (4, 2, 37, None),
    (64, 1, 1, None), (64, 1, 37, None), (64, 8, 1, None), (64, 8, 37, None), (64, 8, 37, 5),
]


@pytest.mark.parametrize("dtype, how", FORMATS)
@pytest.mark.parametrize("E, top_k, T, dominant", CASES)
def test_experts_equal_the_float64_reference(dtype, how, E, top_k, T, dominant):
    rng = np.random.default_rng(E * 100 + top_k * 10 + T)
    normalize = E == 64  # both settings across the cases
    router, gate_up, down = float_experts(rng, E, dominant)
    experts = packed(ExpertWeights.from_float(router, gate_up, down, dtype, top_k, normalize), how)
    x = inputs(rng, T, dominant)
    out, ids = moe_forward(x, experts, linear)
    # the reference on the weights as served: dequantized
    served = (x, router, dequantize(experts.gate_up).reshape(gate_up.shape),
              dequantize(experts.down).reshape(down.shape), top_k, normalize)
    ref, ref_ids = reference(*served)
    assert np.array_equal(ids, ref_ids)
    if dominant is not None:
        assert np.all(ids[:, 0] == dominant)
    assert relative_error(out, ref) <= TOLERANCE[how]
    assert relative_error(out, reference(*served, ROUNDING[how])[0]) <= ROUNDED_TOLERANCE


@pytest.mark.parametrize("dtype, how", FORMATS)
def test_expert_views_are_the_stacked_rows(dtype, how):
    router, gate_up, down = float_experts(np.random.default_rng(0), 4)
    experts = packed(ExpertWeights.from_float(router, gate_up, down, dtype, 2, True), how)
    whole_gate_up, whole_down = dequantize(experts.gate_up), dequantize(experts.down)
    for e in range(4):
        gu, dn = experts.expert(e)
        assert np.shares_memory(gu.data, experts.gate_up.data)
        assert np.shares_memory(dn.data, experts.down.data)
        assert np.array_equal(dequantize(gu), whole_gate_up[e * 2 * INTER:(e + 1) * 2 * INTER])
        assert np.array_equal(dequantize(dn), whole_down[e * HIDDEN:(e + 1) * HIDDEN])


def held_part(experts: ExpertWeights, lo: int, hi: int) -> ExpertWeights:
    """Experts lo..hi - 1 of a layer as expert parallelism gives them to a rank: their rows alone, the router
    whole."""
    I, H = experts.intermediate_size, experts.router.shape[1]
    return ExpertWeights(experts.router, row_block(experts.gate_up, lo * 2 * I, hi * 2 * I),
                         row_block(experts.down, lo * H, hi * H), experts.num_experts, experts.top_k,
                         experts.normalize, I, first_expert=lo)


@pytest.mark.parametrize("dtype, how", FORMATS)
@pytest.mark.parametrize("E, top_k, T, dominant", [(8, 2, 5, None), (64, 8, 37, None), (4, 1, 9, 2)])
def test_ranks_holding_parts_of_the_experts_sum_to_the_layer(dtype, how, E, top_k, T, dominant):
    # expert parallelism: a rank runs only its experts' pairs, the others add zero. Over a split in two and
    # an uneven one in three, every part routes as the layer, the parts sum to the layer's output (float32
    # rounding: the slots add in another order), a token all of whose experts one part holds gets the
    # layer's bits from it, and a part no token chose (the dominant expert's case) gives zeros
    rng = np.random.default_rng(E + T)
    router, gate_up, down = float_experts(rng, E, dominant)
    experts = packed(ExpertWeights.from_float(router, gate_up, down, dtype, top_k, True), how)
    x = inputs(rng, T, dominant)
    whole, ids = moe_forward(x, experts, linear)
    whole = whole.copy()  # a view into the fused path's buffers
    for cuts in ([0, E // 2, E], [0, 1, E // 2 + 1, E]):
        total = np.zeros_like(whole)
        for lo, hi in itertools.pairwise(cuts):
            part = held_part(experts, lo, hi)
            assert part.held == (lo, hi)
            out, part_ids = moe_forward(x, part, linear)
            assert np.array_equal(part_ids, ids)
            inside = ((ids >= lo) & (ids < hi)).all(axis=1)
            assert out[inside].tobytes() == whole[inside].tobytes()
            assert not out[~((ids >= lo) & (ids < hi)).any(axis=1)].any()
            total += out
        np.testing.assert_allclose(total, whole, rtol=0, atol=1e-5 * np.abs(whole).max())
    if dominant is not None:
        assert not moe_forward(x, held_part(experts, 0, dominant), linear)[0].any()


def _tagging_projection(xq, xd, xsum, data, scales, out, bits, experts, starts):
    # matmul_vnni_experts' contract with each expert's product replaced by a tag: row r of active expert s
    # (pairs starts[s]:starts[s + 1]) gets the expert's tag (the first byte of its rows of data) plus a
    # trace of its input row's scale
    N = out.shape[1]
    for s in range(experts.shape[0]):
        for r in range(starts[s], starts[s + 1]):
            out[r, :] = data[experts[s] * N, 0] + 1e-3 * xd[r, 0]


@pytest.mark.parametrize("E, top_k, T, cuts", [(8, 2, 5, [0, 4, 8]), (64, 8, 37, [0, 1, 33, 64]),
                                               (4, 1, 9, [0, 3, 4])])
def test_the_fused_paths_pairs_reach_the_experts_a_rank_holds(monkeypatch, E, top_k, T, cuts):
    # kernels/moe/fused.moe_vnni's bookkeeping, on any CPU: its Python body with both projections replaced
    # by _tagging_projection. Over the held experts [first, end) of each part, every held pair's output
    # row carries its expert's tag (so rows reached the expert the router chose, by its place in the held
    # stack), every other pair's row is zero, and the parts' outputs sum to the whole layer's
    monkeypatch.setattr(fused, "matmul_vnni_experts", _tagging_projection)
    rng = np.random.default_rng(E + T)
    x = inputs(rng, T)
    router = float_experts(rng, E)[0]

    def run(first, end):
        gate_up = np.zeros(((end - first) * 2 * INTER, HIDDEN), np.int8)
        down = np.zeros(((end - first) * HIDDEN, INTER), np.int8)
        gate_up[::2 * INTER, 0] = down[::HIDDEN, 0] = np.arange(first, end)  # each held expert's tag
        a = _allocate(T, E, top_k, INTER, HIDDEN, padded_k(HIDDEN), padded_k(INTER))
        scales = np.zeros((1, 1), np.uint16)
        fused.moe_vnni.py_func(x, router, True, top_k, first, end, gate_up, scales, 0.0, 8, down, scales, 0.0,
                               8, linear_tiles().x_chunk_bytes, *a)
        return a

    whole = run(0, E)
    total = np.zeros((T, HIDDEN), np.float32)
    for first, end in itertools.pairwise(cuts):
        a = run(first, end)
        assert np.array_equal(a.ids, whole.ids)
        pair_expert = a.ids.ravel()[a.slots]  # [R] grouped order: each pair's expert
        held = (pair_expert >= first) & (pair_expert < end)
        assert np.array_equal(np.floor(a.y[held, 0]), pair_expert[held])
        assert not a.y[~held].any()
        total += a.out
    np.testing.assert_allclose(total, whole.out, rtol=1e-6)


def test_row_block_refuses_to_split_interleaved_rows():
    w = WeightMatrix.from_float(np.ones((10, 64), np.float32), "q8_0")
    assert row_block(Int8Matrix.pack(w, vnni=False), 1, 3).shape == (2, 64)  # AVX2 layout: any rows
    with pytest.raises(ValueError, match="split"):
        row_block(Int8Matrix.pack(w, vnni=True), 2, 6)
    assert row_block(Int8Matrix.pack(w, vnni=True), 8, 10).data.shape[0] == 4  # the last, padded block
    with pytest.raises(ValueError, match="split"):
        ExpertWeights.from_float(np.ones((2, 64), np.float32), np.ones((2, 6, 64), np.float32),
                                 np.ones((2, 64, 3), np.float32), "bfloat16", 1, True).with_matrices(
            Bf16Matrix.pack(WeightMatrix.from_float(np.ones((12, 64), np.float32), "bfloat16")),
            Bf16Matrix.pack(WeightMatrix.from_float(np.ones((128, 3), np.float32), "bfloat16")))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 9), st.integers(0, 20), st.data())
def test_grouping_is_a_stable_partition_of_the_slots(E, T, data):
    k = data.draw(st.integers(1, E))
    ids = np.array(data.draw(st.lists(st.lists(st.integers(0, E - 1), min_size=k, max_size=k),
                                      min_size=T, max_size=T)), np.int32).reshape(T, k)
    offsets, slots, position = np.empty(E + 1, np.int64), np.empty(T * k, np.int64), np.empty(T * k, np.int64)
    group_by_expert(ids, offsets, slots, position)
    assert offsets[0] == 0 and offsets[-1] == T * k and np.all(np.diff(offsets) >= 0)
    assert sorted(slots.tolist()) == list(range(T * k))
    assert np.array_equal(slots[position], np.arange(T * k))
    for e in range(E):
        mine = slots[offsets[e]:offsets[e + 1]]
        assert np.all(ids.reshape(-1)[mine] == e) and np.all(np.diff(mine) > 0)


# ---- (c) only the routed experts are read


def poisoned(w: WeightMatrix, rows: list[range]) -> WeightMatrix:
    """w with the given rows' values NaN (float32, bf16 bits) or their fp16 scales NaN (q8_0)."""
    data, scales = w.data.copy(), None if w.scales is None else w.scales.copy()
    for r in rows:
        if w.dtype == "float32":
            data[r] = np.nan
        elif w.dtype == "bfloat16":
            data[r] = 0x7FC0
        else:
            scales[r] = 0x7E00
    return WeightMatrix(w.dtype, data, scales)


@pytest.mark.parametrize("dtype, how", [f for f in FORMATS if f[0] != "q4_0"])
def test_a_step_reads_only_its_routed_experts(dtype, how):
    E, top_k = 16, 2
    rng = np.random.default_rng(7)
    router, gate_up, down = float_experts(rng, E)
    clean = ExpertWeights.from_float(router, gate_up, down, dtype, top_k, True)
    x = inputs(rng, 5)
    out, ids = moe_forward(x, packed(clean, how), linear)
    unrouted = sorted(set(range(E)) - set(ids.ravel().tolist()))
    assert unrouted
    dirty = clean.with_matrices(
        poisoned(clean.gate_up, [range(e * 2 * INTER, (e + 1) * 2 * INTER) for e in unrouted]),
        poisoned(clean.down, [range(e * HIDDEN, (e + 1) * HIDDEN) for e in unrouted]))
    dirty_out, dirty_ids = moe_forward(x, packed(dirty, how), linear)
    assert np.all(np.isfinite(dirty_out))
    assert np.array_equal(dirty_ids, ids) and np.array_equal(dirty_out, out)


def test_each_routed_expert_runs_once_over_its_rows():
    E, top_k = 16, 2
    rng = np.random.default_rng(3)
    experts = ExpertWeights.from_float(*float_experts(rng, E), "q8_0", top_k, True)
    calls = []

    def recording(x, w):
        calls.append((w, x.shape[0]))
        return linear(x, w)

    _, ids = moe_forward(inputs(rng, 9), experts, recording)
    routed = np.unique(ids)
    expected = []
    for e in routed:
        for w in experts.expert(e):  # the views are built once: identity names the expert
            expected.append((id(w), int(np.sum(ids == e))))
    assert sorted((id(w), n) for w, n in calls) == sorted(expected)


# ---- (d) batch invariance


@pytest.mark.parametrize("dtype, how", [("float32", None), ("q8_0", None), ("q8_0", "int8")]
                         + [f for f in FORMATS if f == ("q8_0", "vnni")])
def test_a_tokens_output_does_not_depend_on_its_batch(dtype, how):
    E, top_k = 64, 8
    rng = np.random.default_rng(11)
    experts = packed(ExpertWeights.from_float(*float_experts(rng, E), dtype, top_k, True), how)
    x = inputs(rng, 37)
    batch, batch_ids = moe_forward(x, experts, linear)
    for t in (0, 5, 36):
        alone, ids = moe_forward(x[t:t + 1], experts, linear)
        assert np.array_equal(ids[0], batch_ids[t])
        assert np.array_equal(alone[0], batch[t])
    part, _ = moe_forward(x[3:20], experts, linear)  # 17 tokens: the parallel weighted sum
    assert np.array_equal(part, batch[3:20])


# ---- (e) the fused path of VNNI-packed experts (kernels/moe/fused.py)


def one_linear_per_pair(x, experts):
    """The reference for the fused path: the router through models.linear.linear, then every (token, slot)
    through its expert's own linear calls on its views, summed in slot order."""
    k = experts.top_k
    ids, weights = route(linear(x, WeightMatrix("float32", experts.router)), k, experts.normalize)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(k):
            gate_up, down = experts.expert(ids[t, j])
            act = np.empty((1, experts.intermediate_size), np.float32)
            silu_mul(linear(x[t:t + 1], gate_up), act)
            out[t] += weights[t, j] * linear(act, down)[0]
    return out, ids


def vnni_experts(rng, E, top_k, dtypes=("q8_0", "q8_0"), static=(0.0, 0.0), dominant=None):
    router, gate_up, down = float_experts(rng, E, dominant)
    experts = ExpertWeights.from_float(router, gate_up, down, "float32", top_k, True)
    matrices = (experts.gate_up, experts.down)
    return experts.with_matrices(*(Int8Matrix.pack(WeightMatrix.from_float(w.data, dtype), scale, vnni=True)
                                   for w, dtype, scale in zip(matrices, dtypes, static)))


# (E, top_k, T, dominant): one token; a few; 17 tokens (the parallel quantize, SiLU and sum from 16 rows or
# tokens); 4 experts shared by 9 tokens; every token's first slot on expert 5; top 1 of a dominant
# expert: every token on one expert and the other experts idle
ROUTINGS = [(64, 8, 1, None), (64, 8, 3, None), (64, 8, 17, None), (4, 2, 9, None), (16, 4, 8, 5),
            (8, 1, 6, 3)]


@pytest.mark.parametrize("dtypes, static", [(("q8_0", "q8_0"), (0.0, 0.0)), (("q4_0", "q4_0"), (0.0, 0.0)),
                                            (("q4_0", "q8_0"), (0.0, 0.0)), (("q8_0", "q8_0"), (0.05, 0.02))])
@pytest.mark.parametrize("E, top_k, T, dominant", ROUTINGS)
def test_the_fused_path_equals_one_linear_per_pair(dtypes, static, E, top_k, T, dominant):
    # the same bits as each (token, slot) through its expert's linear calls, in every weight format, with
    # dynamic and calibrated (static) activation scales
    if missing_features(VNNI_FEATURES):
        pytest.skip("no AVX512-VNNI here")
    rng = np.random.default_rng(E + 10 * top_k + 100 * T)
    experts = vnni_experts(rng, E, top_k, dtypes, static, dominant)
    x = inputs(rng, T, dominant)
    out, ids = moe_forward(x, experts, linear)
    want, want_ids = one_linear_per_pair(x, experts)
    assert np.array_equal(ids, want_ids)
    if dominant is not None:
        assert np.all(ids[:, 0] == dominant)
    assert np.array_equal(out, want)


def test_buffers_kept_between_steps_give_the_same_bits():
    # one MoeBuffers through the layers of steps that grow, shrink and change shape: each result equals a
    # fresh call's, and the ids a layer's ExpertLog keeps survive the next layers' steps
    if missing_features(VNNI_FEATURES):
        pytest.skip("no AVX512-VNNI here")
    rng = np.random.default_rng(21)
    layers = [vnni_experts(rng, 16, 4), vnni_experts(rng, 16, 4), vnni_experts(rng, 8, 2)]
    buffers, log, last = MoeBuffers(), ExpertLog(3, 16), {}
    for T, layer_ids in [(1, (0, 1)), (5, (0, 1)), (2, (0, 1)), (20, (2,)), (3, (0, 1))]:
        for i in layer_ids:
            x = inputs(rng, T)
            out, ids = moe_forward(x, layers[i], linear, buffers)
            log.record(i, ids)
            want, last[i] = moe_forward(x, layers[i], linear)
            assert np.array_equal(out, want) and np.array_equal(ids, last[i])
    for i, ids in last.items():
        assert np.array_equal(log.last[i], ids)


@pytest.mark.parametrize("T", [1, 5])
def test_the_fused_path_reads_only_its_routed_experts(T):
    # the routed experts' bytes alone decide the result: the others' scales NaN change nothing
    if missing_features(VNNI_FEATURES):
        pytest.skip("no AVX512-VNNI here")
    E, top_k = 16, 2
    rng = np.random.default_rng(8 + T)
    router, gate_up, down = float_experts(rng, E)
    clean = ExpertWeights.from_float(router, gate_up, down, "q8_0", top_k, True)
    x = inputs(rng, T)
    out, ids = moe_forward(x, packed(clean, "vnni"), linear)
    unrouted = sorted(set(range(E)) - set(ids.ravel().tolist()))
    dirty = clean.with_matrices(
        poisoned(clean.gate_up, [range(e * 2 * INTER, (e + 1) * 2 * INTER) for e in unrouted]),
        poisoned(clean.down, [range(e * HIDDEN, (e + 1) * HIDDEN) for e in unrouted]))
    dirty_out, dirty_ids = moe_forward(x, packed(dirty, "vnni"), linear)
    assert np.array_equal(dirty_ids, ids) and np.array_equal(dirty_out, out)
    # and the poison is read when routed (NaN down scales: the int8 quantization of act would turn a NaN
    # gate_up into zeros)
    everywhere = clean.with_matrices(clean.gate_up, poisoned(clean.down, [range(E * HIDDEN)]))
    assert np.all(np.isnan(moe_forward(x, packed(everywhere, "vnni"), linear)[0]))
