"""An 8-bit all-reduce of a flat fp32 tensor: blockwise int8 or fp8 (e4m3) on the wire, the sum taken in fp32.

Quantization: the tensor is cut into blocks of `block` elements (the last one may be partial, padded with zeros);
each block has one fp32 scale, absmax / 127 for int8 (symmetric, rounded to nearest) or absmax / 448 for
float8_e4m3fn (rounded to nearest by the cast), so a block's largest element maps to the largest code and an
outlier only coarsens its own block. `wire_bytes(n, dtype, block)` = n + 4 ceil(n / block).

`quantized_all_reduce` (as torchft's and INTELLECT-1's int8 all-reduce), on a group of W ranks:
  1. split the tensor into W equal chunks of whole blocks (bpr = ceil(ceil(N / block) / W) blocks, C = bpr * block
     elements each; the end is zero-padded, as gloo's all-to-all needs equal splits), quantize every chunk;
  2. all_to_all: rank r receives every rank's copy of chunk r (values and scales travel as one uint8 row of
     C + 4 bpr bytes; gloo refuses float8 tensors in collectives, so every 8-bit payload travels as raw bytes);
  3. rank r sums its own chunk in fp32 (its own values as they are, never quantized) and the W - 1 others'
     dequantized copies in rank order, and re-quantizes the sum;
  4. all_gather the W reduced rows; every rank dequantizes the same bytes, so all end bit-identical.
Each rank sends (W - 1) rows in each of the two collectives: 2 (W - 1) (C + 4 bpr) bytes
(`all_reduce_bytes`), about (1 + 4 / block) / 4 of a ring fp32 all-reduce's 2 (W - 1) / W * 4 N bytes once
N >> W block (the padding is at most W blocks: a tensor of a few blocks sends more than its fp32 ring would).
The result is the sum with two roundings: each element is off by at most sum_r s1_r / 2 + s2 / 2 for int8, with
s1_r the block scale of rank r's contribution (0 for the owner's) and s2 that of the reduced block (e4m3: 1/16 of
each rounded value, or scale / 1024 below the normal range, instead of half a step).

Error feedback (`ErrorFeedback`) makes the running sum of repeated reductions exact up to one round's error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from flwr_sharded.errors import ConfigError

WIRE_DTYPES = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn}
"""The 8-bit wire dtypes by their `--sync-dtype` name."""
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
"""Largest code of each wire dtype: a block's absmax maps onto it."""
_TINY = torch.finfo(torch.float32).tiny  # smallest scale: an all-zero block quantizes to zeros, never divides by 0
_E4M3_TABLE = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()  # code -> value


@dataclass(frozen=True)
class Quantized:
    """A flat tensor in 8 bits: `values` (int8 or float8_e4m3fn, `numel` of them) and one fp32 scale per block."""

    values: torch.Tensor
    scales: torch.Tensor
    numel: int
    block: int


def wire_bytes(numel: int, dtype: torch.dtype = torch.int8, block: int = 256) -> int:
    """Bytes of `numel` elements quantized to `dtype` with one fp32 scale per block of `block` elements."""
    _check_dtype(dtype, block)
    return numel * torch.empty((), dtype=dtype).element_size() + 4 * math.ceil(numel / block)


def all_reduce_bytes(numel: int, world: int, dtype: torch.dtype = torch.int8, block: int = 256) -> int:
    """Bytes one rank sends in `quantized_all_reduce` of `numel` elements over `world` ranks (0 for one rank)."""
    if world <= 1 or numel == 0:
        return 0
    bpr = math.ceil(math.ceil(numel / block) / world)
    return 2 * (world - 1) * wire_bytes(bpr * block, dtype, block)


def quantize(x: torch.Tensor, dtype: torch.dtype = torch.int8, block: int = 256) -> Quantized:
    """Quantize a flat fp32 tensor blockwise (int8: absmax / 127 per block, round to nearest; fp8 e4m3: / 448)."""
    _check_dtype(dtype, block)
    n = x.numel()
    blocks = math.ceil(n / block)
    work = torch.zeros(blocks * block, dtype=torch.float32, device=x.device)
    work[:n].copy_(x.reshape(-1))
    values = torch.empty(blocks * block, dtype=dtype, device=x.device)
    scales = torch.empty(blocks, dtype=torch.float32, device=x.device)
    _quantize(work.view(blocks, block), values.view(blocks, block), scales, work.view(blocks, block))
    return Quantized(values[:n], scales, n, block)


def dequantize(q: Quantized) -> torch.Tensor:
    """The fp32 tensor a `Quantized` stands for (values times their block's scale)."""
    blocks = q.scales.numel()
    out = torch.empty(blocks * q.block, dtype=torch.float32, device=q.values.device)
    padded = torch.zeros(blocks * q.block, dtype=q.values.dtype, device=q.values.device)
    padded[:q.numel].copy_(q.values)
    _dequantize(padded.view(blocks, q.block), q.scales, out.view(blocks, q.block), Workspace())
    return out[:q.numel]


def _check_dtype(dtype: torch.dtype, block: int) -> None:
    if dtype not in QMAX:
        raise ValueError(f"quantized wire dtype must be one of {', '.join(map(str, QMAX))}, got {dtype}")
    if block < 1:
        raise ValueError(f"quantization block must be >= 1 element, got {block}")


def _quantize(src: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, scratch: torch.Tensor,
              error: bool = False, ws: Workspace | None = None) -> None:
    """Quantize `src` (..., block) into `values` (same shape, 8-bit) and `scales` (...), through `scratch`.

    `scratch` may be `src` itself unless `error`; with `error`, `src` ends holding its rounding error
    (src - values * scales, in fp32).
    """
    absmax = torch.maximum(src.amax(-1), src.amin(-1).neg_())  # no |x| temporary: two reductions, in place
    torch.div(absmax, QMAX[values.dtype], out=scales).clamp_(min=_TINY)
    torch.mul(src, scales.reciprocal().unsqueeze(-1), out=scratch)  # |.| <= QMAX (+ an ulp: rounds back to it)
    if values.dtype == torch.int8:
        scratch.round_()  # half to even; the cast below then is exact
        values.copy_(scratch)
    else:
        values.copy_(scratch)  # the cast to e4m3 rounds to nearest
        if error:
            _decode(values, scratch, ws or Workspace())
    if error:
        src.addcmul_(scratch, scales.unsqueeze(-1), value=-1)


def _decode(values: torch.Tensor, out: torch.Tensor, ws: Workspace) -> None:
    """out = values as fp32. On CPU, e4m3 goes through a 256-entry table (8x faster than torch's cast there)."""
    if values.dtype == torch.int8 or values.device.type != "cpu":
        out.copy_(values)
        return
    index = ws.get("index", values.numel(), torch.int32, values.device).view(values.shape)
    index.copy_(values.view(torch.uint8))
    torch.index_select(_E4M3_TABLE, 0, index.view(-1), out=out.view(-1))  # `out` is contiguous here


def _dequantize(values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, ws: Workspace) -> None:
    """out (..., block) = values * scales, in fp32 (a cast and a multiply: a mixed-dtype multiply is ~3x slower)."""
    _decode(values, out, ws)
    out.mul_(scales.unsqueeze(-1))


class Workspace:
    """Reusable byte buffers for `quantized_all_reduce` (first touching fresh memory costs more than quantizing)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < nbytes or buf.device != device:
            buf = self._buffers[name] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes].view(dtype)


class ErrorFeedback:
    """One fp32 residual per buffer (key), carried from one quantized all-reduce of that buffer to the next.

    What is fed back, on each rank r: residual_r = (x_r + residual_r) - dequantize(quantize(x_r + residual_r)),
    this rank's rounding error before the reduce, plus, on the chunk rank r owns, the rounding error of the reduced
    sum (the second quantization, which only the owner sees; adding it to one rank's next contribution counts it
    once). The sum of the residuals is then exactly what this round's result misses, so the running sum of the
    results stays within one round's error of the exact running sum (a rank that leaves takes its residual along).
    Feeding back only the first error would leave the second one to accumulate, round after round.
    """

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


def _whole_blocks(t: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, full: int, whole: int,
                  block: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(part of flat `t`, its codes, its scales) for t's whole blocks: `full` whole chunks, then `whole` blocks."""
    bpr = codes.shape[1]
    parts = [(t[:full * bpr * block].view(full, bpr, block), codes[:full], scales[:full])]
    if whole:
        start = full * bpr * block
        parts.append((t[start:start + whole * block].view(whole, block), codes[full, :whole], scales[full, :whole]))
    return [p for p in parts if p[0].numel()]


@torch.no_grad()
def quantized_all_reduce(flat: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                         dtype: torch.dtype = torch.int8, block: int = 256, residual: torch.Tensor | None = None,
                         workspace: Workspace | None = None) -> int:
    """SUM a flat fp32 tensor over `group` in place, through an 8-bit wire (module docstring); return bytes sent.

    `residual` (from `ErrorFeedback.residual`) is added to `flat` first and replaced by the new rounding errors.
    Every rank ends with bit-identical `flat`. One rank: nothing is sent and `flat` stays exact. Two collectives
    (all_to_all_single, all_gather_single) on uint8 rows, the same on gloo and NCCL. The input must be finite (a
    NaN or inf spoils its block). If a collective fails, `flat` is left undefined (it is scratch), as is `residual`.
    """
    _check_dtype(dtype, block)
    if flat.dtype != torch.float32 or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"quantized_all_reduce needs a flat contiguous fp32 tensor, got {flat.dtype} "
                         f"{tuple(flat.shape)}")
    world, me, n = dist.get_world_size(group), dist.get_rank(group), flat.numel()
    if world == 1 or n == 0:
        return 0
    ws, dev, ef = workspace or Workspace(), flat.device, residual is not None
    bpr = math.ceil(math.ceil(n / block) / world)
    chunk, row = bpr * block, bpr * block + 4 * bpr
    full = n // chunk  # whole chunks in `flat`; then `whole` whole blocks and `rem` elements; the rest is padding
    whole, rem = divmod(n - full * chunk, block)
    send = ws.get("send", world * row, torch.uint8, dev).view(world, row)
    scales = ws.get("scales", world * bpr, torch.float32, dev).view(world, bpr)
    codes = send.view(dtype)[:, :chunk].view(world, bpr, block)
    pad = ws.get("pad", 2 * block, torch.float32, dev).view(2, 1, block)  # the partial block (source, scratch)

    # 1. quantize every chunk but this rank's own (which it adds in fp32), from x + residual with feedback
    src = residual.add_(flat) if ef else flat  # `flat` is the scratch
    for lo, hi in ((0, min(me, full)), (me + 1, full)):
        if lo < hi:
            _quantize(src[lo * chunk:hi * chunk].view(-1, bpr, block), codes[lo:hi], scales[lo:hi],
                      flat[lo * chunk:hi * chunk].view(-1, bpr, block), ef, ws)
    if full < world:
        empty = full + 1 if rem or whole else full  # the first chunk that is all padding
        if me != full and empty > full:
            if whole:
                part_blocks = slice(full * chunk, full * chunk + whole * block)
                _quantize(src[part_blocks].view(whole, block), codes[full, :whole], scales[full, :whole],
                          flat[part_blocks].view(whole, block), ef, ws)
            if rem:
                pad[0, 0, :rem].copy_(src[n - rem:])
                pad[0, 0, rem:].zero_()
                _quantize(pad[0], codes[full, whole:whole + 1], scales[full, whole:whole + 1], pad[1 if ef else 0],
                          ef, ws)
                if ef:
                    residual[n - rem:].copy_(pad[0, 0, :rem])
            codes[full, whole + (1 if rem else 0):].view(torch.uint8).zero_()
            scales[full, whole + (1 if rem else 0):].zero_()
        codes[empty:].view(torch.uint8).zero_()
        scales[empty:].zero_()
    send[:, chunk:].copy_(scales.view(torch.uint8))

    # 2. exchange; sum this rank's chunk (its own fp32 values, then the others' in rank order) and re-quantize it
    recv = ws.get("recv", world * row, torch.uint8, dev).view(world, row)
    dist.all_to_all_single(recv, send, group=group)  # recv[r]: rank r's copy of the chunk this rank owns
    part = ws.get("part", chunk, torch.float32, dev).view(bpr, block)
    own = slice(min(me * chunk, n), min((me + 1) * chunk, n))
    if own.stop - own.start == chunk:  # sum in place: with feedback, residual's slice ends as the sum's error
        acc, scratch = src[own].view(bpr, block), (flat[own].view(bpr, block) if ef else None)
    else:
        acc, scratch = ws.get("acc", chunk, torch.float32, dev).view(bpr, block), (part if ef else None)
        acc.view(-1)[:own.stop - own.start].copy_(src[own])
        acc.view(-1)[own.stop - own.start:].zero_()
    theirs = recv[:, chunk:].contiguous().view(torch.float32)
    recv_codes = recv.view(dtype)[:, :chunk].view(world, bpr, block)
    for r in range(world):
        if r != me:
            _decode(recv_codes[r], part, ws)
            acc.addcmul_(part, theirs[r].unsqueeze(-1))
    mine = ws.get("mine", row, torch.uint8, dev)
    mine_scales = ws.get("mine_scales", bpr, torch.float32, dev)
    _quantize(acc, mine.view(dtype)[:chunk].view(bpr, block), mine_scales, acc if scratch is None else scratch, ef,
              ws)
    mine[chunk:].copy_(mine_scales.view(torch.uint8))
    if ef and acc.data_ptr() != src[own].data_ptr():
        residual[own].copy_(acc.view(-1)[:own.stop - own.start])

    # 3. gather the reduced chunks; every rank decodes the same bytes
    dist.all_gather_single(send.view(-1), mine, group=group)  # `send` is free again: it receives the reduced rows
    reduced = send[:, chunk:].contiguous().view(torch.float32)
    for part_, c, s in _whole_blocks(flat, codes, reduced, full, whole, block):
        _dequantize(c, s, part_, ws)
    if rem:
        _dequantize(codes[full, whole:whole + 1], reduced[full, whole:whole + 1], pad[0], ws)
        flat[n - rem:].copy_(pad[0, 0, :rem])
    return 2 * (world - 1) * row


def fp8_supported(device: torch.device | str) -> bool:
    """Whether float8_e4m3fn is a wire dtype on `device`: CUDA with compute capability >= 8.9 (hardware e4m3
    conversion; below it torch emulates the cast), or a CPU on which torch casts to and from e4m3 exactly."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)
    if device.type != "cpu":
        return False
    probe = torch.tensor([448.0, -1.125, 2.0**-9, 0.0])  # largest normal, a 3-bit mantissa, smallest subnormal
    try:
        return bool(torch.equal(probe.to(torch.float8_e4m3fn).float(), probe))
    except (RuntimeError, TypeError):
        return False


def check_wire_dtype(dtype_name: str, device: torch.device | str) -> torch.dtype:
    """The torch dtype of a quantized `--sync-dtype` on `device`; ConfigError if it is unknown or unsupported."""
    allowed = ["int8"] + (["float8_e4m3fn"] if fp8_supported(device) else [])
    if dtype_name not in allowed:
        why = "is not a quantized wire dtype" if dtype_name not in WIRE_DTYPES else (
            f"needs a CPU whose torch casts to e4m3 or CUDA compute capability >= 8.9, not {torch.device(device)}")
        raise ConfigError(f"--sync-dtype {dtype_name} {why}; quantized wire dtypes on {torch.device(device)}: "
                          f"{', '.join(allowed)}")
    return WIRE_DTYPES[dtype_name]
