"""Blockwise quantization (one fp32 scale per block: absmax / the format's largest code, `quant_codes`) and the
quantized all-reduce of a flat fp32 tensor, summed in fp32: a ring (as INTELLECT-1's) reduce-scatters W chunks of
whole blocks, each partial sum quantized to travel, then all-gathers each rank's whole sum, quantized once more, as
uint8 rows (gloo refuses float8), so every rank decodes the same bytes. A rank sends 2 (W - 1) rows
(`all_reduce_bytes`), about (1 + 4 / block) / 4 of a ring fp32 all-reduce ((1/2 + 4 / block) / 4 at 4 bits); the
result carries W roundings per element, which `ErrorFeedback` keeps from accumulating over repeated reductions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from flwr_sharded.parallel.quant_codes import CodeFormat, Workspace, code_format
from flwr_sharded.parallel.wire_base import QUANT_BLOCK

_TINY = torch.finfo(torch.float32).tiny  # smallest scale: an all-zero block quantizes to zeros, never divides by 0

WireFormat = torch.dtype | str | CodeFormat
"""A quantized wire's format as the functions here take it: a torch dtype (torch.int8, a float8, torch.int4,
torch.float4_e2m1fn_x2), a wire name ("int4", "float4_e2m1") or a `flwr_sharded.parallel.quant_codes.CodeFormat`."""


def qmax(dtype: WireFormat) -> float:
    """The largest code of a format (127 for int8, 448 for e4m3, 57344 for e5m2, 7 for int4, 6 for e2m1): a block's
    absmax maps onto it."""
    return code_format(dtype).qmax


@dataclass(frozen=True)
class Quantized:
    """A flat tensor blockwise quantized: `values`, the codes as they travel (for a one-byte format `numel` of them in
    its dtype; for a 4-bit one ceil(numel / 2) uint8 bytes, two codes each), and one fp32 scale per block."""

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
    _quantize(fmt, work.view(blocks, block), raw.view(blocks, -1), scales, work.view(blocks, block), False,
              Workspace())
    return Quantized(fmt.values(raw, n), scales, n, block, fmt)


def dequantize(q: Quantized) -> torch.Tensor:
    """The fp32 tensor a `Quantized` stands for (values times their block's scale)."""
    blocks, fmt = q.scales.numel(), q.format
    out = torch.empty(blocks * q.block, dtype=torch.float32, device=q.values.device)
    padded = torch.zeros(fmt.payload_bytes(blocks * q.block), dtype=torch.uint8, device=q.values.device)
    raw = q.values.view(torch.uint8)
    padded[:raw.numel()].copy_(raw)
    _dequantize(fmt, padded.view(blocks, -1), q.scales, out.view(blocks, q.block), Workspace())
    return out[:q.numel]


def _format(dtype: WireFormat, block: int) -> CodeFormat:
    fmt = code_format(dtype)
    fmt.check_block(block)
    return fmt


def _quantize(fmt: CodeFormat, src: torch.Tensor, raw: torch.Tensor, scales: torch.Tensor, scratch: torch.Tensor,
              error: bool, ws: Workspace) -> None:
    """Quantize `src` (..., block) into the bytes `raw` (..., payload per block) and `scales` (...), through
    `scratch` (`src` itself unless `error`); with `error`, `src` ends holding its rounding error, in fp32."""
    absmax = torch.maximum(src.amax(-1), src.amin(-1).neg_())  # no |x| temporary (aminmax is slower on CPU)
    torch.div(absmax, fmt.qmax, out=scales).clamp_(min=_TINY)
    torch.mul(src, scales.reciprocal().unsqueeze(-1), out=scratch)  # |.| <= qmax (+ an ulp: rounds back to it)
    fmt.encode(scratch, raw, ws, keep=error)
    if error:
        src.addcmul_(scratch, scales.unsqueeze(-1), value=-1)


def _dequantize(fmt: CodeFormat, raw: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, ws: Workspace) -> None:
    """out (..., block) = codes * scales, in fp32 (a decode and a multiply: a mixed-dtype multiply is ~3x slower)."""
    fmt.decode(raw, out, ws)
    out.mul_(scales.unsqueeze(-1))


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


@torch.no_grad()
def quantized_all_reduce(flat: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                         dtype: WireFormat = torch.int8, block: int = QUANT_BLOCK,
                         residual: torch.Tensor | None = None, workspace: Workspace | None = None) -> int:
    """SUM a flat fp32 tensor over `group` in place, through a quantized wire (module docstring); return bytes sent.

    `residual` (from `ErrorFeedback.residual`) is added to `flat` first and replaced by the rounding errors this
    rank made. Every rank ends with bit-identical `flat`. One rank: nothing is sent and `flat` stays exact. A ring
    of W - 1 point-to-point steps, then one all_gather_single, on uint8 rows: the same on gloo and NCCL. The input
    must be finite (a NaN or inf spoils its block). If a collective fails, `flat` and `residual` are left
    undefined (`flat` is the scratch).
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
    part = ws.get("part", chunk, torch.float32, dev).view(bpr, block)
    scales = ws.get("scales", bpr, torch.float32, dev)

    def encode(c: int, out: torch.Tensor) -> None:  # chunk c -> out (codes, then scales); errors stay in chunk c
        _quantize(fmt, acc(c), out[:payload].view(bpr, -1), scales, part if ef else acc(c), ef, ws)
        out[payload:].copy_(scales.view(torch.uint8))

    # 1. reduce-scatter around the ring: at step k rank r passes chunk r - k on (its own values at k = 0, else the
    #    partial sum it received and added to), and adds its own fp32 values to chunk r - k - 1 coming from r - 1
    nxt, prev = (me + 1) % world, (me - 1) % world
    for k in range(world - 1):
        encode((me - k) % world, send)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, group=group, group_peer=nxt),
                                            dist.P2POp(dist.irecv, recv, group=group, group_peer=prev)]):
            work.wait()
        fmt.decode(recv[:payload].view(bpr, -1), part, ws)
        acc((me - k - 1) % world).addcmul_(part, _floats(recv[payload:]).unsqueeze(-1))  # the sum, in fp32
    # 2. rank r holds the whole sum of chunk r + 1: round it once more and gather every rank's, in rank order
    mine = ws.get("mine", row, torch.uint8, dev)
    encode((me + 1) % world, mine)
    if ef:  # every chunk now holds the rounding error this rank made on it
        residual[:full * chunk].copy_(flat[:full * chunk])
        if tail is not None:
            residual[full * chunk:].copy_(tail[:rest])
    rows = ws.get("rows", world * row, torch.uint8, dev).view(world, row)
    dist.all_gather_single(rows.view(-1), mine, group=group)
    # 3. every rank decodes the same bytes: row j is chunk j + 1
    for j in range(world):
        c = (j + 1) % world
        if c > full or (c == full and not rest):
            continue  # padding
        codes, row_scales = rows[j, :payload].view(bpr, -1), _floats(rows[j, payload:])
        if c < full:
            _dequantize(fmt, codes, row_scales, flat[c * chunk:(c + 1) * chunk].view(bpr, block), ws)
        else:
            _dequantize(fmt, codes, row_scales, part, ws)
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
