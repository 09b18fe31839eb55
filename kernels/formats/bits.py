"""A float's bits as the integer of its width and back (LLVM bitcasts, so loops using them still vectorize):
float32 <-> int32, float64 <-> int64. The exps of kernels/exp32.py and kernels/sampling/filters.py write 2**n
into the exponent bits with them."""

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_INT_OF = {types.float32: types.int32, types.float64: types.int64}
_FLOAT_OF = {i: f for f, i in _INT_OF.items()}


@intrinsic
def as_int(typingctx, x):
    """float32 -> int32, float64 -> int64 with the same bits."""
    if x not in _INT_OF:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(x.bitwidth))
    return _INT_OF[x](x), codegen


@intrinsic
def as_float(typingctx, x):
    """int32 -> float32, int64 -> float64 with the same bits."""
    if x not in _FLOAT_OF:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType() if x.bitwidth == 32 else ir.DoubleType())
    return _FLOAT_OF[x](x), codegen
