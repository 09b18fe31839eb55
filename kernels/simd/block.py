"""An AVX-512 register block for y = x @ W.T, written as LLVM IR: R weight rows x TB tokens.

The block keeps R * TB accumulators of 16 float32 lanes in vector registers. Each 16-wide slice of a weight
row is loaded once, dequantized in registers (bf16: shift; fp16: vcvtph2ps, exact; q8_0: sign-extend,
convert, times the block scale; q4_0: nibbles index a permuted table of scaled values) and multiplied into TB
tokens with fused multiply-adds. Every block shape sums in one order: an accumulator takes block 0's two
slices, then block 1's, ... with one chain of FMAs, and ends in one pairwise horizontal sum. So a token's
outputs are bit-for-bit the same whatever its batch, the rows and tokens of its block or its place in it
(batch invariance: a request's tokens do not depend on the requests it runs with). Independent chains for the
small shapes (split half-blocks, two blocks in flight) would buy nothing measurable here (the matvec is
memory-bound) and break it. Writing the vectors out explicitly is what keeps the accumulators in registers:
numba's auto-vectorized loops stored them back to memory every block and ran several times slower on
quantized rows.

Weight layouts (kernels/formats/dequant.py): float32 [N, K]; bf16 bits uint16 [N, K]; fp16 bits int16 [N, K]
(kernels/formats/fp16.py); q8_0 int8 [N, K] with fp16 scales uint16 [N, K // 32]; q4_0 uint8 [N, K // 2] (GGML
nibble order) with the same scales. Only the first K - K % 32 columns are done here; the caller adds the
tail (float formats only: quantized rows are whole blocks).

numba's on-disk cache of kernels/linear/dispatch.py does not notice edits to this file: after changing the
code generation here, delete kernels/__pycache__ (a fresh install starts without a cache).
"""

from llvmlite import binding, ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.simd.int8 import fma_function

LANES = 16
_HAS_AVX512 = "+avx512f" in binding.get_host_cpu_features().flatten().split(",")
_F32 = ir.FloatType()
_I64 = ir.IntType(64)
_VF32 = ir.VectorType(_F32, LANES)


def _vector_load(builder, base, offset, elem_type):
    # LANES elements of elem_type at base[offset] -> <LANES x elem_type>
    ptr = builder.gep(base, [offset])
    return builder.load(builder.bitcast(ptr, ir.VectorType(elem_type, LANES).as_pointer()), align=1)


def widen_bf16(builder, bits):
    # <LANES x i16> bf16 bits -> <LANES x float>: the bits become the high half of each float32
    wide = builder.zext(bits, ir.VectorType(ir.IntType(32), LANES))
    return builder.bitcast(builder.shl(wide, ir.Constant(ir.VectorType(ir.IntType(32), LANES),
                                                         [16] * LANES)), _VF32)


def widen_f16(builder, bits):
    # <LANES x i16> fp16 bits -> <LANES x float>: LLVM's fpext from half, one vcvtph2ps (exact)
    return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), LANES)), _VF32)


def _splat(builder, scalar):
    vec = builder.insert_element(ir.Constant(_VF32, ir.Undefined), scalar, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(vec, ir.Constant(_VF32, ir.Undefined),
                                  ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES))


def _fma(builder, a, b, c):
    return builder.call(fma_function(builder.module, 16), [a, b, c])


def _hsum(builder, vec):
    # pairwise halving: 16 -> 8 -> 4 -> 2 -> 1 lanes
    width = LANES
    while width > 1:
        width //= 2
        i32 = ir.IntType(32)
        lo = builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(i32, width), list(range(width))))
        hi = builder.shuffle_vector(vec, vec,
                                    ir.Constant(ir.VectorType(i32, width), list(range(width, 2 * width))))
        vec = builder.fadd(lo, hi)
    return builder.extract_element(vec, ir.Constant(ir.IntType(32), 0))


class _Format:
    """How one served weight format loads the two 16-lane slices of a 32-column block as float32."""

    columns_per_element = 1  # q4_0 packs two columns per byte

    def __init__(self, builder, data, scales, K):
        self.builder, self.data, self.scales, self.K = builder, data, scales, K

    def block(self, row, b):
        raise NotImplementedError

    def offset(self, row, b):
        """Index into data of block b of a row."""
        per_row = self.builder.udiv(self.K, ir.Constant(_I64, self.columns_per_element))
        return self.builder.add(self.builder.mul(row, per_row),
                                self.builder.mul(b, ir.Constant(_I64, 32 // self.columns_per_element)))


class _Float32(_Format):
    def block(self, row, b):
        start = self.offset(row, b)
        return [_vector_load(self.builder, self.data,
                             self.builder.add(start, ir.Constant(_I64, h * LANES)), _F32)
                for h in range(2)]


class _BFloat16(_Format):
    def block(self, row, b):
        builder = self.builder
        start = self.offset(row, b)
        halves = []
        for h in range(2):
            bits = _vector_load(builder, self.data, builder.add(start, ir.Constant(_I64, h * LANES)),
                                ir.IntType(16))
            halves.append(widen_bf16(builder, bits))
        return halves


class _Float16(_Format):
    def block(self, row, b):
        builder = self.builder
        start = self.offset(row, b)
        offsets = [builder.add(start, ir.Constant(_I64, h * LANES)) for h in range(2)]
        return [widen_f16(builder, _vector_load(builder, self.data, o, ir.IntType(16))) for o in offsets]


class _Quantized(_Format):
    def scale(self, row, b):
        builder = self.builder
        blocks = builder.udiv(self.K, ir.Constant(_I64, 32))
        bits = builder.load(builder.gep(self.scales, [builder.add(builder.mul(row, blocks), b)]))
        return _splat(builder, builder.fpext(builder.bitcast(bits, ir.HalfType()), _F32))


class _Q8_0(_Quantized):
    def block(self, row, b):
        builder = self.builder
        start = self.offset(row, b)
        d = self.scale(row, b)
        halves = []
        for h in range(2):
            q = _vector_load(builder, self.data, builder.add(start, ir.Constant(_I64, h * LANES)),
                             ir.IntType(8))
            wide = builder.sext(q, ir.VectorType(ir.IntType(32), LANES))
            halves.append(builder.fmul(builder.sitofp(wide, _VF32), d))
        return halves


class _Q4_0(_Quantized):
    columns_per_element = 2

    def block(self, row, b):
        builder = self.builder
        i32x16 = ir.VectorType(ir.IntType(32), LANES)
        start = self.offset(row, b)
        d = self.scale(row, b)
        wide = builder.zext(_vector_load(builder, self.data, start, ir.IntType(8)), i32x16)
        nibbles = (builder.and_(wide, ir.Constant(i32x16, [15] * LANES)),  # columns 0..15 of the block
                   builder.lshr(wide, ir.Constant(i32x16, [4] * LANES)))  # columns 16..31
        if _HAS_AVX512:  # one permute per 16 weights from the table d * (0..15 - 8)
            table = builder.fmul(ir.Constant(_VF32, [float(q - 8) for q in range(LANES)]), d)
            permute = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(_VF32, [_VF32, i32x16]), "llvm.x86.avx512.permvar.sf.512")
            return [builder.call(permute, [table, nib]) for nib in nibbles]
        eight = ir.Constant(i32x16, [8] * LANES)
        return [builder.fmul(builder.sitofp(builder.sub(nib, eight), _VF32), d) for nib in nibbles]


_FORMATS = {types.float32: _Float32, types.uint16: _BFloat16, types.int16: _Float16, types.int8: _Q8_0,
            types.uint8: _Q4_0}


@intrinsic(prefer_literal=True)
def matmul_block(typingctx, x, data, scales, out, t0, n0, rows, tokens):
    """out[t0:t0+tokens, n0:n0+rows] = x[t0:t0+tokens, :K32] @ W[n0:n0+rows, :K32].T, K32 = K - K % 32.

    x: [T, K] f32, out: [T, N] f32, data/scales: one weight (C-contiguous); rows, tokens: literals.
    """
    arrays = (x, data, scales, out)
    if not all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in arrays):
        return None
    if x.dtype != types.float32 or out.dtype != types.float32 or data.dtype not in _FORMATS:
        return None
    if not (isinstance(rows, types.IntegerLiteral) and isinstance(tokens, types.IntegerLiteral)):
        return None
    R, TB = rows.literal_value, tokens.literal_value

    def codegen(context, builder, signature, args):
        xa, wa, sa, oa = (context.make_array(ty)(context, builder, value)
                          for ty, value in zip(signature.args[:4], args[:4]))
        t0_ = context.cast(builder, args[4], signature.args[4], types.int64)
        n0_ = context.cast(builder, args[5], signature.args[5], types.int64)
        K = cgutils.unpack_tuple(builder, xa.shape, 2)[1]
        N = cgutils.unpack_tuple(builder, oa.shape, 2)[1]
        fmt = _FORMATS[data.dtype](builder, wa.data, sa.data, K)
        num_blocks = builder.udiv(K, ir.Constant(_I64, 32))
        x_rows = [builder.mul(builder.add(t0_, ir.Constant(_I64, t)), K) for t in range(TB)]
        w_rows = [builder.add(n0_, ir.Constant(_I64, r)) for r in range(R)]
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(_VF32, None)) for _ in range(TB)]
                for _ in range(R)]  # [R][TB] <16 x float>

        with cgutils.for_range(builder, num_blocks) as loop:  # block b of every row into every token
            col = builder.mul(loop.index, ir.Constant(_I64, 32))
            weights = [fmt.block(row, loop.index) for row in w_rows]  # [R][2] <16 x float>
            for t in range(TB):
                x_start = builder.add(x_rows[t], col)
                xs = [_vector_load(builder, xa.data, builder.add(x_start, ir.Constant(_I64, h * LANES)), _F32)
                      for h in range(2)]
                for r in range(R):
                    for h in range(2):
                        builder.store(_fma(builder, xs[h], weights[r][h], builder.load(accs[r][t])),
                                      accs[r][t])
        for t in range(TB):
            out_row = builder.mul(builder.add(t0_, ir.Constant(_I64, t)), N)
            for r in range(R):
                ptr = builder.gep(oa.data, [builder.add(out_row, w_rows[r])])
                builder.store(_hsum(builder, builder.load(accs[r][t])), ptr)
        return context.get_dummy_value()

    return types.none(x, data, scales, out, t0, n0, rows, tokens), codegen
