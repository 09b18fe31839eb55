"""dot(a, b) of two float32 vectors in one fixed order, written as LLVM IR.

Eight lanes (lane l takes elements l, l + 8, l + 16, ...) accumulated with fused multiply-adds, then a
pairwise horizontal sum, then the D % 8 tail in order. The same bits wherever it is inlined: numba's
fastmath sums (`reassoc`) let LLVM pick a vectorization per call site, so the serial and the parallel
attention kernel summed the same scores differently (batch invariance, models/linear.py); without
`reassoc` LLVM left the scalar loop unvectorized and attention ran at half speed.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_F32, _I32, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
_V8F = ir.VectorType(_F32, 8)


@intrinsic
def dot(typingctx, a, b):
    """sum(a * b) for a, b: [D] float32, C-contiguous, same length."""
    if not all(isinstance(x, types.Array) and x.ndim == 1 and x.dtype == types.float32 and x.layout == "C"
               for x in (a, b)):
        return None

    def codegen(context, builder, signature, args):
        aa, ba = (context.make_array(ty)(context, builder, value) for ty, value in zip(signature.args, args))
        D = cgutils.unpack_tuple(builder, aa.shape, 1)[0]
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8F, [_V8F] * 3), "llvm.fma.v8f32")
        fma1 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32] * 3), "llvm.fma.f32")

        def load8(arr, i):
            return builder.load(builder.bitcast(builder.gep(arr.data, [i]), _V8F.as_pointer()), align=1)

        acc = cgutils.alloca_once_value(builder, ir.Constant(_V8F, None))
        eight = ir.Constant(_I64, 8)
        with cgutils.for_range(builder, builder.udiv(D, eight)) as loop:
            i = builder.mul(loop.index, eight)
            builder.store(builder.call(fma, [load8(aa, i), load8(ba, i), builder.load(acc)]), acc)
        vec = builder.load(acc)
        width = 8
        while width > 1:  # 8 -> 4 -> 2 -> 1 lanes
            width //= 2
            lo = builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_I32, width), list(range(width))))
            hi = builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_I32, width),
                                                              list(range(width, 2 * width))))
            vec = builder.fadd(lo, hi)
        total = cgutils.alloca_once_value(builder, builder.extract_element(vec, ir.Constant(_I32, 0)))
        with cgutils.for_range_slice(builder, builder.mul(builder.udiv(D, eight), eight), D, ir.Constant(_I64, 1)) as (i, _):
            x = builder.load(builder.gep(aa.data, [i]))
            y = builder.load(builder.gep(ba.data, [i]))
            builder.store(builder.call(fma1, [x, y, builder.load(total)]), total)
        return builder.load(total)

    return types.float32(a, b), codegen
