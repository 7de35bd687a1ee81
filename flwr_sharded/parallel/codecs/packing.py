"""The one packer of integer codes into bytes, for every codec: 8, 4 or 2 bits a code, 8 / bits codes to a byte, the
first in the low bits; unpacked through a 256-entry table of each byte's code values (one gather a byte)."""

from __future__ import annotations

import functools
import math
from typing import Protocol

import torch

from flwr_sharded.parallel.workspace import Workspace

EVERY_BYTE = torch.arange(256, dtype=torch.int32).to(torch.uint8)
"""The 256 byte values in order: what a byte table is indexed by."""


class ByteTable(Protocol):
    """What unpacks codes narrower than a byte: a codec's table of each byte's code values."""

    def byte_table(self) -> torch.Tensor:
        """byte -> its codes' values, (256, codes_per_byte) fp32."""


class CodePacker:
    """Codes of `bits` bits (8, 4 or 2), 8 / bits to a byte, the first in the low bits."""

    def __init__(self, bits: int) -> None:
        if bits not in (8, 4, 2):
            raise ValueError(f"codes pack 8, 4 or 2 bits to a byte's field, not {bits}")
        self.bits, self.codes_per_byte = bits, 8 // bits

    def payload_bytes(self, numel: int) -> int:
        """Bytes of `numel` codes."""
        return math.ceil(numel / self.codes_per_byte)

    def byte_fields(self) -> torch.Tensor:
        """byte -> its codes as unsigned integers, (256, codes_per_byte) int64, the first in the low bits."""
        byte = EVERY_BYTE.long()
        return torch.stack([(byte >> self.bits * i) % (1 << self.bits) for i in range(self.codes_per_byte)], 1)

    def pack(self, codes: torch.Tensor, raw: torch.Tensor, ws: Workspace) -> None:
        """raw = the sum of each group of `codes_per_byte` consecutive `codes` (fp32 integers, contiguous), the i-th
        shifted left by i x `bits` (8 bits: each code as it is); `raw`'s dtype (uint8, or int8 for signed codes) must
        hold the sums exactly."""
        if self.codes_per_byte == 1:
            raw.view(-1).copy_(codes.view(-1))
            return
        groups = codes.view(-1, self.codes_per_byte)
        packed = ws.get("pack", groups.shape[0], torch.float32, codes.device)  # contiguous: 2x faster than in place
        if self.codes_per_byte == 2:
            torch.add(groups[:, 0], groups[:, 1], alpha=16, out=packed)
        else:
            torch.mv(groups, _place_values(self.codes_per_byte, codes.device), out=packed)
        raw.view(-1).copy_(packed)

    def unpack(self, raw: torch.Tensor, out: torch.Tensor, codec: ByteTable, ws: Workspace) -> None:
        """out (fp32, contiguous, `codes_per_byte` values a byte of `raw`) = the values of raw's codes: 8-bit codes
        are the bytes' signed values; narrower ones are looked up in `codec.byte_table()` (byte -> its codes' values,
        (256, codes_per_byte) fp32)."""
        if self.codes_per_byte == 1:
            out.copy_(raw.view(torch.int8))
            return
        flat = out.view(-1)
        index = ws.get("index", raw.numel(), torch.int32, raw.device)
        index.copy_(raw.reshape(-1))
        table = _gather_table(codec, raw.device)
        if self.codes_per_byte != 2:
            torch.index_select(table, 0, index, out=flat.view(-1, self.codes_per_byte))
            return
        # one 8-byte gather per byte: the table holds each byte's pair of fp32 code values as one int64
        aligned = flat.storage_offset() % 2 == 0
        target = flat if aligned else ws.get("unpack", flat.numel(), torch.float32, flat.device)
        torch.index_select(table, 0, index, out=target.view(torch.int64))
        if not aligned:
            flat.copy_(target)


@functools.cache
def _gather_table(codec: ByteTable, device: torch.device) -> torch.Tensor:
    """A codec's byte table on `device`: a pair of fp32 code values viewed as one int64, more as a row."""
    table = codec.byte_table().contiguous()
    return (table.view(torch.int64).view(-1) if table.shape[1] == 2 else table).to(device)


@functools.cache
def _place_values(codes_per_byte: int, device: torch.device) -> torch.Tensor:
    """The multiplier of each code's position in a byte: 1, then shifted left by 8 / codes_per_byte bits each."""
    return torch.tensor([float(1 << (8 // codes_per_byte) * i) for i in range(codes_per_byte)], device=device)
