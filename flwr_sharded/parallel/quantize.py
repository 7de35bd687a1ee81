"""Blockwise quantization of a flat fp32 tensor and the quantized all-reduce, summed in fp32.

A block has one fp32 scale, absmax / the format's largest code (`qmax`), except int2's (below); the code formats map
scaled values to codes and bytes: int8 and int4 symmetric integer codes (qmax 127, 7) rounded half to even;
float8_e4m3fn and float8_e5m2 through torch's casts (qmax 448, 57344); float4_e2m1, OCP's 4-bit float (0, 0.5, 1, 1.5,
2, 3, 4, 6 and their negatives, qmax 6), rounded to nearest with ties to the smaller magnitude; int2, four symmetric
levels -b, -a, a, b per block: the magnitudes below the block's RMS decode as their mean a, those at or above it as
theirs b. For a Gaussian that is the 4-level Lloyd-Max quantizer almost exactly (levels 0.46 and 1.53 sigma split at 1
sigma, against 0.45 and 1.51 at 0.98), and for any block a contraction: each class's mean is its least-squares level,
so a block's error is smaller than the block, which error feedback needs to stay bounded (fixed levels +-0.5, +-1.5
times a scale send a block of one large value and small ones back with more error than it had); a and b travel as two
bf16 in the 4 bytes of a block's scale. The 4- and 2-bit formats pack two or four codes to a byte (the first in the
low bits) and decode through a 256-entry table of each byte's codes. `quantized_all_reduce` is a ring (as
INTELLECT-1's): W chunks of whole blocks reduce-scattered, each partial sum quantized to travel, then each rank's
whole sum quantized once more and all-gathered as uint8 rows (gloo refuses float8), so every rank decodes the same
bytes. A rank sends 2 (W - 1) rows (`all_reduce_bytes`), about (bits / 8 + 4 / block) / 4 of a ring fp32 all-reduce;
the result carries W roundings per element, which `ErrorFeedback` keeps from accumulating. Where the group's backend
cannot send device tensors point to point (gloo: its send/recv have no CUDA path), the ring's steps travel through
persistent pinned host buffers (`p2p_carries_device_tensors`); its all-gather needs none (gloo's all-gather copies
CUDA tensors through host memory itself).
"""

from __future__ import annotations

import datetime
import functools
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from flwr_sharded.parallel.collectives import bounded, group_timeout, wait_for
from flwr_sharded.parallel.torch_compat import all_gather_single
from flwr_sharded.parallel.wire_base import QUANT_BLOCK

_BYTES = torch.arange(256, dtype=torch.int32).to(torch.uint8)
_log = logging.getLogger(__name__)


class Workspace:
    """Named byte buffers reused across reductions (first touching fresh memory costs more than quantizing)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device | str, *,
            pinned: bool = False) -> torch.Tensor:
        """`numel` elements of `dtype` on `device`; `pinned`: in page-locked host memory where CUDA is available
        (`device` is then the CPU)."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < nbytes or buf.device != torch.device(device):
            pin = pinned and torch.cuda.is_available()
            buf = self._buffers[name] = torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin)
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

    def quantize_blocks(self, src: torch.Tensor, raw: torch.Tensor, scales: torch.Tensor, scratch: torch.Tensor,
                        error: bool, ws: Workspace) -> None:
        """Quantize `src` (..., block) into the bytes `raw` (..., payload per block) and `scales` (...), through
        `scratch` (`src` itself unless `error`); with `error`, `src` ends holding its rounding error, in fp32."""
        absmax = torch.maximum(src.amax(-1), src.amin(-1).neg_())  # no |x| temporary (aminmax is slower on CPU)
        torch.div(absmax, self.qmax, out=scales).clamp_(min=_TINY)
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


class _PackedCodes(CodeFormat):
    """A format of 4 or 2 bits: `codes_per_byte` codes to a byte, the first in the low bits, decoded through a table
    of each byte's code values."""

    codes_per_byte = 2

    def values(self, raw, numel) -> torch.Tensor:
        return raw[:self.payload_bytes(numel)]

    def table(self) -> torch.Tensor:
        """byte -> its code values, (256, codes_per_byte) fp32."""
        raise NotImplementedError

    def pack(self, codes: torch.Tensor, raw: torch.Tensor, ws: Workspace) -> None:
        """raw = the sum of each group of `codes_per_byte` consecutive `codes` (fp32 integers of 8 / codes_per_byte
        bits, exact in `raw`'s dtype), the i-th shifted left by i x those bits."""
        groups = codes.view(-1, self.codes_per_byte)
        packed = ws.get("pack", groups.shape[0], torch.float32, codes.device)  # contiguous: 2x faster than in place
        if self.codes_per_byte == 2:
            torch.add(groups[:, 0], groups[:, 1], alpha=16, out=packed)
        else:
            torch.mv(groups, _place_values(self.codes_per_byte, codes.device), out=packed)
        raw.view(-1).copy_(packed)

    def decode(self, raw, out, ws) -> None:
        flat = out.view(-1)
        index = ws.get("index", raw.numel(), torch.int32, raw.device)
        index.copy_(raw.reshape(-1))
        table = _code_table(self, raw.device)
        if self.codes_per_byte != 2:
            torch.index_select(table, 0, index, out=flat.view(-1, self.codes_per_byte))
            return
        # one 8-byte gather per byte: the table holds each byte's pair of fp32 code values as one int64
        aligned = flat.storage_offset() % 2 == 0
        target = flat if aligned else ws.get("unpack", flat.numel(), torch.float32, flat.device)
        torch.index_select(table, 0, index, out=target.view(torch.int64))
        if not aligned:
            flat.copy_(target)


class Int4Codes(_PackedCodes):
    """int4: signed integer codes in [-7, 7] rounded to nearest, two per byte (module docstring)."""

    def encode(self, scaled, raw, ws, keep) -> None:
        scaled.round_()
        self.pack(scaled, raw.view(torch.int8), ws)  # in [-119, 119]: an int8's range

    def table(self) -> torch.Tensor:
        signed = _BYTES.view(torch.int8).int()
        lo = (signed + 8) % 16 - 8
        return torch.stack([lo, (signed - lo) // 16], 1).float()


class Float4Codes(_PackedCodes):
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

    def table(self) -> torch.Tensor:
        table = self.nibbles()
        return torch.stack([table[_BYTES.long() % 16], table[_BYTES.long() // 16]], 1)


class Int2Codes(_PackedCodes):
    """int2: the levels -b, -a, a, b of each block (module docstring), four to a byte as the level's index 0 .. 3;
    a block's 4 scale bytes hold (a, b) as two bf16."""

    codes_per_byte = 4

    def table(self) -> torch.Tensor:
        """byte -> its codes' signed classes: -1.5, -0.5, 0.5, 1.5 for -b, -a, a, b."""
        byte = _BYTES.long()
        return torch.stack([(byte >> 2 * i) % 4 for i in range(4)], 1).float() - 1.5

    def quantize_blocks(self, src, raw, scales, scratch, error, ws) -> None:
        n, dev = src.numel(), src.device
        magnitude = torch.abs(src, out=ws.get("magnitude", n, torch.float32, dev).view(src.shape))
        absmax = magnitude.amax(-1)
        # the RMS in fp32, held within [absmax / sqrt(block), absmax], where the true RMS lies: a block whose squares
        # underflow or overflow fp32 still splits at a value of its own size
        root = src.shape[-1] ** -0.5
        threshold = torch.linalg.vector_norm(src, dim=-1).mul_(root)
        threshold = torch.clamp(threshold, min=absmax.mul(root), max=absmax).unsqueeze(-1)
        outer = torch.ge(magnitude, threshold, out=ws.get("outer", n, torch.float32, dev).view(src.shape))
        count, total = outer.sum(-1), magnitude.sum(-1)
        outer_sum = magnitude.mul_(outer).sum(-1)  # ~10x faster than vecdot on CPU; the magnitudes are not needed again
        inner = total.sub_(outer_sum).div_(count.neg().add_(src.shape[-1]).clamp_(min=1))
        levels = scales.view(torch.bfloat16).view(-1, 2)
        levels.copy_(torch.stack([inner, outer_sum.div_(count.clamp_(min=1))], 1))  # rounded to bf16
        a, b = (levels[:, i].float().view(threshold.shape) for i in (0, 1))
        codes = torch.add(outer, 0.5, out=magnitude)  # |signed class| - 1: 0.5 inner, 1.5 outer
        torch.copysign(codes, src, out=codes)
        if error:  # src -= sign x (a + outer (b - a)), the decoded value
            src.sub_(torch.copysign(outer.mul_(b - a).add_(a), codes))
        self.pack(codes.add_(1.5), raw, ws)

    def dequantize_blocks(self, raw, scales, out, ws) -> None:
        self.decode(raw, out, ws)  # the signed classes
        levels = scales.view(torch.bfloat16).view(-1, 2).float()
        a, b = levels[:, :1], levels[:, 1:]
        value = torch.abs(out, out=ws.get("levels", out.numel(), torch.float32, out.device).view(out.shape))
        torch.copysign(value.sub_(0.5).mul_(b - a).add_(a), out, out=out)

    def accumulate_blocks(self, raw, scales, into, part, ws) -> None:
        self.dequantize_blocks(raw, scales, part, ws)
        into.add_(part)


@functools.cache
def _float8_table(dtype: torch.dtype) -> torch.Tensor:
    """code -> value of a float8 format, as fp32."""
    return _BYTES.view(dtype).float()


@functools.cache
def _code_table(fmt: _PackedCodes, device: torch.device) -> torch.Tensor:
    """byte -> its fp32 code values: a pair viewed as one int64, more as a row."""
    table = fmt.table().contiguous()
    return (table.view(torch.int64).view(-1) if fmt.codes_per_byte == 2 else table).to(device)


@functools.cache
def _place_values(codes_per_byte: int, device: torch.device) -> torch.Tensor:
    """The multiplier of each code's position in a byte: 1, then shifted left by 8 / codes_per_byte bits each."""
    return torch.tensor([float(1 << (8 // codes_per_byte) * i) for i in range(codes_per_byte)], device=device)


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
    Int2Codes("int2", 1.5),  # its qmax: the largest signed class
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


# ------------------------------------------------------------------------------------------- quantizing, reducing

_TINY = torch.finfo(torch.float32).tiny  # smallest scale: an all-zero block quantizes to zeros, never divides by 0

WireFormat = torch.dtype | str | CodeFormat
"""A quantized wire's format as the functions here take it: a torch dtype (torch.int8, a float8, torch.int4,
torch.float4_e2m1fn_x2), a wire name ("int4", "float4_e2m1") or a `CodeFormat`."""


def qmax(dtype: WireFormat) -> float:
    """The largest code of a format (127 for int8, 448 for e4m3, 57344 for e5m2, 7 for int4, 6 for e2m1): a block's
    absmax maps onto it (int2: 1.5, its largest class, which decodes as the block's own level b)."""
    return code_format(dtype).qmax


@dataclass(frozen=True)
class Quantized:
    """A flat tensor blockwise quantized: `values`, the codes as they travel (for a one-byte format `numel` of them in
    its dtype; for a 4- or 2-bit one ceil(numel / 2) or ceil(numel / 4) uint8 bytes), and one fp32 scale per
    block."""

    values: torch.Tensor
    scales: torch.Tensor
    numel: int
    block: int
    format: CodeFormat | None = None
    """The code format; None: the one of `values`' dtype (a one-byte format)."""

    def __post_init__(self) -> None:
        if self.format is None:
            object.__setattr__(self, "format", code_format(self.values.dtype))

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: the codes and the scales (`wire_bytes`)."""
        return self.values.numel() * self.values.element_size() + 4 * self.scales.numel()

    def codes(self) -> torch.Tensor:
        """The `numel` code values (integers in [-qmax, qmax] for int8 and int4), as fp32, unscaled."""
        out = torch.empty(self.values.numel() * self.format.codes_per_byte, dtype=torch.float32,
                          device=self.values.device)
        self.format.decode(self.values.view(torch.uint8), out, Workspace())
        return out[:self.numel]


def wire_bytes(numel: int, dtype: WireFormat = torch.int8, block: int = QUANT_BLOCK) -> int:
    """Bytes of `numel` elements quantized to `dtype` with one fp32 scale per block of `block` elements."""
    fmt = _format(dtype, block)
    return fmt.payload_bytes(numel) + 4 * math.ceil(numel / block)


def all_reduce_bytes(numel: int, world: int, dtype: WireFormat = torch.int8, block: int = QUANT_BLOCK) -> int:
    """Bytes one rank sends in `quantized_all_reduce` of `numel` elements over `world` ranks (0 for one rank)."""
    if world <= 1 or numel == 0:
        return 0
    bpr = math.ceil(math.ceil(numel / block) / world)
    return 2 * (world - 1) * wire_bytes(bpr * block, dtype, block)


def quantize(x: torch.Tensor, dtype: WireFormat = torch.int8, block: int = QUANT_BLOCK) -> Quantized:
    """Quantize a flat fp32 tensor blockwise (absmax / `qmax` per block; rounded to nearest)."""
    fmt = _format(dtype, block)
    n = x.numel()
    blocks = math.ceil(n / block)
    work = torch.zeros(blocks * block, dtype=torch.float32, device=x.device)
    work[:n].copy_(x.reshape(-1))
    raw = torch.empty(fmt.payload_bytes(blocks * block), dtype=torch.uint8, device=x.device)
    scales = torch.empty(blocks, dtype=torch.float32, device=x.device)
    fmt.quantize_blocks(work.view(blocks, block), raw.view(blocks, -1), scales, work.view(blocks, block), False,
                        Workspace())
    return Quantized(fmt.values(raw, n), scales, n, block, fmt)


def dequantize(q: Quantized) -> torch.Tensor:
    """The fp32 tensor a `Quantized` stands for (values times their block's scale)."""
    blocks, fmt = q.scales.numel(), q.format
    out = torch.empty(blocks * q.block, dtype=torch.float32, device=q.values.device)
    padded = torch.zeros(fmt.payload_bytes(blocks * q.block), dtype=torch.uint8, device=q.values.device)
    raw = q.values.view(torch.uint8)
    padded[:raw.numel()].copy_(raw)
    fmt.dequantize_blocks(padded.view(blocks, -1), q.scales, out.view(blocks, q.block), Workspace())
    return out[:q.numel]


def _format(dtype: WireFormat, block: int) -> CodeFormat:
    fmt = code_format(dtype)
    fmt.check_block(block)
    return fmt


class ErrorFeedback:
    """One fp32 residual per buffer (key), carried from one quantized all-reduce of that buffer to the next: every
    rounding error rank r made in its reduction (of its own values, of each partial sum it passed on, of the whole sum
    it rounded for the gather), so the residuals sum to exactly what the result misses and no error accumulates."""

    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}

    def residual(self, key: Any, like: torch.Tensor) -> torch.Tensor:
        """The residual of buffer `key` (zeros at first), shaped like the flat fp32 tensor `like`."""
        res = self.residuals.get(str(key))
        if res is None:
            res = self.residuals[str(key)] = torch.zeros(like.numel(), dtype=torch.float32, device=like.device)
        elif res.numel() != like.numel() or res.device != like.device:
            raise ValueError(f"error feedback residual {key!r} has {res.numel()} elements on {res.device}, "
                             f"the buffer {like.numel()} on {like.device}")
        return res

    def state_dict(self) -> dict[str, Any]:
        """Copies of the residuals (a checkpoint, or a snapshot to roll back to)."""
        return {"residuals": {k: v.clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = {k: v.clone() for k, v in state["residuals"].items()}


def p2p_carries_device_tensors(group: dist.ProcessGroup | None, device: torch.device | str) -> bool:
    """Whether `group`'s point-to-point send/recv carry tensors on `device` as they are: always on the CPU; on a
    device, unless the group's backend for that device type is gloo, whose send/recv hand the tensor's pointer to
    its TCP transport with no CUDA path (its all-reduce, all-gather and broadcast copy CUDA tensors through host
    memory themselves, so only point to point needs staging)."""
    device = torch.device(device)
    return device.type == "cpu" or _backend_for(group, device.type) != "gloo"


def _backend_for(group: dist.ProcessGroup | None, device_type: str) -> str:
    """The name of `group`'s backend for `device_type` ("cpu:gloo,cuda:nccl" names one per device type)."""
    config = dist.get_backend_config(group)
    for part in config.split(","):
        where, _, name = part.strip().rpartition(":")
        if where in ("", device_type):
            return name
    return str(dist.get_backend(group))


_staging_logged = False


def _log_staging(group: dist.ProcessGroup | None, device: torch.device, forced: bool) -> None:
    global _staging_logged
    if not _staging_logged:
        _staging_logged = True
        why = "as asked" if forced else f"its {_backend_for(group, device.type)} send/recv cannot carry them"
        _log.info("the quantized ring stages its %s tensors through pinned host buffers (%s)", device.type, why)


def _exchange(send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup | None, nxt: int, prev: int,
              host: tuple[torch.Tensor, torch.Tensor] | None, bound: datetime.timedelta) -> None:
    """One ring step: `send` to rank `nxt` while `recv` comes from `prev`; `host`: through these host buffers."""
    out, into = (send, recv) if host is None else host
    if host is not None:
        out.copy_(send)  # a blocking copy: the bytes are in host memory before the send reads them
    ops = [dist.P2POp(dist.isend, out, group=group, group_peer=nxt),
           dist.P2POp(dist.irecv, into, group=group, group_peer=prev)]
    for work in dist.batch_isend_irecv(ops):
        wait_for(work, "a ring step", bound)
    if host is not None:
        recv.copy_(into)  # blocking too: `into` is free for the next step's receive


@torch.no_grad()
def quantized_all_reduce(flat: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                         dtype: WireFormat = torch.int8, block: int = QUANT_BLOCK,
                         residual: torch.Tensor | None = None, workspace: Workspace | None = None,
                         stage: bool | None = None, timeout: float | None = None) -> int:
    """SUM a flat fp32 tensor over `group` in place, through a quantized wire (module docstring); return bytes sent.

    `residual` (from `ErrorFeedback.residual`) is added to `flat` first and replaced by the rounding errors this
    rank made. Every rank ends with bit-identical `flat`. One rank: nothing is sent and `flat` stays exact. A ring
    of W - 1 point-to-point steps, then one all_gather_single, on uint8 rows: the same on gloo and NCCL. The input
    must be finite (a NaN or inf spoils its block). If a collective fails, `flat` and `residual` are left
    undefined (`flat` is the scratch). `stage`: send and receive the ring's steps through pinned host buffers
    (None: where `p2p_carries_device_tensors` says the group cannot carry `flat`'s device; True also on the CPU,
    which the tests use: the result is the same bytes). `timeout`: seconds each ring step may wait (None: the
    group's own).
    """
    fmt = _format(dtype, block)
    if flat.dtype != torch.float32 or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"quantized_all_reduce needs a flat contiguous fp32 tensor, got {flat.dtype} "
                         f"{tuple(flat.shape)}")
    world, me, n = dist.get_world_size(group), dist.get_rank(group), flat.numel()
    if world == 1 or n == 0:
        return 0
    ws, dev, ef = workspace or Workspace(), flat.device, residual is not None
    bpr = math.ceil(math.ceil(n / block) / world)
    chunk = bpr * block
    payload = fmt.payload_bytes(chunk)
    row = payload + 4 * bpr
    # `flat` is the scratch: it holds this rank's values, then the partial sums, then the errors, then the result;
    # the chunks past its end (the last one partial, the rest padding) live zero-padded in `tail`
    full, rest = n // chunk, n % chunk
    tail = ws.get("tail", (world - full) * chunk, torch.float32, dev) if full < world else None
    if ef:
        flat.add_(residual)
    if tail is not None:
        tail[:rest].copy_(flat[full * chunk:])
        tail[rest:].zero_()

    def acc(c: int) -> torch.Tensor:  # chunk c of this rank's values / partial sums, (bpr, block)
        return (flat[c * chunk:(c + 1) * chunk] if c < full else tail[(c - full) * chunk:(c - full + 1) * chunk]
                ).view(bpr, block)

    send, recv = (ws.get(name, row, torch.uint8, dev) for name in ("send", "recv"))
    forced = bool(stage)
    host = None
    if stage or stage is None and not p2p_carries_device_tensors(group, dev):
        host = ws.get("host_send", row, torch.uint8, "cpu", pinned=True), ws.get("host_recv", row, torch.uint8,
                                                                                  "cpu", pinned=True)
        _log_staging(group, dev, forced)
    part = ws.get("part", chunk, torch.float32, dev).view(bpr, block)
    scales = ws.get("scales", bpr, torch.float32, dev)

    def encode(c: int, out: torch.Tensor) -> None:  # chunk c -> out (codes, then scales); errors stay in chunk c
        fmt.quantize_blocks(acc(c), out[:payload].view(bpr, -1), scales, part if ef else acc(c), ef, ws)
        out[payload:].copy_(scales.view(torch.uint8))

    # 1. reduce-scatter around the ring: at step k rank r passes chunk r - k on (its own values at k = 0, else the
    #    partial sum it received and added to), and adds its own fp32 values to chunk r - k - 1 coming from r - 1
    nxt, prev = (me + 1) % world, (me - 1) % world
    bound = group_timeout(group, dev) if timeout is None else datetime.timedelta(seconds=timeout)
    for k in range(world - 1):
        encode((me - k) % world, send)
        _exchange(send, recv, group, nxt, prev, host, bound)
        fmt.accumulate_blocks(recv[:payload].view(bpr, -1), _floats(recv[payload:]), acc((me - k - 1) % world), part,
                              ws)  # the sum, in fp32
    # 2. rank r holds the whole sum of chunk r + 1: round it once more and gather every rank's, in rank order
    mine = ws.get("mine", row, torch.uint8, dev)
    encode((me + 1) % world, mine)
    if ef:  # every chunk now holds the rounding error this rank made on it
        residual[:full * chunk].copy_(flat[:full * chunk])
        if tail is not None:
            residual[full * chunk:].copy_(tail[:rest])
    rows = ws.get("rows", world * row, torch.uint8, dev).view(world, row)
    bounded(all_gather_single, rows.view(-1), mine, group=group)
    # 3. every rank decodes the same bytes: row j is chunk j + 1
    for j in range(world):
        c = (j + 1) % world
        if c > full or (c == full and not rest):
            continue  # padding
        codes, row_scales = rows[j, :payload].view(bpr, -1), _floats(rows[j, payload:])
        if c < full:
            fmt.dequantize_blocks(codes, row_scales, flat[c * chunk:(c + 1) * chunk].view(bpr, block), ws)
        else:
            fmt.dequantize_blocks(codes, row_scales, part, ws)
            flat[c * chunk:].copy_(part.view(-1)[:rest])
    return 2 * (world - 1) * row


def _floats(raw: torch.Tensor) -> torch.Tensor:
    """The fp32 scales stored as bytes in `raw` (copied when they are not 4-byte aligned)."""
    return (raw if raw.storage_offset() % 4 == 0 else raw.clone()).view(torch.float32)


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
