"""The quantized ring all-reduce (as INTELLECT-1's): a flat fp32 tensor summed through a blockwise codec
(`parallel.codecs`), in fp32. W chunks of whole blocks are reduce-scattered, each partial sum quantized to travel,
then each rank's whole sum is quantized once more and all-gathered as uint8 rows (gloo refuses float8), so every rank
decodes the same bytes. A rank sends 2 (W - 1) rows (`all_reduce_bytes`), about (bits / 8 + 4 / block) / 4 of a ring
fp32 all-reduce; the result carries W roundings per element, which error feedback (`global_state.ErrorFeedback`)
keeps from accumulating. Where the group's backend cannot send device tensors point to point (gloo: its send/recv
have no CUDA path), the ring's steps travel through persistent pinned host buffers (`p2p_carries_device_tensors`);
its all-gather needs none (gloo's all-gather copies CUDA tensors through host memory itself).
"""

from __future__ import annotations

import datetime
import logging
import math

import torch
import torch.distributed as dist

from flwr_sharded.parallel.codecs.base import BlockCodec
from flwr_sharded.parallel.codecs.blockwise import WireFormat, block_codec, wire_bytes
from flwr_sharded.parallel.collectives import bounded, group_timeout, wait_for
from flwr_sharded.parallel.torch_compat import all_gather_single
from flwr_sharded.parallel.wire_base import QUANT_BLOCK
from flwr_sharded.parallel.workspace import Workspace

_log = logging.getLogger(__name__)


def all_reduce_bytes(numel: int, world: int, dtype: WireFormat = torch.int8, block: int = QUANT_BLOCK) -> int:
    """Bytes one rank sends in `quantized_all_reduce` of `numel` elements over `world` ranks (0 for one rank)."""
    if world <= 1 or numel == 0:
        return 0
    bpr = math.ceil(math.ceil(numel / block) / world)
    return 2 * (world - 1) * wire_bytes(bpr * block, dtype, block)


# ------------------------------------------------------------------------------------------- staging through host

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


def _host_buffers(group: dist.ProcessGroup | None, device: torch.device, row: int, ws: Workspace,
                  stage: bool | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The pinned host buffers a ring step travels through (`stage`: as asked; None: where the group's send/recv
    cannot carry `device`'s tensors), or None."""
    if not (stage or stage is None and not p2p_carries_device_tensors(group, device)):
        return None
    host = (ws.get("host_send", row, torch.uint8, "cpu", pinned=True),
            ws.get("host_recv", row, torch.uint8, "cpu", pinned=True))
    _log_staging(group, device, bool(stage))
    return host


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


def ring_reduce_scatter(whole: torch.Tensor, share: torch.Tensor, group: dist.ProcessGroup | None,
                        workspace: Workspace) -> None:
    """SUM `whole` (W equal chunks, one per rank of `group`) over the group: this rank's chunk of the sum into
    `share`, around a ring of W - 1 point-to-point steps, each rank sending (W - 1) / W of `whole` (gloo's own
    reduce-scatter sends as much as an all-reduce). `whole` is the scratch (its chunks hold partial sums after)."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    chunks = whole.view(world, -1)
    if world == 1:
        share.copy_(chunks[0])
        return
    nbytes = chunks[0].numel() * chunks.element_size()
    recv = workspace.get("ring_rs_recv", chunks[0].numel(), whole.dtype, whole.device)
    host = _host_buffers(group, whole.device, nbytes, workspace, None)
    nxt, prev, bound = (me + 1) % world, (me - 1) % world, group_timeout(group, whole.device)
    for k in range(world - 1):  # at step k rank r passes on the partial sum of chunk r - k - 1 and adds to r - k - 2
        _exchange(chunks[(me - k - 1) % world].view(torch.uint8), recv.view(torch.uint8), group, nxt, prev, host,
                  bound)
        chunks[(me - k - 2) % world].add_(recv)
    share.copy_(chunks[me])


# ------------------------------------------------------------------------------------------------------- the ring

class _RingChunks:
    """A flat tensor's W chunks of whole blocks and their rows on the wire (codes, then fp32 scales). `flat` is the
    scratch: it holds this rank's values, then the partial sums, then the errors, then the result; the chunks past
    its end (the last one partial, the rest padding) live zero-padded in `tail`."""

    def __init__(self, flat: torch.Tensor, codec: BlockCodec, block: int, world: int, ws: Workspace,
                 residual: torch.Tensor | None) -> None:
        n, dev = flat.numel(), flat.device
        self.flat, self.codec, self.block, self.ws, self.residual = flat, codec, block, ws, residual
        self.bpr = math.ceil(math.ceil(n / block) / world)
        self.chunk = self.bpr * block
        self.payload = codec.payload_bytes(self.chunk)
        self.row = self.payload + 4 * self.bpr
        self.full, self.rest = n // self.chunk, n % self.chunk
        self.tail = ws.get("tail", (world - self.full) * self.chunk, torch.float32, dev) if self.full < world else None
        self.part = ws.get("part", self.chunk, torch.float32, dev).view(self.bpr, self.block)
        self.scales = ws.get("scales", self.bpr, torch.float32, dev)

    def load(self) -> None:
        """Add the residual to `flat` and copy its last chunks into `tail`."""
        if self.residual is not None:
            self.flat.add_(self.residual)
        if self.tail is not None:
            self.tail[:self.rest].copy_(self.flat[self.full * self.chunk:])
            self.tail[self.rest:].zero_()

    def acc(self, c: int) -> torch.Tensor:
        """Chunk c of this rank's values / partial sums, (bpr, block)."""
        chunk, full = self.chunk, self.full
        return (self.flat[c * chunk:(c + 1) * chunk] if c < full
                else self.tail[(c - full) * chunk:(c - full + 1) * chunk]).view(self.bpr, self.block)

    def encode(self, c: int, out: torch.Tensor) -> None:
        """Chunk c -> the row `out` (codes, then scales); with error feedback its rounding errors stay in chunk c."""
        ef = self.residual is not None
        self.codec.quantize_blocks(self.acc(c), out[:self.payload].view(self.bpr, -1), self.scales,
                                   self.part if ef else self.acc(c), ef, self.ws)
        out[self.payload:].copy_(self.scales.view(torch.uint8))

    def accumulate(self, c: int, row: torch.Tensor) -> None:
        """Chunk c += the values of `row`, in fp32."""
        self.codec.accumulate_blocks(row[:self.payload].view(self.bpr, -1), _floats(row[self.payload:]), self.acc(c),
                                     self.part, self.ws)

    def keep_errors(self) -> None:
        """The residual = the rounding errors this rank made, which every chunk now holds."""
        full = self.full * self.chunk
        self.residual[:full].copy_(self.flat[:full])
        if self.tail is not None:
            self.residual[full:].copy_(self.tail[:self.rest])

    def decode(self, rows: torch.Tensor) -> None:
        """`flat` = the sums in `rows` (row j is chunk j + 1), decoded from the same bytes on every rank."""
        flat, chunk, world = self.flat, self.chunk, rows.shape[0]
        for j in range(world):
            c = (j + 1) % world
            if c > self.full or (c == self.full and not self.rest):
                continue  # padding
            codes, row_scales = rows[j, :self.payload].view(self.bpr, -1), _floats(rows[j, self.payload:])
            whole = c < self.full
            out = flat[c * chunk:(c + 1) * chunk].view(self.bpr, self.block) if whole else self.part
            self.codec.dequantize_blocks(codes, row_scales, out, self.ws)
            if not whole:
                flat[c * chunk:].copy_(self.part.view(-1)[:self.rest])


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
    codec = block_codec(dtype, block)
    if flat.dtype != torch.float32 or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"quantized_all_reduce needs a flat contiguous fp32 tensor, got {flat.dtype} "
                         f"{tuple(flat.shape)}")
    world, me, n = dist.get_world_size(group), dist.get_rank(group), flat.numel()
    if world == 1 or n == 0:
        return 0
    ws, dev = workspace or Workspace(), flat.device
    chunks = _RingChunks(flat, codec, block, world, ws, residual)
    chunks.load()
    send, recv = (ws.get(name, chunks.row, torch.uint8, dev) for name in ("send", "recv"))
    host = _host_buffers(group, dev, chunks.row, ws, stage)
    # 1. reduce-scatter around the ring: at step k rank r passes chunk r - k on (its own values at k = 0, else the
    #    partial sum it received and added to), and adds its own fp32 values to chunk r - k - 1 coming from r - 1
    nxt, prev = (me + 1) % world, (me - 1) % world
    bound = group_timeout(group, dev) if timeout is None else datetime.timedelta(seconds=timeout)
    for k in range(world - 1):
        chunks.encode((me - k) % world, send)
        _exchange(send, recv, group, nxt, prev, host, bound)
        chunks.accumulate((me - k - 1) % world, recv)  # the sum, in fp32
    # 2. rank r holds the whole sum of chunk r + 1: round it once more and gather every rank's, in rank order
    mine = ws.get("mine", chunks.row, torch.uint8, dev)
    chunks.encode((me + 1) % world, mine)
    if residual is not None:
        chunks.keep_errors()
    rows = ws.get("rows", world * chunks.row, torch.uint8, dev).view(world, chunks.row)
    bounded(all_gather_single, rows.view(-1), mine, group=group)
    # 3. every rank decodes the same bytes
    chunks.decode(rows)
    return 2 * (world - 1) * chunks.row


def _floats(raw: torch.Tensor) -> torch.Tensor:
    """The fp32 scales stored as bytes in `raw` (copied when they are not 4-byte aligned)."""
    return (raw if raw.storage_offset() % 4 == 0 else raw.clone()).view(torch.float32)
