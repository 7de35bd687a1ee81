"""int4: the weighted delta blockwise quantized to 4 bits (absmax / 7 per block, codes in [-7, 7] rounded to
nearest, two to a byte), summed in fp32: half of int8's bytes (about 0.129 of fp32's) for 18x its rounding step."""

from flwr_sharded.parallel.quant_format import QUANT_BLOCK, SCALE_BYTES
from flwr_sharded.parallel.wire_kinds import BlockwiseWire, register


@register
class Int4(BlockwiseWire):
    name = "int4"
    order = 50
    bytes_per_value = 0.5 + SCALE_BYTES / QUANT_BLOCK
