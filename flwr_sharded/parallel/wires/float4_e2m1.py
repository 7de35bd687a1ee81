"""float4_e2m1: the weighted delta blockwise quantized to OCP's 4-bit float (absmax / 6 per block; 0, 0.5, 1, 1.5, 2,
3, 4, 6 and their negatives, rounded to nearest: within 1/4 of each value, or 1/4 of the scale below it), two to a
byte, summed in fp32; int4's bytes, with a wider range inside a block for a coarser step near its absmax. Decoded
through a table, so any device runs it."""

from flwr_sharded.parallel.quant_format import QUANT_BLOCK, SCALE_BYTES
from flwr_sharded.parallel.wire_kinds import BlockwiseWire, register


@register
class Float4E2M1(BlockwiseWire):
    name = "float4_e2m1"
    torch_name = "float4_e2m1fn_x2"
    order = 60
    bytes_per_value = 0.5 + SCALE_BYTES / QUANT_BLOCK
