"""What a codec is: `Codec`, any code format's bytes (the values of a top-k row), and `BlockCodec`, the blockwise
scaled formats of the quantized wires and their ring: a block's fp32 scale, absmax / the format's largest code
(`qmax`), maps its values onto codes that the format rounds and packs (`CodePacker`)."""

from __future__ import annotations

import functools
from typing import ClassVar

import torch

from flwr_sharded.parallel.codecs.packing import CodePacker
from flwr_sharded.parallel.wire_base import QUANT_BLOCK
from flwr_sharded.parallel.workspace import Workspace

TINY_SCALE = torch.finfo(torch.float32).tiny
"""The smallest scale: an all-zero block quantizes to zeros, never divides by 0."""


class Codec:
    """One code format: how flat fp32 values become codes (`payload`) and fp32 side values (`side`: scales or
    codebooks), and back. Subclass `BlockCodec` for a scaled blockwise format."""

    name: str
    """The codec's name in `registry.CODECS` (a quantized wire's own name where it is that wire's format)."""
    bits: ClassVar[int] = 8
    """Bits of one code: 8, 4 or 2 (`CodePacker`)."""
    exact_across_devices: ClassVar[bool] = True
    """Whether every device encodes the same bytes (False: its side values are sums, rounded as each device sums)."""

    @functools.cached_property
    def packer(self) -> CodePacker:
        """Packs this codec's codes into bytes and back."""
        return CodePacker(self.bits)

    @property
    def codes_per_byte(self) -> int:
        return 8 // self.bits

    def __repr__(self) -> str:
        return f"<codec {self.name}>"

    def payload_bytes(self, numel: int) -> int:
        """Bytes of `numel` codes (side values not included)."""
        return self.packer.payload_bytes(numel)

    def encode_values(self, values: torch.Tensor, payload: torch.Tensor, side: torch.Tensor) -> torch.Tensor:
        """Write flat fp32 `values` as codes into `payload` (uint8, `payload_bytes`) and their side values into
        `side` (fp32); return the values as every rank will decode them."""
        raise NotImplementedError

    def decode_values(self, payload: torch.Tensor, side: torch.Tensor, numel: int) -> torch.Tensor:
        """The `numel` fp32 values of `encode_values`' `payload` and `side`."""
        raise NotImplementedError


class BlockCodec(Codec):
    """A blockwise scaled format: one fp32 scale (4 bytes) per block, `encode`/`decode` between scaled values and
    codes. A new one overrides `encode` and `decode` (and `byte_table` if it packs codes narrower than a byte)."""

    torch_name: ClassVar[str | None] = None
    """The name of its torch dtype where it is not `name` (torch.int4 is a placeholder dtype, never a tensor's)."""

    def __init__(self, name: str, qmax: float) -> None:
        self.name, self.qmax = name, qmax

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.torch_name or self.name)

    def check_block(self, block: int) -> None:
        if block < 1 or block % self.codes_per_byte:
            raise ValueError(f"quantization block of {self.name} must be a positive multiple of "
                             f"{self.codes_per_byte} elements, got {block}")

    def values(self, raw: torch.Tensor, numel: int) -> torch.Tensor:
        """The payload of `numel` codes in the bytes `raw`, as `Quantized.values` holds it (a one-byte format in
        its dtype)."""
        return raw.view(self.dtype)[:numel] if self.codes_per_byte == 1 else raw[:self.payload_bytes(numel)]

    def byte_table(self) -> torch.Tensor:
        """byte -> its codes' values, (256, codes_per_byte) fp32 (`CodePacker.unpack`)."""
        raise NotImplementedError

    def encode(self, scaled: torch.Tensor, raw: torch.Tensor, ws: Workspace, keep: bool) -> None:
        """raw (uint8, `payload_bytes` of `scaled`) = the codes of `scaled` (fp32, |.| <= qmax, contiguous); with
        `keep`, `scaled` ends holding the code values (fp32), else it is scratch."""
        raise NotImplementedError

    def decode(self, raw: torch.Tensor, out: torch.Tensor, ws: Workspace) -> None:
        """out (fp32, contiguous, `codes_per_byte` values per byte of `raw`) = the code values in `raw`."""
        self.packer.unpack(raw, out, self, ws)

    def quantize_blocks(self, src: torch.Tensor, raw: torch.Tensor, scales: torch.Tensor, scratch: torch.Tensor,
                        error: bool, ws: Workspace) -> None:
        """Quantize `src` (..., block) into the bytes `raw` (..., payload per block) and `scales` (...), through
        `scratch` (`src` itself unless `error`); with `error`, `src` ends holding its rounding error, in fp32."""
        absmax = torch.maximum(src.amax(-1), src.amin(-1).neg_())  # no |x| temporary (aminmax is slower on CPU)
        torch.div(absmax, self.qmax, out=scales).clamp_(min=TINY_SCALE)
        torch.mul(src, scales.reciprocal().unsqueeze(-1), out=scratch)  # |.| <= qmax (+ an ulp: rounds back to it)
        self.encode(scratch, raw, ws, keep=error)
        if error:
            src.addcmul_(scratch, scales.unsqueeze(-1), value=-1)

    def dequantize_blocks(self, raw: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, ws: Workspace) -> None:
        """out (..., block) = the values of the codes `raw` and `scales`, in fp32 (a decode and a multiply: a
        mixed-dtype multiply is ~3x slower)."""
        self.decode(raw, out, ws)
        out.mul_(scales.unsqueeze(-1))

    def accumulate_blocks(self, raw: torch.Tensor, scales: torch.Tensor, into: torch.Tensor, part: torch.Tensor,
                          ws: Workspace) -> None:
        """into (..., block) += the values of `raw` and `scales`, in fp32, through `part` (shaped like `into`)."""
        self.decode(raw, part, ws)
        into.addcmul_(part, scales.unsqueeze(-1))

    def quantize_flat(self, x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the code bytes of whole blocks, zero-padded; one fp32 scale per block) of a flat fp32 tensor."""
        n = x.numel()
        blocks = -(-n // block)
        work = torch.zeros(blocks * block, dtype=torch.float32, device=x.device)
        work[:n].copy_(x.reshape(-1))
        raw = torch.empty(self.payload_bytes(blocks * block), dtype=torch.uint8, device=x.device)
        scales = torch.empty(blocks, dtype=torch.float32, device=x.device)
        self.quantize_blocks(work.view(blocks, block), raw.view(blocks, -1), scales, work.view(blocks, block), False,
                             Workspace())
        return raw, scales

    def dequantize_flat(self, payload: torch.Tensor, scales: torch.Tensor, numel: int, block: int) -> torch.Tensor:
        """The `numel` fp32 values of the code bytes `payload` (those of `numel` codes, or more) and `scales`."""
        blocks = scales.numel()
        out = torch.empty(blocks * block, dtype=torch.float32, device=payload.device)
        padded = torch.zeros(self.payload_bytes(blocks * block), dtype=torch.uint8, device=payload.device)
        padded[:payload.numel()].copy_(payload)
        self.dequantize_blocks(padded.view(blocks, -1), scales, out.view(blocks, block), Workspace())
        return out[:numel]

    def encode_values(self, values: torch.Tensor, payload: torch.Tensor, side: torch.Tensor) -> torch.Tensor:
        raw, scales = self.quantize_flat(values, QUANT_BLOCK)
        raw = self.values(raw, values.numel()).contiguous().view(-1).view(torch.uint8)
        if raw.numel() != payload.numel():
            raise ValueError(f"{self.name} codes of {values.numel()} values take {raw.numel()} bytes, the row has "
                             f"{payload.numel()}")
        payload.copy_(raw)
        side.copy_(scales)
        return self.dequantize_flat(raw, scales, values.numel(), QUANT_BLOCK)

    def decode_values(self, payload: torch.Tensor, side: torch.Tensor, numel: int) -> torch.Tensor:
        return self.dequantize_flat(self.values(payload, numel).view(torch.uint8), side, numel, QUANT_BLOCK)
