"""float8_e5m2: the weighted delta blockwise quantized to fp8 e5m2 (absmax / 57344 per block, rounded to nearest by
the cast: within 1/8 of each value, twice e4m3's error, for a wider range inside a block: values far below their
block's largest keep more of their precision), summed in fp32. The same hardware as e4m3: CUDA compute capability
>= 8.9 converts both; a CPU qualifies where torch casts to e5m2 exactly."""

from flwr_sharded.parallel.wire_kinds import BlockwiseWire, register


@register
class Float8E5M2(BlockwiseWire):
    name = "float8_e5m2"
    order = 40
    probe = (57344.0, -1.25, 2.0**-16, 0.0)  # largest normal, a 2-bit mantissa, smallest subnormal
    short = "e5m2"
    requirement = "CUDA compute capability >= 8.9"
