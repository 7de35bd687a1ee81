"""The float codecs: float8_e4m3fn and float8_e5m2 through torch's casts (qmax 448, 57344), and float4_e2m1, OCP's
4-bit float (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives, qmax 6) rounded to nearest with ties to the smaller
magnitude, two to a byte; and whether a device runs a float8 wire (`fp8_supported`)."""

from __future__ import annotations

import functools

import torch

from flwr_sharded.parallel.codecs.base import BlockCodec
from flwr_sharded.parallel.codecs.packing import EVERY_BYTE


class Float8Codec(BlockCodec):
    """A float8: torch's cast rounds to nearest; on CPU decoded through a 256-entry table (8x faster there)."""

    def encode(self, scaled, raw, ws, keep) -> None:
        raw.view(self.dtype).copy_(scaled)  # the cast to fp8 rounds to nearest
        if keep:
            self.decode(raw, scaled, ws)

    def decode(self, raw, out, ws) -> None:
        if raw.device.type != "cpu":
            out.copy_(raw.view(self.dtype))
            return
        index = ws.get("index", raw.numel(), torch.int32, raw.device)
        index.copy_(raw.reshape(-1))
        torch.index_select(_float8_table(self.dtype), 0, index, out=out.view(-1))


class Float4Codec(BlockCodec):
    """float4_e2m1: sign-magnitude 4-bit floats, two per byte (module docstring)."""

    bits = 4
    torch_name = "float4_e2m1fn_x2"
    magnitudes = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

    def encode(self, scaled, raw, ws, keep) -> None:
        flat = scaled.view(-1)
        n, dev = flat.numel(), flat.device
        # every midpoint between two magnitudes is a multiple of 1/4: q = ceil(4 |x|) (0 .. 24, 25 for qmax's ulp
        # above), plus 26 for a negative x, indexes a table of nibbles and one of their values
        quarters = ws.get("quarters", n, torch.float32, dev)
        torch.abs(flat, out=quarters).mul_(4).ceil_().add_(flat.signbit(), alpha=_QUARTERS)
        index = ws.get("index", n, torch.int32, dev)
        index.copy_(quarters)
        nibbles, values = _quarter_tables(self, dev)
        if keep:
            torch.index_select(values, 0, index, out=flat)
        torch.index_select(nibbles, 0, index, out=quarters)
        self.packer.pack(quarters, raw, ws)  # in [0, 255]

    def nibbles(self) -> torch.Tensor:
        """nibble -> value, (16,) fp32: magnitudes, then their negatives."""
        mags = torch.tensor(self.magnitudes)
        return torch.cat([mags, -mags])

    def byte_table(self) -> torch.Tensor:
        return self.nibbles()[self.packer.byte_fields()]


@functools.cache
def _float8_table(dtype: torch.dtype) -> torch.Tensor:
    """code -> value of a float8 format, as fp32."""
    return EVERY_BYTE.view(dtype).float()


_QUARTERS = 26
"""Entries per sign of the e2m1 encoding tables: ceil(4 |x|) for |x| up to qmax = 6, plus one."""


@functools.cache
def _quarter_tables(codec: Float4Codec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """ceil(4 |x|) + 26 (x < 0) -> (the nibble, its value), as fp32: a magnitude's index counts the midpoints below
    4 |x| (a tie rounds down)."""
    mags = torch.tensor(codec.magnitudes)
    quarter_mids = (mags[1:] + mags[:-1]) * 2  # 1, 3, 5, 7, 10, 14, 20
    index = (quarter_mids.unsqueeze(0) < torch.arange(_QUARTERS).unsqueeze(1)).sum(1)
    nibbles = torch.cat([index, index + 8]).float()
    return nibbles.to(device), codec.nibbles()[nibbles.long()].to(device)


def fp8_supported(device: torch.device | str, dtype: torch.dtype, probe: tuple[float, ...]) -> bool:
    """Whether an fp8 `dtype` is a wire dtype on `device`: CUDA with compute capability >= 8.9 (hardware fp8
    conversion; below it torch emulates the cast), or a CPU on which torch casts the `probe` values (the wire's) to
    and from it exactly."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)
    if device.type != "cpu":
        return False
    values = torch.tensor(probe)
    try:
        return bool(torch.equal(values.to(dtype).float(), values))
    except (RuntimeError, TypeError):
        return False
