"""The integer codecs: int8 and int4, symmetric integer codes in [-qmax, qmax] (qmax 127, 7), rounded half to even;
int4's two codes to a byte are summed as signed integers (the first plus 16 x the second, an int8)."""

from __future__ import annotations

import torch

from flwr_sharded.parallel.codecs.base import BlockCodec
from flwr_sharded.parallel.codecs.packing import EVERY_BYTE


class Int8Codec(BlockCodec):
    """int8: one signed integer code per byte, rounded to nearest."""

    def encode(self, scaled, raw, ws, keep) -> None:
        scaled.round_()  # half to even; the cast below then is exact
        self.packer.pack(scaled, raw.view(torch.int8), ws)


class Int4Codec(BlockCodec):
    """int4: signed integer codes in [-7, 7] rounded to nearest, two per byte."""

    bits = 4

    def encode(self, scaled, raw, ws, keep) -> None:
        scaled.round_()
        self.packer.pack(scaled, raw.view(torch.int8), ws)  # in [-119, 119]: an int8's range

    def byte_table(self) -> torch.Tensor:
        signed = EVERY_BYTE.view(torch.int8).int()
        lo = (signed + 8) % 16 - 8
        return torch.stack([lo, (signed - lo) // 16], 1).float()
