"""float32: the shards themselves, weighted and all-reduced (the default wire)."""

from flwr_sharded.parallel.wire_kinds import PlainWire, register


@register
class Float32(PlainWire):
    name = "float32"
    order = 0
    bytes_per_value = 4.0
