"""The code formats of the blockwise quantized wires (values scaled into [-qmax, qmax] <-> codes <-> bytes), and the
workspace their buffers come from: int8 and int4 symmetric integer codes (qmax 127, 7) rounded half to even;
float8_e4m3fn and float8_e5m2 through torch's casts (qmax 448, 57344); float4_e2m1, OCP's 4-bit float (0, 0.5, 1,
1.5, 2, 3, 4, 6 and their negatives, qmax 6), rounded to nearest with ties to the smaller magnitude. The 4-bit formats
pack two codes to a byte (lo + 16 hi) and decode through a 256-entry table of code pairs.
"""

from __future__ import annotations

import functools
import math

import torch

_BYTES = torch.arange(256, dtype=torch.int32).to(torch.uint8)


class Workspace:
    """Named byte buffers reused across reductions (first touching fresh memory costs more than quantizing)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < nbytes or buf.device != device:
            buf = self._buffers[name] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes].view(dtype)


class CodeFormat:
    """One code format (module docstring): its codes, their packing into bytes, and their decoding."""

    name: str
    """The wire's name (also its torch dtype's unless `torch_name` says: torch.int4 is a placeholder dtype, never a
    tensor's)."""
    torch_name: str | None = None
    """The name of its torch dtype where it is not `name`."""
    qmax: float
    """The largest code: a block's absmax maps onto it."""
    codes_per_byte: int = 1

    def __init__(self, name: str, qmax: float) -> None:
        self.name, self.qmax = name, qmax

    def __repr__(self) -> str:
        return f"<code format {self.name}>"

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.torch_name or self.name)

    def payload_bytes(self, numel: int) -> int:
        """Bytes of `numel` codes (scales not included)."""
        return math.ceil(numel / self.codes_per_byte)

    def check_block(self, block: int) -> None:
        if block < 1 or block % self.codes_per_byte:
            raise ValueError(f"quantization block of {self.name} must be a positive multiple of "
                             f"{self.codes_per_byte} elements, got {block}")

    def values(self, raw: torch.Tensor, numel: int) -> torch.Tensor:
        """The payload of `numel` codes in the bytes `raw`, as `Quantized.values` holds it."""
        return raw.view(self.dtype)[:numel]

    def encode(self, scaled: torch.Tensor, raw: torch.Tensor, ws: Workspace, keep: bool) -> None:
        """raw (uint8, `payload_bytes` of `scaled`) = the codes of `scaled` (fp32, |.| <= qmax, contiguous); with
        `keep`, `scaled` ends holding the code values (fp32), else it is scratch."""
        raise NotImplementedError

    def decode(self, raw: torch.Tensor, out: torch.Tensor, ws: Workspace) -> None:
        """out (fp32, contiguous, `codes_per_byte` values per byte of `raw`) = the code values in `raw`."""
        raise NotImplementedError


class IntCodes(CodeFormat):
    """int8: one signed integer code per byte, rounded to nearest."""

    def encode(self, scaled, raw, ws, keep) -> None:
        scaled.round_()  # half to even; the cast below then is exact
        raw.view(torch.int8).copy_(scaled)

    def decode(self, raw, out, ws) -> None:
        out.copy_(raw.view(torch.int8))


class Float8Codes(CodeFormat):
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


class _PairCodes(CodeFormat):
    """A 4-bit format: two codes per byte, decoded through a table of each byte's pair of code values."""

    codes_per_byte = 2

    def values(self, raw, numel) -> torch.Tensor:
        return raw[:self.payload_bytes(numel)]

    def pairs(self) -> torch.Tensor:
        """byte -> its (lo, hi) code values, (256, 2) fp32."""
        raise NotImplementedError

    @staticmethod
    def pack(codes: torch.Tensor, raw: torch.Tensor, ws: Workspace) -> None:
        """raw = lo + 16 hi of each pair of consecutive `codes` (fp32 nibbles, exact in `raw`'s dtype)."""
        pairs = codes.view(-1, 2)
        packed = ws.get("pack", pairs.shape[0], torch.float32, codes.device)  # contiguous: 2x faster than in place
        torch.add(pairs[:, 0], pairs[:, 1], alpha=16, out=packed)
        raw.view(-1).copy_(packed)

    def decode(self, raw, out, ws) -> None:
        flat = out.view(-1)
        aligned = flat.storage_offset() % 2 == 0
        target = flat if aligned else ws.get("unpack", flat.numel(), torch.float32, flat.device)
        index = ws.get("index", raw.numel(), torch.int32, raw.device)
        index.copy_(raw.reshape(-1))
        # one 8-byte gather per byte: the table holds each byte's pair of fp32 code values as one int64
        torch.index_select(_pair_table(self, raw.device), 0, index, out=target.view(torch.int64))
        if not aligned:
            flat.copy_(target)


class Int4Codes(_PairCodes):
    """int4: signed integer codes in [-7, 7] rounded to nearest, two per byte (module docstring)."""

    def encode(self, scaled, raw, ws, keep) -> None:
        scaled.round_()
        self.pack(scaled, raw.view(torch.int8), ws)  # in [-119, 119]: an int8's range

    def pairs(self) -> torch.Tensor:
        signed = _BYTES.view(torch.int8).int()
        lo = (signed + 8) % 16 - 8
        return torch.stack([lo, (signed - lo) // 16], 1).float()


class Float4Codes(_PairCodes):
    """float4_e2m1: sign-magnitude 4-bit floats, two per byte (module docstring)."""

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
        self.pack(quarters, raw, ws)  # in [0, 255]

    def nibbles(self) -> torch.Tensor:
        """nibble -> value, (16,) fp32: magnitudes, then their negatives."""
        mags = torch.tensor(self.magnitudes)
        return torch.cat([mags, -mags])

    def pairs(self) -> torch.Tensor:
        table = self.nibbles()
        return torch.stack([table[_BYTES.long() % 16], table[_BYTES.long() // 16]], 1)


@functools.cache
def _float8_table(dtype: torch.dtype) -> torch.Tensor:
    """code -> value of a float8 format, as fp32."""
    return _BYTES.view(dtype).float()


@functools.cache
def _pair_table(fmt: _PairCodes, device: torch.device) -> torch.Tensor:
    """byte -> its pair of fp32 code values, viewed as one int64 per byte."""
    return fmt.pairs().contiguous().view(torch.int64).view(-1).to(device)


_QUARTERS = 26
"""Entries per sign of the e2m1 encoding tables: ceil(4 |x|) for |x| up to qmax = 6, plus one."""


@functools.cache
def _quarter_tables(fmt: Float4Codes, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """ceil(4 |x|) + 26 (x < 0) -> (the nibble, its value), as fp32: a magnitude's index counts the midpoints below
    4 |x| (a tie rounds down)."""
    mags = torch.tensor(fmt.magnitudes)
    quarter_mids = (mags[1:] + mags[:-1]) * 2  # 1, 3, 5, 7, 10, 14, 20
    index = (quarter_mids.unsqueeze(0) < torch.arange(_QUARTERS).unsqueeze(1)).sum(1)
    nibbles = torch.cat([index, index + 8]).float()
    return nibbles.to(device), fmt.nibbles()[nibbles.long()].to(device)


FORMATS: dict[str, CodeFormat] = {f.name: f for f in (
    IntCodes("int8", 127.0),
    Float8Codes("float8_e4m3fn", float(torch.finfo(torch.float8_e4m3fn).max)),
    Float8Codes("float8_e5m2", float(torch.finfo(torch.float8_e5m2).max)),
    Int4Codes("int4", 7.0),
    Float4Codes("float4_e2m1", 6.0),
)}
"""Every code format by name."""
_BY_TORCH_NAME = {f.torch_name: f for f in FORMATS.values() if f.torch_name}


def code_format(dtype: torch.dtype | str | CodeFormat) -> CodeFormat:
    """The format of a torch dtype (torch.int8, a float8, torch.int4), a wire name ("int4") or a format itself;
    ValueError for anything else."""
    if isinstance(dtype, CodeFormat):
        return dtype
    name = str(dtype).removeprefix("torch.")
    fmt = FORMATS.get(name) or _BY_TORCH_NAME.get(name)
    if fmt is None:
        raise ValueError(f"quantized wire dtype must be one of {', '.join(FORMATS)}, got {dtype}")
    return fmt
