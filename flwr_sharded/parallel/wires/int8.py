"""int8: the weighted delta blockwise quantized (absmax / 127 per block, rounded to nearest), summed in fp32."""

from flwr_sharded.parallel.wire_kinds import BlockwiseWire, register


@register
class Int8(BlockwiseWire):
    name = "int8"
    order = 20
