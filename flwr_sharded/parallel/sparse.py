"""The top-k wire (`--sync-topk FRACTION`, SparseLoCo): per bucket, each rank keeps the ceil(FRACTION x length)
largest |x| of every chunk of `CHUNK` values of x = its delta + `decay` x its error-feedback residual (which keeps
what is not sent), as 12-bit indices (two to 3 bytes) and values in the codec the `--sync-dtype` wire names for rows
(`Wire.row_codec`: int2's is the 2-bit codebook, `flwr_sharded.parallel.codecs.codebook`), behind its weight
share. Rows have the same length on every rank (`RowLayout`): one `all_gather_single`, then every rank merges all W
rows in rank order, in fp32: each coordinate becomes the global value plus the weighted mean of what the members
that sent it sent, each row first clipped to the members' median norm (`scatter-mean`, Templar's), or plus the sum of
the weighted rows (`sum`); a row far above that median (`outlying_rows`), which the clip would hide from the move
check, rejects the sync on every rank. A rank sends (W - 1) rows, about W x FRACTION x (1.5 + value bytes) / 8 of the
fp32 ring all-reduce (at 1.5625% with int2 values: 0.0069x for 2 groups, 0.014x for 4). In two levels
(`--sync-sites`) a member selects its share of its site's sum instead (`flwr_sharded.parallel.sparse_sites`).
Torch-free to import.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from flwr_sharded.parallel.wire_base import QUANT_BLOCK, SCALE_BYTES, Wire

if TYPE_CHECKING:
    import torch

CHUNK = 4096
"""Values per top-k chunk: an index within a chunk fits `INDEX_BITS`."""
INDEX_BITS = 12
"""Bits of one kept entry's index within its chunk: two indices share 3 bytes (an odd count is padded by one)."""
HEADER_BYTES = 4
"""A row's header: its member's weight share (fp32; 0 for a member left out)."""
TopkMerge = Literal["scatter-mean", "sum"]
"""How the members' rows combine: each coordinate's weighted mean over its senders, or the sum of weighted rows."""
MERGES: tuple[str, ...] = typing.get_args(TopkMerge)
DEFAULT_MERGE: TopkMerge = "scatter-mean"
DEFAULT_ERROR_DECAY = 0.95
"""The factor on the residual before each top-k selection (SparseLoCo's beta)."""


def kept_of(length: int, fraction: float) -> int:
    """Entries kept of a chunk of `length` values: ceil(fraction x length), at least 1, at most `length`."""
    return min(length, max(1, math.ceil(round(fraction * length, 9)))) if length else 0


def _align(nbytes: int) -> int:
    return -(-nbytes // 4) * 4


@dataclass(frozen=True)
class RowLayout:
    """One rank's row of a bucket of `numel` values: [fp32 weight share][fp32 scales or codebooks][12-bit indices]
    [value codes], each field padded to 4 bytes."""

    numel: int
    fraction: float
    values: Wire
    """The wire whose format the kept values travel in (`--sync-dtype`)."""

    @property
    def full(self) -> int:
        """Whole chunks."""
        return self.numel // CHUNK

    @property
    def rest(self) -> int:
        """Values of the partial last chunk (0: none)."""
        return self.numel % CHUNK

    @property
    def per_chunk(self) -> int:
        return kept_of(CHUNK, self.fraction)

    @property
    def kept(self) -> int:
        """K: entries in the row."""
        return self.full * self.per_chunk + kept_of(self.rest, self.fraction)

    @property
    def quantized(self) -> bool:
        return self.values.error_feedback

    @property
    def codec(self) -> Any:
        """The codec of the kept values (`Wire.row_codec`; None: cast to the wire's dtype)."""
        return self.values.row_codec()

    @property
    def scale_bytes(self) -> int:
        """Bytes of the scales or codebooks (`Wire.row_side_bytes`), padded."""
        return _align(self.values.row_side_bytes(self.kept))

    @property
    def index_bytes(self) -> int:
        """Bytes of the packed indices (unpadded): K rounded up to even, 12 bits each."""
        return -(-self.kept // 2) * 2 * INDEX_BITS // 8

    @property
    def code_bytes(self) -> int:
        """Bytes of the kept values' codes (unpadded)."""
        per_value = self.values.bytes_per_value - (SCALE_BYTES / QUANT_BLOCK if self.quantized else 0.0)
        return math.ceil(round(self.kept * per_value, 6))

    @property
    def bytes(self) -> int:
        """The row's length."""
        return HEADER_BYTES + self.scale_bytes + _align(self.index_bytes) + _align(self.code_bytes)


def sent_bytes(numel: int, world: int, fraction: float, values: Wire) -> int:
    """Bytes one rank sends in a sparse reduction of `numel` values over `world` ranks: (W - 1) rows (0 for one)."""
    return (world - 1) * RowLayout(numel, fraction, values).bytes if world > 1 and numel else 0


def over_dense(fraction: float, value_bytes: float, world: int) -> float:
    """What a top-k sync of a large bucket sends over what the dense sync of the same value format sends (a ring
    all-reduce, 2 (W - 1) / W x `value_bytes` per value): W x fraction x (index + value bytes) / (2 x value bytes).
    A coded row's values take the dense wire's bytes (`wire_base.CODEBOOK_BLOCK`)."""
    return world * fraction * (INDEX_BITS / 8 + value_bytes) / (2 * value_bytes)


def _parts(flat: torch.Tensor, layout: RowLayout) -> list[tuple[torch.Tensor, int]]:
    """The chunks of a flat bucket as 2-D views with their kept entries per chunk: the whole chunks, the partial."""
    parts = []
    if layout.full:
        parts.append((flat[:layout.full * CHUNK].view(layout.full, CHUNK), layout.per_chunk))
    if layout.rest:
        parts.append((flat[layout.full * CHUNK:].view(1, layout.rest), kept_of(layout.rest, layout.fraction)))
    return parts


def _fields(row: torch.Tensor, layout: RowLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A row's (weight share, scales or codebooks, both as fp32; packed indices, codes, both as bytes)."""
    import torch

    s, i = HEADER_BYTES + layout.scale_bytes, _align(layout.index_bytes)
    return (share_of(row), row[HEADER_BYTES:s].view(torch.float32),
            row[s:s + layout.index_bytes], row[s + i:s + i + layout.code_bytes])


def pack_indices(indices: torch.Tensor, out: torch.Tensor) -> None:
    """Write indices within a chunk (< 2^12) two to 3 bytes into uint8 `out` (3 x ceil(n / 2) bytes): the first's
    low 8 bits, its high 4 and the second's low 4, the second's high 8; an odd count ends with a 0."""
    import torch

    pairs = out.view(-1, 3)
    padded = torch.zeros(2 * pairs.shape[0], dtype=torch.int32, device=indices.device)
    padded[:indices.numel()] = indices
    first, second = padded[0::2], padded[1::2]
    pairs.copy_(torch.stack([first & 0xFF, (first >> 8) | ((second & 0xF) << 4), second >> 4], dim=1))


def unpack_indices(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The first `n` indices of `pack_indices`' bytes, as int64."""
    import torch

    b = packed.view(-1, 3).long()
    return torch.stack([b[:, 0] | ((b[:, 1] & 0xF) << 8), (b[:, 1] >> 4) | (b[:, 2] << 4)], dim=1).view(-1)[:n]


def select(x: torch.Tensor, layout: RowLayout, scratch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept entries of flat fp32 `x`: (indices within their chunks, int64; values, fp32), K each, chunk by
    chunk. `scratch`: a flat fp32 buffer of x's size (|x|)."""
    import torch

    indices, values = [], []
    magnitude = torch.abs(x, out=scratch).view(torch.int32)  # the same order as the floats, and ~15% faster topk
    for (part, k), (mag, _) in zip(_parts(x, layout), _parts(magnitude, layout)):
        index = torch.topk(mag, k, dim=1, sorted=False).indices
        indices.append(index.view(-1))
        values.append(part.gather(1, index).view(-1))
    return torch.cat(indices), torch.cat(values)


def encode_row(indices: torch.Tensor, values: torch.Tensor, layout: RowLayout, row: torch.Tensor) -> torch.Tensor:
    """Write the kept entries into `row` (uint8, `layout.bytes`; the weight share is the caller's); return the values
    as every rank will decode them."""
    _, scales, index_field, codes = _fields(row, layout)
    pack_indices(indices, index_field)
    codec = layout.codec
    if codec is not None:
        return codec.encode_values(values, codes, scales)
    wire = codes.view(layout.values.torch_dtype())
    wire.copy_(values)
    return wire.float()


def decode_row(row: torch.Tensor, layout: RowLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """A row's (indices within their chunks, int64; values, fp32)."""
    _, scales, index_field, codes = _fields(row, layout)
    indices = unpack_indices(index_field, layout.kept)
    codec = layout.codec
    if codec is not None:
        return indices, codec.decode_values(codes, scales, layout.kept)
    return indices, codes.view(layout.values.torch_dtype()).float()


def share_of(row: torch.Tensor) -> torch.Tensor:
    """A row's weight share (a 1-element fp32 view of its header)."""
    import torch

    return row[:HEADER_BYTES].view(torch.float32)


def scatter(flat: torch.Tensor, layout: RowLayout, indices: torch.Tensor, values: torch.Tensor, *,
            add: bool) -> None:
    """Write (`add`: add) kept entries into a flat bucket at their chunks' positions."""
    start = 0
    for part, k in _parts(flat, layout):
        end = start + part.shape[0] * k
        index, value = indices[start:end].view(-1, k), values[start:end].view(-1, k)
        if add:
            part.scatter_add_(1, index, value)
        else:
            part.scatter_(1, index, value)
        start = end


class SparseWire(Wire):
    """This rank's delta plus its decayed residual, top `fraction` per chunk (module docstring), its values in the
    `values` wire's format, all-gathered as rows and merged in fp32 on every rank in rank order (`merge`). Needs the
    residual. `restart`: after each sync a rank's shards become the global values plus its residual (`carried`),
    which leaves the error-feedback buffer: the residual travels in the model (`scatter-mean` only)."""

    delta: ClassVar[bool] = True
    error_feedback: ClassVar[bool] = True

    def __init__(self, values: Wire, fraction: float, merge: TopkMerge = DEFAULT_MERGE,
                 decay: float = DEFAULT_ERROR_DECAY, restart: bool = False) -> None:
        if not 0 < fraction <= 1:
            raise ValueError(f"top-k fraction must be in (0, 1], got {fraction}")
        if merge not in MERGES:
            raise ValueError(f"top-k merge must be one of {', '.join(MERGES)}, got {merge!r}")
        if not 0 < decay <= 1:
            raise ValueError(f"error-feedback decay must be in (0, 1], got {decay}")
        if restart and merge == "sum":
            raise ValueError("restarting from the global values plus the residual needs a top-k sync merged by "
                             "scatter-mean")
        self.values, self.fraction, self.merge, self.decay, self.restart = values, fraction, merge, decay, restart
        self.name = values.name
        self.order = values.order
        self.bytes_per_value = fraction * (INDEX_BITS / 8 + values.bytes_per_value)
        """One row's bytes per value of the bucket (scales included, its header not); a rank sends W - 1 rows."""
        self.merged: MergedRows | None = None
        """The rows of the last merge, until `outliers` reads them."""

    def layout(self, numel: int) -> RowLayout:
        return RowLayout(numel, self.fraction, self.values)

    def dense(self) -> Wire:
        return DenseFlush(self)

    def carried(self, residual: torch.Tensor) -> torch.Tensor:
        """What of a residual a rank's shards take in when it restarts from the global model plus it (`scatter-mean`:
        the unweighted residual, decayed as the next selection would; in place)."""
        if self.merge == "sum":
            raise ValueError("a sum merge weighs the residual by the member's share: its shards cannot carry it")
        return residual.mul_(self.decay)

    def unsupported(self, device: Any) -> str | None:
        return self.values.unsupported(device)

    def reserve(self, workspace: Any, numel: int, device: Any) -> None:
        import torch

        workspace.get("magnitude", numel, torch.float32, device)
        workspace.get("mine", self.layout(numel).bytes, torch.uint8, device)

    def reduce(self, flat, global_k, scale, group, workspace, residual=None, sites=None) -> int:
        if sites is not None:  # in two levels: one row of this member's share of its site's sum crosses the sites
            return sites.topk(self, flat, global_k, scale, workspace, residual)
        import torch
        import torch.distributed as dist

        from flwr_sharded.parallel.collectives import bounded
        from flwr_sharded.parallel.torch_compat import all_gather_single

        if residual is None and scale:
            raise ValueError("a top-k sync keeps what it does not send in the error-feedback residual; pass one")
        layout, world, dev = self.layout(flat.numel()), dist.get_world_size(group), flat.device
        if scale:
            flat.sub_(global_k)
        mine = workspace.get("mine", layout.bytes, torch.uint8, dev)
        scratch = workspace.get("magnitude", flat.numel(), torch.float32, dev)
        contribute(flat, residual, layout, mine, scratch, scale, merge=self.merge, decay=self.decay)
        rows = workspace.get("rows", world * layout.bytes, torch.uint8, dev).view(world, layout.bytes)
        bounded(all_gather_single, rows.view(-1), mine, group=group)
        if self.merge == "sum":
            norms = accumulate(flat, rows, layout, base=global_k)
        else:
            norms = scatter_mean(flat, rows, layout, global_k, scratch)
        self.merged = MergedRows.of(norms, rows, self.merge)
        return (world - 1) * layout.bytes

    def outliers(self, ratio: float) -> list[int]:
        """The rows at fault in this wire's last merge (`outlying_rows`: indices in the group it all-gathered over,
        the sites' group in two levels), then forgotten; none where it merged no rows since the last call."""
        merged, self.merged = self.merged, None
        return merged.outliers(ratio) if merged is not None else []


def contribute(delta: torch.Tensor, residual: torch.Tensor | None, layout: RowLayout, row: torch.Tensor,
               scratch: torch.Tensor, scale: float = 1.0, *, merge: TopkMerge = "sum", decay: float = 1.0) -> None:
    """This rank's row: the kept entries of x = decay x residual + `delta` (`sum`: + scale x `delta`) into `row`, its
    header `scale` (`scratch`: fp32 of its size). The residual becomes x less what was sent, as decoded (it holds x
    throughout: no copy); None (a member left out, `delta` zeros, `scale` 0): x is `delta`, scaled in place."""
    weight = scale if merge == "sum" else 1.0
    if residual is None:
        x = delta.mul_(weight)
    else:
        x = (residual.mul_(decay) if decay != 1.0 else residual).add_(delta, alpha=weight)
    indices, values = select(x, layout, scratch)
    sent = encode_row(indices, values, layout, row)
    share_of(row).fill_(scale)
    if residual is not None:
        scatter(residual, layout, indices, values.sub_(sent), add=False)  # the kept entries: what was not sent


def accumulate(flat: torch.Tensor, rows: torch.Tensor, layout: RowLayout,
               base: torch.Tensor | None = None) -> torch.Tensor:
    """`sum`: flat = `base` (None: zeros) + every rank's row (`rows`: (W, row bytes)), added in rank order, in fp32.
    Returns the rows' norms (W, fp32, on their device)."""
    import torch

    if base is None:
        flat.zero_()
    else:
        flat.copy_(base)
    norms = []
    for row in rows:
        indices, values = decode_row(row, layout)
        norms.append(torch.linalg.vector_norm(values))
        scatter(flat, layout, indices, values, add=True)
    return torch.stack(norms)


def median_norm(norms: torch.Tensor, included: torch.Tensor) -> torch.Tensor:
    """The median of the `included` rows' norms (or of any figure of the rows: their lower middle one for an even
    count, as torch.median), as a 1-element tensor; inf when none is included."""
    import torch

    ranked = torch.sort(torch.where(included, norms, torch.full_like(norms, math.inf))).values
    return ranked.gather(0, (included.sum() - 1).clamp_min(0).div(2, rounding_mode="floor").view(1))


def clip_factors(norms: torch.Tensor, included: torch.Tensor) -> torch.Tensor:
    """min(1, median / norm) of each row's norm, the median over the `included` rows' (`median_norm`); 1 for a zero
    norm, and for every row when none is included."""
    import torch

    median = median_norm(norms, included)
    return torch.where(norms > median, median / norms, torch.ones_like(norms))


def outlying_rows(norms: torch.Tensor, shares: torch.Tensor, ratio: float, *, weighted: bool) -> list[int]:
    """The rows at fault in a top-k merge (their indices), alike on every member, as all of them merge the same rows:
    among the rows of members not left out (share > 0), each whose norm (`weighted`, a `sum` merge's rows: per unit
    of share) is not finite (NaN, infinite or overflowing values), or above `ratio` x their median (`median_norm`,
    the clip's reference) x max(1, its share over the median share: a member with more tokens may move further); a
    median of 0, or `ratio` 0, judges finiteness only. One host read."""
    import torch

    included = shares > 0
    per = norms / torch.where(included, shares, torch.ones_like(shares)) if weighted else norms
    median = median_norm(per, included)
    longer = (shares / median_norm(shares, included)).clamp_min(1.0)
    limit = (torch.where(median > 0, median * ratio, torch.full_like(median, math.inf)) * longer if ratio > 0
             else math.inf)
    at_fault = included & (~torch.isfinite(per) | (per > limit))
    return [j for j, bad in enumerate(at_fault.tolist()) if bad]


@dataclass
class MergedRows:
    """What a top-k merge saw of its rows: their norms and weight shares (W each, fp32, on their device)."""

    norms: torch.Tensor
    shares: torch.Tensor
    weighted: bool
    """The rows carry weighted values (a `sum` merge)."""

    @classmethod
    def of(cls, norms: torch.Tensor, rows: torch.Tensor, merge: TopkMerge) -> MergedRows:
        import torch

        return cls(norms, torch.cat([share_of(row) for row in rows]), merge == "sum")

    def outliers(self, ratio: float) -> list[int]:
        """`outlying_rows` of these rows."""
        return outlying_rows(self.norms, self.shares, ratio, weighted=self.weighted)


def scatter_mean(flat: torch.Tensor, rows: torch.Tensor, layout: RowLayout, base: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
    """`scatter-mean`: flat = `base` + sum_i(s_i c_i v_i) / sum_i(s_i) at each coordinate, over the rows i that sent
    it (`rows`: (W, row bytes), in rank order, in fp32), s_i a row's weight share and c_i its clip factor
    (`clip_factors`, over the rows of members not left out); a coordinate nobody sent keeps `base`. `weights`: fp32
    scratch of flat's size (the sum of the shares). Returns the rows' norms (W, fp32, on their device)."""
    import torch

    shares = torch.cat([share_of(row) for row in rows])
    decoded = [decode_row(row, layout) for row in rows]
    norms = torch.stack([torch.linalg.vector_norm(values) for _, values in decoded])
    factors = shares * clip_factors(norms, shares > 0)
    flat.zero_()
    weights.zero_()
    for (indices, values), share, factor in zip(decoded, shares, factors):
        scatter(flat, layout, indices, values * factor, add=True)  # values may view the row (float32)
        scatter(weights, layout, indices, torch.ones_like(values).mul_(share), add=True)
    flat.div_(weights.clamp_min_(torch.finfo(torch.float32).tiny)).add_(base)
    return norms


class DenseFlush(Wire):
    """A top-k sync that sends every entry this time (a warm-up or a flush): each rank's delta plus its decayed
    residual, through the top-k wire's `values` wire (its dense reduction); the residual is emptied into it and then
    holds only that wire's rounding errors (unweighted again for `scatter-mean`)."""

    delta: ClassVar[bool] = True
    error_feedback: ClassVar[bool] = True

    def __init__(self, top: SparseWire) -> None:
        self.top, self.name, self.order = top, top.values.name, top.values.order
        self.bytes_per_value = top.values.bytes_per_value

    def reduce(self, flat, global_k, scale, group, workspace, residual=None, sites=None) -> int:
        if sites is not None:
            return sites.topk(self, flat, global_k, scale, workspace, residual)
        top, feedback = self.top, residual is not None and bool(scale)
        if feedback:  # flat = global + delta + decay x residual (`sum`: its weighted residual, unweighted here)
            flat.add_(residual, alpha=top.decay / (scale if top.merge == "sum" else 1.0))
            residual.zero_()
        sent = top.values.reduce(flat, global_k, scale, group, workspace,
                                 residual if feedback and top.values.error_feedback else None)
        if feedback and top.values.error_feedback and top.merge != "sum":
            residual.div_(scale)  # the ring's rounding errors of the weighted delta
        return sent
