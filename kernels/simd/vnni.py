"""A register block for int8 activations x q8_0 / q4_0 weights through AVX-512 VNNI, written as LLVM IR:
4 weight rows x TB tokens.

Both formats use the quad order (kernels/formats/int8_layout.py): per group of 8 blocks, vector j (32 bytes)
holds 4 consecutive values of each block, so one unsigned x signed byte dot product (vpdpbusd: 32 products
summed by fours into 8 int32 lanes, accumulated) adds block b's partial dot product to lane b. The weights are
the unsigned side: q4_0's nibbles are value + 8, and q8_0's bytes are stored as value + 128; the offset is
taken off once per group as -offset x (block sum of x), the accumulator's start. Sums stay exact in int32
(|lane| <= 32 x 255 x 127). Then, as in kernels/simd/int8.py, one convert and one fused multiply-add by
(weight scale x activation scale) per lane move a group into a float32 accumulator, in the same order: the
outputs are bit for bit those of the AVX2 kernels, with one instruction per 32 products instead of two to
three per 16.

Weights come in blocks of 4 rows interleaved by group (kernels/formats/int8_layout.py pack_q8_0_quads,
pack_q4_0): a task reads one sequential stream and prefetches PREFETCH_BYTES ahead in it into L2, so the
next blocks' bytes arrive while this one is multiplied, at every block size (1 token included). 4 rows x 4
tokens keep 16 int32 and 16 float32 accumulators in AVX-512's 32 vector registers. Rows past the matrix's
last (padding of the last block) are computed, not stored. (One pass per block over all of a task's tokens,
their float32 accumulators in a stack array, was slower from 2 tokens up.) matmul_vnni now takes its tokens
in pairs through the 512-bit form of this block (kernels/simd/vnni_wide.py, the same bits) and only a last odd
token through this one.

Needs AVX512-VNNI and AVX512-VL (the 256-bit vpdpbusd) and F16C. numba's on-disk cache of
kernels/linear/int8.py does not notice edits to this file: after changing the code generation here,
delete kernels/__pycache__ (a fresh install starts without a cache).
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.simd.int8 import (
    GROUP,
    I8,
    I32,
    V8F,
    V8I,
    V16I16,
    block_operands,
    const64,
    fma_function,
    fold_group,
    group_counts,
    load_vec,
    operands_fit,
    store_block,
)

V32I8 = ir.VectorType(I8, 32)
VNNI_FEATURES = ("avx512vnni", "avx512vl", "f16c")
ROWS = 4  # weight rows per block
# The prefetch: how far ahead in its stream a task asks for its weights, and into L2 (LLVM
# locality 2, prefetcht1), not L1. Into L1 the requests compete with the multiply's own loads; into
# L2 the stream keeps arriving at the memory's pace while the cores compute, so up to 8 tokens cost
# what 1 does: benchmarks/results/HISTORY.md
PREFETCH_BYTES = 32768
PREFETCH_LOCALITY = 2
# The fewest tokens of a block that prefetches. 1: on Zen 4 the Q4_K, Q6_K, q4_0 and bf16 1-token streams
# ran 1.2-1.9x faster with it in fast memory phases, q8_0's about level (benchmarks/results/HISTORY.md); an
# earlier layout's 1-token q8_0 stream was slower with it, and bench_stream still times the block without it.
# bf16's 1-token block has since read its rows one after another, a single stream it leaves to the hardware
# prefetcher (kernels/simd/bf16.py)
PREFETCH_MIN_TOKENS = 1


def dpbusd_function(module, bits: int = 256):
    """vpdpbusd on 256-bit (or 512-bit) vectors: acc + per int32 lane the sum of 4 products of unsigned bytes
    (the first operand) with signed bytes (the second), the byte operands typed <8 x i32> (<16 x i32>), the
    form every LLVM since VNNI's introduction accepts."""
    vec = ir.VectorType(I32, bits // 32)
    return cgutils.get_or_insert_function(module, ir.FunctionType(vec, [vec] * 3),
                                          f"llvm.x86.avx512.vpdpbusd.{bits}")


def dpbusd_avx2(builder, acc, weights, x):
    """vpdpbusd's result without VNNI: acc + per int32 lane the sum of its 4 products of unsigned weight bytes
    with signed activation bytes, through vpmaddubsw (pairs to int16) and vpmaddwd by ones (pairs of pairs to
    int32). Exact where a pair cannot saturate int16: 2 x q x 127 <= 32767, q <= 129 (the K-quants' 4 to 6
    bits; not kernels/simd/kquant.py's IQ4 levels + 128, up to 255)."""
    module = builder.module
    pmaddubsw = cgutils.get_or_insert_function(module, ir.FunctionType(V16I16, [V32I8, V32I8]),
                                               "llvm.x86.avx2.pmadd.ub.sw")
    pmaddwd = cgutils.get_or_insert_function(module, ir.FunctionType(V8I, [V16I16, V16I16]),
                                             "llvm.x86.avx2.pmadd.wd")
    pairs = builder.call(pmaddubsw, [builder.bitcast(weights, V32I8), builder.bitcast(x, V32I8)])
    return builder.add(acc, builder.call(pmaddwd, [pairs, ir.Constant(V16I16, [1] * 16)]))


def vnni_literals(operands, bits, count):
    """A VNNI block's typing check: (is_q4, count, the weights' offset, one row's bytes of a group), or None
    when the operands (xq, xd, xsum, data, scales, out) or the literals (bits 8 | 4, a count) do not fit."""
    if not operands_fit(operands,
                        (types.int8, types.float32, types.int32, types.uint8, types.uint16, types.float32)):
        return None
    if not all(isinstance(a, types.IntegerLiteral) for a in (bits, count)):
        return None
    if bits.literal_value not in (4, 8):
        return None
    is_q4 = bits.literal_value == 4
    return is_q4, count.literal_value, 8 if is_q4 else 128, GROUP // 2 if is_q4 else GROUP


def prefetch_ahead(builder, data, position, num_bytes, tokens):
    """Ask for num_bytes of the array `data` (any element type) from byte position + PREFETCH_BYTES, into L2
    (a hint: it never faults, even past the array), in a register block of `tokens` tokens; nothing in
    blocks of fewer than PREFETCH_MIN_TOKENS."""
    if tokens < PREFETCH_MIN_TOKENS:
        return
    i8_ptr = I8.as_pointer()
    data = builder.bitcast(data, i8_ptr)
    prefetch = cgutils.get_or_insert_function(builder.module,
                                              ir.FunctionType(ir.VoidType(), [i8_ptr, I32, I32, I32]),
                                              "llvm.prefetch.p0")
    for line in range(0, num_bytes, 64):
        ptr = builder.gep(data, [builder.add(position, const64(PREFETCH_BYTES + line))])
        builder.call(prefetch, [builder.bitcast(ptr, i8_ptr), ir.Constant(I32, 0),
                                ir.Constant(I32, PREFETCH_LOCALITY), ir.Constant(I32, 1)])


def nibble_vector(builder, chunk, j):
    """Vector j of a group from its 32-byte chunk j // 2 (q4_0's nibble layout): the low nibbles for even j,
    the high ones for odd j."""
    low = ir.Constant(V32I8, [15] * 32)
    if j % 2 == 0:
        return builder.and_(chunk, low)
    return builder.and_(builder.lshr(chunk, ir.Constant(V32I8, [4] * 32)), low)


@intrinsic(prefer_literal=True)
def vnni_block(typingctx, xq, xd, xsum, data, scales, out, t0, n0, bits, tokens):
    """out[t0:t0+tokens, n0:n0+4] = the int8 dot products of quantized x with 4 packed W rows (those < N).

    xq: [T, Kp] int8 (quad order), xd/xsum: [T, Kp // 32] f32/int32, data: uint8 [N4, Kp] (q8_0, value +
    128) or [N4, Kp // 2] (q4_0 nibbles) in 4-row blocks, scales: [N4, Kp // 32] uint16 fp16 (N4: N
    rounded up to 4), out: [T, N] f32; n0 % 4 == 0; bits (8 | 4), tokens: literals.
    """
    literals = vnni_literals((xq, xd, xsum, data, scales, out), bits, tokens)
    if literals is None:
        return None
    is_q4, TB, offset, group_bytes = literals

    def codegen(context, builder, signature, args):
        (xa, da, sa, wa, ca, oa), t0_, n0_, Kp, N = block_operands(context, builder, signature, args)
        num_blocks, num_groups = group_counts(builder, Kp)
        module = builder.module
        dpbusd = dpbusd_function(module)
        fma = fma_function(module)
        minus_offset = ir.Constant(V8I, [-offset] * 8)
        token_rows = [builder.add(t0_, const64(t)) for t in range(TB)]
        weight_rows = [builder.add(n0_, const64(r)) for r in range(ROWS)]
        block_base = builder.mul(builder.udiv(n0_, const64(ROWS)), num_groups)  # the block's first group
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(V8F, None)) for _ in range(TB)]
                for _ in range(ROWS)]
        with cgutils.for_range(builder, num_groups) as loop:
            g = loop.index
            blk0 = builder.mul(g, const64(8))
            x_base = [builder.add(builder.mul(row, Kp), builder.mul(g, const64(GROUP))) for row in token_rows]
            # this group's 4 rows
            stream = builder.mul(builder.add(block_base, g), const64(ROWS * group_bytes))
            prefetch_ahead(builder, wa.data, stream, ROWS * group_bytes, TB)
            w_base = [builder.add(stream, const64(r * group_bytes)) for r in range(ROWS)]
            dx = [load_vec(builder, da.data, builder.add(builder.mul(row, num_blocks), blk0), V8F)
                  for row in token_rows]
            dw = [builder.fpext(load_vec(builder, ca.data, builder.add(builder.mul(row, num_blocks), blk0),
                                      ir.VectorType(ir.HalfType(), 8)), V8F) for row in weight_rows]
            init = [builder.mul(load_vec(builder, sa.data,
                                         builder.add(builder.mul(row, num_blocks), blk0), V8I),
                                minus_offset) for row in token_rows]
            iacc = [list(init) for _ in range(ROWS)]
            packed = [None] * ROWS
            for j in range(8):
                weights = []
                for r in range(ROWS):
                    if is_q4:  # chunk j // 2: vector j // 2 * 2 in its low nibbles, the next in its high ones
                        if j % 2 == 0:
                            packed[r] = load_vec(builder, wa.data, builder.add(w_base[r], const64(16 * j)),
                                                 V32I8)
                        v = nibble_vector(builder, packed[r], j)
                    else:
                        v = load_vec(builder, wa.data, builder.add(w_base[r], const64(32 * j)), V32I8)
                    weights.append(builder.bitcast(v, V8I))
                for t in range(TB):
                    xv = builder.bitcast(load_vec(builder, xa.data, builder.add(x_base[t], const64(32 * j)),
                                                  V32I8), V8I)
                    for r in range(ROWS):
                        iacc[r][t] = builder.call(dpbusd, [iacc[r][t], weights[r], xv])
            fold_group(builder, fma, iacc, dw, dx, accs)
        store_block(builder, oa.data, accs, token_rows, weight_rows, N)
        return context.get_dummy_value()

    return types.none(xq, xd, xsum, data, scales, out, t0, n0, bits, tokens), codegen
