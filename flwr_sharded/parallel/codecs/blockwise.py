"""A flat fp32 tensor blockwise quantized through a `BlockCodec`, as one value (`Quantized`), and its bytes."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flwr_sharded.parallel.codecs.base import BlockCodec
from flwr_sharded.parallel.codecs.registry import codec_of
from flwr_sharded.parallel.wire_base import QUANT_BLOCK
from flwr_sharded.parallel.workspace import Workspace

WireFormat = torch.dtype | str | BlockCodec
"""A quantized wire's format as the functions here take it: a torch dtype (torch.int8, a float8, torch.int4,
torch.float4_e2m1fn_x2, torch.int2), a wire name ("int4", "float4_e2m1") or a `BlockCodec`."""


def block_codec(dtype: WireFormat, block: int | None = None) -> BlockCodec:
    """The blockwise codec of `dtype`, checked against `block` if given; ValueError for any other dtype or codec."""
    codec = codec_of(dtype)
    if not isinstance(codec, BlockCodec):
        raise ValueError(f"quantized wire dtype must be a blockwise codec, got {codec.name}")
    if block is not None:
        codec.check_block(block)
    return codec


def qmax(dtype: WireFormat) -> float:
    """The largest code of a format (127 for int8, 448 for e4m3, 57344 for e5m2, 7 for int4, 6 for e2m1): a block's
    absmax maps onto it (int2: 1.5, its largest class, which decodes as the block's own level b)."""
    return block_codec(dtype).qmax


@dataclass(frozen=True)
class Quantized:
    """A flat tensor blockwise quantized: `values`, the codes as they travel (for a one-byte format `numel` of them in
    its dtype; for a 4- or 2-bit one ceil(numel / 2) or ceil(numel / 4) uint8 bytes), and one fp32 scale per
    block."""

    values: torch.Tensor
    scales: torch.Tensor
    numel: int
    block: int
    codec: BlockCodec

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: the codes and the scales (`wire_bytes`)."""
        return self.values.numel() * self.values.element_size() + 4 * self.scales.numel()

    def codes(self) -> torch.Tensor:
        """The `numel` code values (integers in [-qmax, qmax] for int8 and int4), as fp32, unscaled."""
        out = torch.empty(self.values.numel() * self.codec.codes_per_byte, dtype=torch.float32,
                          device=self.values.device)
        self.codec.decode(self.values.view(torch.uint8), out, Workspace())
        return out[:self.numel]


def wire_bytes(numel: int, dtype: WireFormat = torch.int8, block: int = QUANT_BLOCK) -> int:
    """Bytes of `numel` elements quantized to `dtype` with one fp32 scale per block of `block` elements."""
    return block_codec(dtype, block).payload_bytes(numel) + 4 * math.ceil(numel / block)


def quantize(x: torch.Tensor, dtype: WireFormat = torch.int8, block: int = QUANT_BLOCK) -> Quantized:
    """Quantize a flat fp32 tensor blockwise (absmax / `qmax` per block; rounded to nearest)."""
    codec = block_codec(dtype, block)
    raw, scales = codec.quantize_flat(x, block)
    return Quantized(codec.values(raw, x.numel()), scales, x.numel(), block, codec)


def dequantize(q: Quantized) -> torch.Tensor:
    """The fp32 tensor a `Quantized` stands for (values times their block's scale)."""
    return q.codec.dequantize_flat(q.values.view(torch.uint8), q.scales, q.numel, q.block)
