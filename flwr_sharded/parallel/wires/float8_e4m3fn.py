"""float8_e4m3fn: the weighted delta blockwise quantized to fp8 e4m3 (absmax / 448 per block, rounded to nearest by
the cast: within 1/16 of each value), summed in fp32. CUDA needs compute capability >= 8.9 (hardware e4m3
conversion; below it torch emulates the cast); a CPU qualifies where torch casts to e4m3 exactly."""

from flwr_sharded.parallel.wire_kinds import BlockwiseWire, register


@register
class Float8E4M3(BlockwiseWire):
    name = "float8_e4m3fn"
    order = 30
    probe = (448.0, -1.125, 2.0**-9, 0.0)  # largest normal, a 3-bit mantissa, smallest subnormal
    short = "e4m3"
    requirement = "CUDA compute capability >= 8.9"
