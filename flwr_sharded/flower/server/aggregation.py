"""Server-path aggregation: shard pieces from the groups are combined reply by reply, never held all at once.

Each reply is the pieces (`flwr_sharded.parallel.shard_transport.ShardPiece`, keyed by parameter name and global row
offset) that one group, or one rank of a group, sent for this sync, with the group's weight. `add()` validates the
reply wholly BEFORE touching any accumulator, and rejects it with one log line naming the reason when:

- its round is not this aggregator's round (stale or early reply), or its source already replied this round;
- its weight is not a finite number > 0;
- a key names no parameter of the model, or a piece's global shape, trailing dims or row range do not fit it;
- a piece's dtype differs from the model's (declared, or learned from the first accepted reply);
- a piece holds NaN or Inf;
- two pieces of the reply overlap, or (with `complete=True`) the reply does not cover every parameter exactly once.

Accepted replies of linear rules (FedAvg and the outer optimizers) are folded into one fp32 accumulator per parameter
(`sum(w * x)`, memory: one fp32 copy of the model whatever F is) and a per-row weight sum, so groups sharded
differently (S = 1 and S = 2) combine row by row. `finalize()` divides (and runs the outer rule on whole parameters,
element-wise, from the global model and the outer state it keeps); `result(name, offset, rows)` / `pieces_for()`
then slice each rank's own rows back out.

With a `window` (parameter -> global rows), the aggregator covers only those rows: its accumulators are that size and
pieces outside are rejected. The server path folds the model one window (a chunk of `plan_ranges`) at a time, so
the server never holds a whole model.

Unit of rejection = unit of a reply. With `complete=True` (default) a reply must carry the whole model of one group
(all of its ranks' pieces), so a group is taken or dropped as a whole; the cost is that one group's model is in the
server's memory while its reply is validated (the Flower Message holds it anyway). With `complete=False` a reply may
be one rank's pieces: memory per reply drops to 1/S of a model, and if one rank's reply is rejected the other ranks'
rows of that group are kept, so those rows are averaged over a different set of groups than the rest (each row is
still a correct weighted mean of the valid values sent for it; nothing invalid enters).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import torch

from flwr_sharded.flower import handoff
from flwr_sharded.parallel.outer import FedAvg, ShardRule, State
from flwr_sharded.parallel.shard_transport import PieceLayout, ShardPiece

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParamSpec:
    """A parameter's global (unsharded) shape and the dtype its shards travel in."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1


def spec_of(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, ParamSpec]:
    """The spec of a (whole, unsharded) model's parameters."""
    return {name: ParamSpec(tuple(t.shape), t.dtype) for name, t in named}


def fp32_bytes(spec: Mapping[str, ParamSpec]) -> int:
    """Bytes of one fp32 copy of the model."""
    return 4 * sum(math.prod(p.shape) for p in spec.values())


@dataclass
class ShardReply:
    """What one group (or one rank) sent for a sync."""

    source: str
    round: int
    weight: float
    pieces: Sequence[ShardPiece]


class RejectedReply(ValueError):
    pass


@dataclass
class AggregationReport:
    accepted: list[str] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)
    total_weight: float = 0.0


def check_layout(spec: dict[str, ParamSpec] | None, pieces: Sequence[PieceLayout], *,
                 complete: bool) -> dict[str, ParamSpec]:
    """Check where pieces sit (names, global and local shapes, dtypes, overlaps, and with `complete` the coverage
    of every parameter exactly once) against `spec`, or against each other when `spec` is None; returns the spec.

    Raises RejectedReply naming the first problem. Used for replies and, before anything is pulled, for manifests.
    """
    if not pieces:
        raise RejectedReply("no shard pieces")
    spec = spec if spec is not None else {p.name: ParamSpec(tuple(p.global_shape), p.dtype) for p in pieces}
    covered: dict[str, list[tuple[int, int]]] = {}
    for piece in pieces:
        where = f"piece {piece.key}"
        if piece.name not in spec:
            raise RejectedReply(f"{where}: unknown parameter {piece.name!r}")
        want = spec[piece.name]
        if tuple(piece.global_shape) != want.shape:
            raise RejectedReply(f"{where}: global shape {tuple(piece.global_shape)} != model's {want.shape}")
        if piece.dtype != want.dtype:
            raise RejectedReply(f"{where}: dtype {piece.dtype} != model's {want.dtype}")
        shape = tuple(piece.shape)
        if not want.shape:
            ok = shape in ((), (1,)) and piece.row_offset == 0
        else:
            ok = (len(shape) == len(want.shape) and shape[1:] == want.shape[1:] and piece.row_offset >= 0
                  and shape[0] > 0 and piece.row_offset + shape[0] <= want.shape[0])
        if not ok:
            raise RejectedReply(f"{where}: local shape {shape} at row {piece.row_offset} does not fit the "
                                f"global shape {want.shape}")
        covered.setdefault(piece.name, []).append((piece.row_offset, piece.row_offset + piece.rows))
    for name, ranges in covered.items():
        ranges.sort()
        for (_, end), (start, _) in zip(ranges, ranges[1:]):
            if start < end:
                raise RejectedReply(f"pieces of {name!r} overlap (rows {start} < {end})")
    if complete:
        missing = [n for n in spec if n not in covered]
        if missing:
            raise RejectedReply(f"incomplete: no pieces for {len(missing)} parameters, e.g. {missing[:3]}")
        for name, ranges in covered.items():
            if sum(e - s for s, e in ranges) != spec[name].rows:
                raise RejectedReply(f"incomplete: pieces of {name!r} cover {sum(e - s for s, e in ranges)} "
                                    f"of {spec[name].rows} rows")
    return spec


def plan_ranges(spec: dict[str, ParamSpec], budget_bytes: int) -> list[list[tuple[str, int, int]]]:
    """Cut a model into chunks of global rows, `(name, start, stop)` each, of at most `budget_bytes` in fp32 (at
    least one row; a parameter larger than the budget is split by rows): the windows in which the server path
    pulls, averages and sends back the model."""
    budget = max(1, int(budget_bytes))
    chunks: list[list[tuple[str, int, int]]] = []
    current: list[tuple[str, int, int]] = []
    used = 0
    for name, param in spec.items():
        start, row_bytes = 0, max(1, 4 * math.prod(param.shape[1:]))
        while start < param.rows:
            take = min(param.rows - start, max(1, (budget - used) // row_bytes))
            if current and used + take * row_bytes > budget:
                chunks.append(current)
                current, used = [], 0
                continue
            current.append((name, start, start + take))
            used += take * row_bytes
            start += take
        if used >= budget:
            chunks.append(current)
            current, used = [], 0
    if current:
        chunks.append(current)
    return chunks


def requests_for(pieces: Sequence[PieceLayout], chunk: Sequence[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """The rows `(key, start, stop)` (local to each piece) of a group's pieces that hold a chunk's global rows."""
    by_name: dict[str, list[PieceLayout]] = {}
    for piece in pieces:
        by_name.setdefault(piece.name, []).append(piece)
    out = []
    for name, start, stop in chunk:
        for piece in sorted(by_name.get(name, []), key=lambda p: p.row_offset):
            a, b = max(start, piece.row_offset), min(stop, piece.row_offset + piece.rows)
            if a < b:
                out.append((piece.key, a - piece.row_offset, b - piece.row_offset))
    return out


class StreamingShardAggregator:
    """Combine shard replies one at a time into per-parameter fp32 accumulators.

    Args:
        rule: a linear `ShardRule` (FedAvg by default). Non-linear rules need every member at once and are refused.
        round: the sync round replies must carry.
        spec: the model's parameters (`spec_of`); when None it is learned from the first accepted reply, which must
            then be complete.
        global_params: name -> the global model's full tensor (start of the sync period). Needed by stateful rules;
            with FedAvg it fills rows no valid reply covered (else those rows make `finalize` raise).
        state: name -> the rule's state (from a previous round's `state`), created by `rule.init_state` if missing.
        complete: a reply must cover every parameter exactly once (one reply = one group, rejected as a whole).
        window: parameter -> its global rows `(start, stop)` this aggregator covers (needs `spec`,
            `complete=False` and FedAvg); the other parameters and rows are outside it.
    """

    def __init__(self, rule: ShardRule | None = None, round: int = 0, *, spec: dict[str, ParamSpec] | None = None,
                 global_params: dict[str, torch.Tensor] | None = None, state: dict[str, State] | None = None,
                 complete: bool = True, window: Mapping[str, tuple[int, int]] | None = None) -> None:
        self.rule = rule or FedAvg()
        if not self.rule.linear:
            raise ValueError(f"{type(self.rule).__name__} is not linear: the streaming server path needs a rule that "
                             f"depends on the members only through their weighted mean")
        if self.rule.stateful and global_params is None:
            raise ValueError(f"{type(self.rule).__name__} steps from the global model: pass global_params")
        if spec is None and not complete:
            raise ValueError("without a declared spec, replies must be complete (the first one defines the model)")
        if window is not None:
            if spec is None or complete or not isinstance(self.rule, FedAvg):
                raise ValueError("a window needs a declared spec, complete=False and FedAvg (the weighted mean)")
            for name, (start, stop) in window.items():
                if name not in spec or not 0 <= start < stop <= spec[name].rows:
                    raise ValueError(f"window rows [{start}, {stop}) of {name!r} are not rows of the model")
        self.window = dict(window) if window is not None else None
        self.round = round
        self.spec = dict(spec) if spec is not None else None
        self.global_params = global_params
        self.state = dict(state) if state else {}
        self.complete = complete
        self.report = AggregationReport()
        self._acc: dict[str, torch.Tensor] = {}
        self._row_weight: dict[str, torch.Tensor] = {}
        self._finalized = False

    # ----- intake ---------------------------------------------------------------------------------------------
    def add(self, reply: ShardReply) -> bool:
        """Validate the reply wholly, then fold it in. False (and one warning log line) if it was rejected."""
        if self._finalized:
            raise RuntimeError("this aggregator is finalized; start a new one for the next round")
        try:
            spec = self._validate(reply)
        except RejectedReply as exc:
            self.report.rejected[reply.source] = str(exc)
            log.warning("server path: round %s: rejected the reply of %s: %s", self.round, reply.source, exc)
            return False
        if self.spec is None:
            self.spec = spec
        self._accumulate(reply)
        self.report.accepted.append(reply.source)
        self.report.total_weight += float(reply.weight)
        return True

    def _validate(self, reply: ShardReply) -> dict[str, ParamSpec]:
        if reply.round != self.round:
            raise RejectedReply(f"round {reply.round} is not the current round {self.round} (stale or early reply)")
        if reply.source in self.report.accepted or reply.source in self.report.rejected:
            raise RejectedReply("this source already replied in this round")
        if not (isinstance(reply.weight, (int, float)) and math.isfinite(reply.weight) and reply.weight > 0):
            raise RejectedReply(f"weight must be a finite number > 0, got {reply.weight!r}")
        spec = check_layout(self.spec, [p.layout for p in reply.pieces], complete=self.complete)
        for piece in reply.pieces:
            start, stop = self.window.get(piece.name, (0, 0)) if self.window is not None else (0, spec[piece.name].rows)
            if not (start <= piece.row_offset and piece.row_offset + piece.rows <= stop):
                raise RejectedReply(f"piece {piece.key}: rows outside this aggregator's window")
            if piece.data.is_floating_point() and not bool(torch.isfinite(piece.data).all()):
                raise RejectedReply(f"piece {piece.key}: holds NaN or Inf")
        return spec

    def _rows_of(self, name: str) -> tuple[int, int]:
        """The global rows of a parameter that this aggregator covers ((0, 0) for one outside its window)."""
        if self.window is not None:
            return self.window.get(name, (0, 0))
        return 0, self.spec[name].rows

    def _zeros(self, name: str) -> torch.Tensor:
        """A fresh accumulator (and row weights) for the covered rows of a parameter."""
        want = self.spec[name]
        start, stop = self._rows_of(name)
        self._row_weight[name] = torch.zeros(stop - start, dtype=torch.float64)
        shape = (stop - start, *want.shape[1:]) if want.shape else ()
        acc = self._acc[name] = torch.zeros(shape, dtype=torch.float32)
        return acc

    @torch.no_grad()
    def _accumulate(self, reply: ShardReply) -> None:
        w = float(reply.weight)
        for piece in reply.pieces:
            want = self.spec[piece.name]
            acc = self._acc.get(piece.name)
            if acc is None:
                acc = self._zeros(piece.name)
            first = self._rows_of(piece.name)[0]
            rows = slice(piece.row_offset - first, piece.row_offset - first + piece.rows)
            target = acc[rows] if want.shape else acc
            target.add_(piece.data.reshape(target.shape), alpha=w)  # fp32 += w * (fp32 | bf16): no temporary
            self._row_weight[piece.name][rows] += w

    # ----- result ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def finalize(self) -> AggregationReport:
        """Turn the sums into the new global parameters (in place) and step the rule; return what was accepted."""
        if self._finalized:
            return self.report
        if not self.report.accepted:
            raise RuntimeError(f"round {self.round}: no valid reply to aggregate "
                               f"(rejected: {self.report.rejected})")
        for name in (self.window if self.window is not None else self.spec):
            acc = self._acc.get(name)
            if acc is None:
                acc = self._zeros(name)
            start, stop = self._rows_of(name)
            weight = self._row_weight[name]
            covered = weight > 0
            view = acc.view(stop - start, -1)
            view.div_(torch.where(covered, weight, 1.0).to(torch.float32).unsqueeze(1))  # uncovered rows stay 0
            if not bool(covered.all()):
                if self.global_params is None:
                    raise RuntimeError(f"round {self.round}: rows of {name!r} were sent by no accepted reply and "
                                       f"there is no global model to keep them from")
                kept = self.global_params[name].float().reshape(self.spec[name].rows, -1)[start:stop]
                view[~covered] = kept[~covered]
            if not isinstance(self.rule, FedAvg):
                global_t = self.global_params[name]
                state = self.state.get(name)
                if state is None:
                    state = self.rule.init_state(global_t.float())
                new, self.state[name] = self.rule.apply_mean(global_t, acc, state)
                acc.copy_(new)
        self._finalized = True
        return self.report

    def result(self, name: str, row_offset: int, rows: int | None = None) -> torch.Tensor:
        """The new global rows `[row_offset, row_offset + rows)` of a parameter (fp32, a view; with a window,
        rows inside it)."""
        if not self._finalized:
            raise RuntimeError("call finalize() first")
        acc = self._acc[name]
        if not acc.dim():
            return acc
        start, stop = self._rows_of(name)
        end = stop if rows is None else row_offset + rows
        if not start <= row_offset <= end <= stop:
            raise KeyError(f"rows [{row_offset}, {end}) of {name!r} are outside this aggregator's rows")
        return acc[row_offset - start:end - start]

    def pieces_for(self, requested: Iterable[ShardPiece], dtype: torch.dtype | None = None) -> list[ShardPiece]:
        """The new values of exactly the pieces a rank sent (same keys and shapes), in `dtype` or the model's."""
        out = []
        for piece in requested:
            value = self.result(piece.name, piece.row_offset, piece.rows).reshape(piece.data.shape)
            out.append(ShardPiece(piece.name, piece.row_offset, tuple(piece.global_shape),
                                  value.to(dtype or self.spec[piece.name].dtype)))
        return out

    def model(self) -> dict[str, torch.Tensor]:
        """The new global parameters (fp32 accumulators, finalized; with a window, its rows), e.g. as the next
        round's `global_params`."""
        if not self._finalized:
            raise RuntimeError("call finalize() first")
        return dict(self._acc)


# ----- Flower records (names and layout: `flwr_sharded.flower.handoff`) ------------------------------------------
def reply_content(pieces: Iterable[ShardPiece], round: int, weight: float):
    """A RecordDict carrying pieces, for a group's reply (imports flwr; NumPy, no torch needed by the receiver)."""
    from flwr.app import RecordDict

    from flwr_sharded.parallel.shard_transport import encode_pieces

    return RecordDict(handoff.to_records(*encode_pieces(pieces), round, weight))


def add_content(agg: StreamingShardAggregator, source: str, content) -> bool:
    """Fold one reply's RecordDict into `agg`; malformed records are a rejection (logged), like bad pieces."""
    from flwr_sharded.parallel.shard_transport import ShardPieceError, decode_pieces

    try:
        arrays, meta, info = handoff.from_records(content)
        if "round" not in info or "weight" not in info:
            raise ShardPieceError(f"{handoff.SHARD_INFO!r} lacks 'round' or 'weight'")
        pieces = decode_pieces(arrays, meta)
    except (ShardPieceError, KeyError, TypeError, ValueError) as exc:
        agg.report.rejected[source] = f"malformed reply: {exc}"
        log.warning("server path: round %s: rejected the reply of %s: malformed reply: %s", agg.round, source, exc)
        return False
    return agg.add(ShardReply(source, int(info["round"]), float(info["weight"]), pieces))
