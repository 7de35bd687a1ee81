"""bfloat16: each group's weighted delta from the global model, rounded once to bf16 and all-reduced in it
(as DiLoCo-style systems send), so only the delta loses precision."""

from flwr_sharded.parallel.wire_kinds import CastWire, register


@register
class BFloat16(CastWire):
    name = "bfloat16"
    order = 10
    bytes_per_value = 2.0
