"""The server path's aggregator: shard replies folded one at a time into fp32 sums, each checked wholly first, and
the bounds that leave a contribution out of a chunk.

A reply (`ShardReply`) is one group's or one rank's pieces, keyed by global row offset, so groups of any S combine
row by row. `add` rejects a whole reply with one log line (stale round, a second reply of a source, a weight out of
bounds, pieces that do not fit the model, NaN or Inf, `complete` and not the whole model); `finalize` leaves out the
contributions out of bounds by raising `ExcludedContributions`, then divides and steps a linear outer rule. With a
`window` it covers only those rows (a chunk); `combine` median or trimmed-mean stacks every reply's rows instead of
summing them. The rejections and their log lines: docs/server-path.md.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch

from flwr_sharded.flower import shard_files
from flwr_sharded.parallel.token_weights import weight_verdict
from flwr_sharded.parallel.rules import FedAvg, ShardRule, State, median_trim, trimmed_mean
from flwr_sharded.parallel.shard_transport import PieceLayout, ShardPiece, ShardPieceError, decode_pieces
from flwr_sharded.parallel.verdict import MAGNITUDE, NOT_FINITE, OVERFLOW, Verdict, reasons

log = logging.getLogger(__name__)
FP32_MAX = torch.finfo(torch.float32).max
SUM_LIMIT = FP32_MAX / 2
"""Bound on sum(weight x largest |value|) over a chunk's contributions: the fp32 sums stay finite below it."""
ROBUST_RULES = ("median", "trimmed-mean")
"""The server rules that are not the weighted mean."""


@dataclass(frozen=True)
class ParamSpec:
    """A parameter's global (unsharded) shape and the dtype its shards travel in."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1


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
    """A reply or manifest that does not fit; the message names the first problem."""


class ExcludedContributions(RuntimeError):
    """Accepted replies found out of bounds (`reasons`: source -> why); aggregate again without them."""

    def __init__(self, verdicts: Sequence[Verdict]) -> None:
        self.verdicts = list(verdicts)
        self.reasons = reasons(self.verdicts)
        super().__init__("; ".join(f"{source}: {why}" for source, why in self.reasons.items()))


@dataclass
class AggregationReport:
    """The sources an aggregator accepted, rejected (source -> why) and excluded as out of bounds."""

    accepted: list[str] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)
    total_weight: float = 0.0
    excluded: dict[str, str] = field(default_factory=dict)


def check_piece_layout(spec: dict[str, ParamSpec] | None, pieces: Sequence[PieceLayout], *,
                 complete: bool) -> dict[str, ParamSpec]:
    """Check where pieces sit (names, shapes, dtypes, overlaps; `complete`: every row exactly once) against `spec`,
    or against each other when it is None; returns the spec. RejectedReply names the first problem."""
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


def min_contributors(rule: str, trim: int) -> int:
    """The fewest contributions `rule` can combine."""
    return 2 * trim + 1 if rule == "trimmed-mean" else 1


def out_of_bounds_verdicts(stats: Mapping[str, tuple[float, float]], ratio: float, *,
                           sums: bool = True) -> list[Verdict]:
    """The contributions excluded from a chunk and why (`Verdict.member`: the source), from each one's (weight,
    largest |value|), decided on all of them at once: a largest |value| above `ratio` x max(1, the lower median of
    them) (honest facilities start from one model and move little; `ratio` 0: off), and while sum(weight x largest
    |value|) exceeds `SUM_LIMIT`, the largest such contribution (unless `sums=False`: a robust rule sums nothing)."""
    out: list[Verdict] = []
    if ratio > 0 and len(stats) > 1:
        largest = sorted(m for _, m in stats.values())
        median = largest[(len(largest) - 1) // 2]
        bound = ratio * max(1.0, median)
        for source, (_, m) in stats.items():
            if m > bound:
                out.append(Verdict(source, f"its largest |value| {m:.3g} is more than {ratio:g} x max(1, "
                                           f"{median:.3g}), the median of the facilities' largest |values| in this "
                                           f"chunk", MAGNITUDE))
    excluded = {v.member for v in out}
    kept = {s: w * m for s, (w, m) in stats.items() if s not in excluded} if sums else {}
    total = math.fsum(kept.values())
    for source in sorted(kept, key=kept.__getitem__, reverse=True):
        if total <= SUM_LIMIT:
            break
        out.append(Verdict(source, f"the mean would overflow: its weight x largest |value| is {kept[source]:.3g}, "
                                   f"all of them together {total:.3g}, above the {SUM_LIMIT:.3g} fp32 sums can hold",
                           OVERFLOW))
        total -= kept[source]
    return out


def out_of_bounds(stats: Mapping[str, tuple[float, float]], ratio: float, *, sums: bool = True) -> dict[str, str]:
    """source -> why it is excluded (`out_of_bounds_verdicts`' reasons)."""
    return reasons(out_of_bounds_verdicts(stats, ratio, sums=sums))


class ChunkStack:
    """Every contribution's rows of one window, stacked per parameter (slot i: the i-th accepted one) in the pieces'
    dtype: slots x the window, whatever the model size."""

    def __init__(self, window: Mapping[str, tuple[int, int]], shapes: Mapping[str, tuple[int, ...]],
                 dtypes: Mapping[str, torch.dtype], slots: int) -> None:
        if slots < 1:
            raise ValueError("a stack needs at least one slot")
        self.window, self.slots = dict(window), slots
        self._stack = {name: torch.empty((slots, stop - start, *shapes[name][1:]) if shapes[name] else (slots,),
                                         dtype=dtypes[name]) for name, (start, stop) in self.window.items()}

    def put(self, slot: int, name: str, row_offset: int, data: torch.Tensor) -> None:
        """Copy a piece's rows (global offset `row_offset`) into `slot`."""
        start = self.window[name][0]
        target = self._stack[name][slot]
        if target.dim():  # a scalar parameter's slot is the whole value
            target = target[row_offset - start:row_offset - start + data.shape[0]]
        target.copy_(data.reshape(target.shape))

    def combine(self, rule: str, trim: int, n: int) -> dict[str, torch.Tensor]:
        """name -> the rule over the first `n` slots, fp32 (the median: the decentralised `median` rule's trim)."""
        if not 1 <= n <= self.slots:
            raise ValueError(f"{n} contributions for {self.slots} slots")
        cut = median_trim(n) if rule == "median" else trim
        return {name: trimmed_mean(stack[:n], cut) for name, stack in self._stack.items()}


class StreamingShardAggregator:
    """Combine shard replies one at a time into per-parameter fp32 accumulators.

    Args:
        rule: a linear `ShardRule` (FedAvg by default; a rule that needs every member at once is refused).
        round: the sync round replies must carry.
        spec: the model's parameters; None: learned from the first accepted reply, which must be complete.
        global_params: name -> the global model (stateful rules step from it; FedAvg keeps its rows nobody sent).
        state: name -> the rule's state (a previous round's `state`; `rule.init_state` if missing).
        complete: a reply must cover every parameter exactly once (one reply = one group, rejected whole).
        window: parameter -> the global rows `(start, stop)` covered (needs `spec`, not `complete`, FedAvg).
        combine: "mean", or "median" / "trimmed-mean" (coordinate-wise, unweighted; a window each reply covers
            whole, `slots` replies at most, `trim` values dropped from each side).
        outlier_ratio: `out_of_bounds`' magnitude test (0: off; the overflow test is always on).
        expected_weight: source -> the weight its reply must carry (None: any finite weight > 0).
        log_rejections: one warning per rejected reply (off when the caller logs its own).
    """

    def __init__(self, rule: ShardRule | None = None, round: int = 0, *, spec: dict[str, ParamSpec] | None = None,
                 global_params: dict[str, torch.Tensor] | None = None, state: dict[str, State] | None = None,
                 complete: bool = True, window: Mapping[str, tuple[int, int]] | None = None,
                 combine: str = "mean", trim: int = 1, slots: int | None = None, outlier_ratio: float = 0.0,
                 expected_weight: Callable[[str], float | None] | None = None, log_rejections: bool = True) -> None:
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
        if combine not in ("mean", *ROBUST_RULES):
            raise ValueError(f"combine must be mean, {' or '.join(ROBUST_RULES)}; got {combine!r}")
        if combine != "mean" and (window is None or not slots or slots < min_contributors(combine, trim)):
            raise ValueError(f"{combine} needs a window and at least {min_contributors(combine, trim)} slots")
        if not (outlier_ratio >= 0 and math.isfinite(outlier_ratio)):
            raise ValueError(f"outlier_ratio must be a finite number >= 0, got {outlier_ratio!r}")
        self.round, self.complete, self.window = round, complete, dict(window) if window is not None else None
        self.combine, self.trim, self.outlier_ratio = combine, trim, float(outlier_ratio)
        self.expected_weight, self.log_rejections = expected_weight, log_rejections
        self.spec = dict(spec) if spec is not None else None
        self.global_params, self.state = global_params, dict(state) if state else {}
        self._stack = ChunkStack(self.window, {n: p.shape for n, p in spec.items()},
                                 {n: p.dtype for n, p in spec.items()}, slots) if combine != "mean" else None
        self._stats: dict[str, tuple[float, float]] = {}  # accepted source -> (weight, largest |value|)
        self._bound = 0.0  # sum of weight x largest |value| over the replies folded into the sums
        self._unfolded: list[str] = []  # accepted replies that could have overflowed the sums
        self.report = AggregationReport()
        self._acc: dict[str, torch.Tensor] = {}
        self._row_weight: dict[str, torch.Tensor] = {}
        self._finalized = False

    def add(self, reply: ShardReply) -> bool:
        """Validate the reply wholly, then fold it in; False (and one warning) if it was rejected."""
        if self._finalized:
            raise RuntimeError("this aggregator is finalized; start a new one for the next round")
        try:
            spec, largest = self._validate(reply)
        except RejectedReply as exc:
            return self.reject(reply.source, str(exc))
        self.spec = self.spec or spec
        w = float(reply.weight)
        if self._stack is not None:
            for piece in reply.pieces:
                self._stack.put(len(self._stats), piece.name, piece.row_offset, piece.data)
        elif self._bound + w * largest <= SUM_LIMIT:
            self._accumulate(reply)
            self._bound += w * largest
        else:
            self._unfolded.append(reply.source)  # `finalize` excludes the largest contributions first
        self._stats[reply.source] = (w, largest)
        self.report.accepted.append(reply.source)
        self.report.total_weight += w
        return True

    def reject(self, source: str, reason: str) -> bool:
        """Record (and log, with `log_rejections`) that the reply of `source` is rejected; returns False."""
        self.report.rejected[source] = reason
        if self.log_rejections:
            log.warning("server path: round %s: rejected the reply of %s: %s", self.round, source, reason)
        return False

    def _validate(self, reply: ShardReply) -> tuple[dict[str, ParamSpec], float]:
        """The model's spec and the reply's largest |value|; RejectedReply naming the first problem."""
        if reply.round != self.round:
            raise RejectedReply(f"round {reply.round} is not the current round {self.round} (stale or early reply)")
        if reply.source in self.report.accepted or reply.source in self.report.rejected:
            raise RejectedReply("this source already replied in this round")
        expected = self.expected_weight(reply.source) if self.expected_weight is not None else None
        verdict = weight_verdict(reply.source, reply.weight, expected)
        if verdict is not None:
            raise RejectedReply(verdict.reason)
        if reply.weight > FP32_MAX:
            raise RejectedReply(f"weight {reply.weight:.3g} is beyond the fp32 range of the sums")
        if self._stack is not None and len(self._stats) >= self._stack.slots:
            raise RejectedReply(f"more replies than the {self._stack.slots} this {self.combine} expects")
        spec = check_piece_layout(self.spec, [p.layout for p in reply.pieces], complete=self.complete)
        largest, rows = 0.0, {}
        for piece in reply.pieces:
            start, stop = self._rows_of(piece.name, spec)
            if not (start <= piece.row_offset and piece.row_offset + piece.rows <= stop):
                raise RejectedReply(f"piece {piece.key}: rows outside this aggregator's window")
            lo, hi = (float(x) for x in torch.aminmax(piece.data))  # NaN and Inf show in the extremes
            if not (math.isfinite(lo) and math.isfinite(hi)):
                raise RejectedReply(f"piece {piece.key}: holds NaN or Inf")
            largest = max(largest, -lo, hi)
            rows[piece.name] = rows.get(piece.name, 0) + piece.rows
        if self._stack is not None:
            short = [n for n, (a, b) in self.window.items() if rows.get(n, 0) != b - a]
            if short:
                raise RejectedReply(f"{self.combine} needs every row of the window; {len(short)} parameter(s) lack "
                                    f"some, e.g. {short[:3]}")
        elif float(reply.weight) * largest > SUM_LIMIT:
            raise RejectedReply(f"the mean would overflow: weight {float(reply.weight):.3g} x its largest |value| "
                                f"{largest:.3g} is above the {SUM_LIMIT:.3g} fp32 sums can hold")
        return spec, largest

    def _rows_of(self, name: str, spec: Mapping[str, ParamSpec] | None = None) -> tuple[int, int]:
        """The global rows of a parameter this aggregator covers ((0, 0) for one outside its window)."""
        if self.window is not None:
            return self.window.get(name, (0, 0))
        return 0, (spec or self.spec)[name].rows

    def _zeros(self, name: str) -> torch.Tensor:
        """A fresh accumulator (and row weights) for the covered rows of a parameter."""
        start, stop = self._rows_of(name)
        shape = self.spec[name].shape
        self._row_weight[name] = torch.zeros(stop - start, dtype=torch.float64)
        self._acc[name] = torch.zeros((stop - start, *shape[1:]) if shape else (), dtype=torch.float32)
        return self._acc[name]

    @torch.no_grad()
    def _accumulate(self, reply: ShardReply) -> None:
        w = float(reply.weight)
        for piece in reply.pieces:
            start = self._rows_of(piece.name)[0]
            acc = self._acc[piece.name] if piece.name in self._acc else self._zeros(piece.name)
            rows = slice(piece.row_offset - start, piece.row_offset - start + piece.rows)
            target = acc[rows] if acc.dim() else acc
            target.add_(piece.data.reshape(target.shape), alpha=w)  # fp32 += w * (fp32 | bf16): no temporary
            self._row_weight[piece.name][rows] += w

    @torch.no_grad()
    def finalize(self) -> AggregationReport:
        """Turn the sums into the new global parameters (in place) and step the rule; return what was accepted."""
        if self._finalized:
            return self.report
        if not self.report.accepted:
            raise RuntimeError(f"round {self.round}: no valid reply to aggregate (rejected: {self.report.rejected})")
        self._exclude(out_of_bounds_verdicts(self._stats, self.outlier_ratio, sums=self._stack is None))
        if self._unfolded:  # cannot be: without exclusions every reply fitted the bound
            raise RuntimeError(f"round {self.round}: replies {self._unfolded} were not folded in")
        if self._stack is not None:
            self._acc, self._stack = self._stack.combine(self.combine, self.trim, len(self._stats)), None
        else:
            self._divide()
        bad = [n for n, t in self._acc.items() if t.numel() and not all(map(math.isfinite, torch.aminmax(t)))]
        if bad:  # a guard: finite inputs within the bound give a finite mean
            self._exclude([Verdict(max(self._stats, key=lambda s: self._stats[s][0] * self._stats[s][1]),
                                   f"the mean of {bad[:3]} is not finite; this contribution is the largest",
                                   NOT_FINITE)])
        self._finalized = True
        return self.report

    def _exclude(self, verdicts: Sequence[Verdict]) -> None:
        """Raise `ExcludedContributions` (and log one line per source) if there are any."""
        if not verdicts:
            return
        excluded = ExcludedContributions(verdicts)
        self.report.excluded.update(excluded.reasons)
        if self.log_rejections:
            for source, why in excluded.reasons.items():
                log.warning("server path: round %s: excluded the reply of %s: %s", self.round, source, why)
        raise excluded

    @torch.no_grad()
    def _divide(self) -> None:
        """The weighted mean from the sums (rows nobody sent: the global model's) and the rule's step, in place."""
        for name in (self.window if self.window is not None else self.spec):
            start, stop = self._rows_of(name)
            acc = self._acc[name] if name in self._acc else self._zeros(name)
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
                new, self.state[name] = self.rule.apply_mean(global_t, acc, state if state is not None else
                                                             self.rule.init_state(global_t.float()))
                acc.copy_(new)

    def result(self, name: str, row_offset: int, rows: int | None = None) -> torch.Tensor:
        """The new global rows `[row_offset, row_offset + rows)` of a parameter (fp32, a view; within the window)."""
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

    def model(self) -> dict[str, torch.Tensor]:
        """The new global parameters (fp32; with a window, its rows), e.g. the next round's `global_params`."""
        if not self._finalized:
            raise RuntimeError("call finalize() first")
        return dict(self._acc)


def add_content(agg: StreamingShardAggregator, source: str, content) -> bool:
    """Fold one reply's RecordDict into `agg`; malformed records are a rejection (logged), like bad pieces."""
    try:
        arrays, meta, info = shard_files.from_records(content)
        if "round" not in info or "weight" not in info:
            raise ShardPieceError(f"{shard_files.SHARD_INFO!r} lacks 'round' or 'weight'")
        pieces = decode_pieces(arrays, meta)
    except (ShardPieceError, KeyError, TypeError, ValueError) as exc:
        return agg.reject(source, f"malformed reply: {exc}")
    return agg.add(ShardReply(source, int(info["round"]), float(info["weight"]), pieces))
