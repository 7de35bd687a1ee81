"""The blockwise format of the quantized wires (torch-free): one fp32 scale per block of values."""

QUANT_BLOCK = 256
"""Elements per fp32 scale of a quantized wire (`flwr_sharded.parallel.quantize`)."""
SCALE_BYTES = 4
"""Bytes of one block's scale (fp32)."""
