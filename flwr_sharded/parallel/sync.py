"""Shard-to-shard federated averaging: every rank averages its local shards with the same shards of the other groups
(or, when the groups shard differently, each piece of them with its owners in the other groups: `sync_plan`).

The model is never gathered. A sync packs this rank's shards into flat buckets (`buckets.BucketLayout`), admits the
members channel by channel (`sync_verdict`), reduces each bucket over its channel's process group through the wire
(`wire`: the weighted shards, or weighted deltas from the global shards in a narrower format), checks each result
(`plausibility`), has the members vote on it (`sync_verdict`), and merges it into the shards, stepping the rule
(`rules`) on the way. One path for both kinds: a blocking sync copies, reduces and merges bucket by bucket through one
reusable buffer; an overlapped one copies every bucket out when it starts, reduces them in a background thread (a side
CUDA stream on GPUs) while training goes on, and merges them later, between two optimizer steps (`flight`).
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Mapping

import torch
import torch.distributed as dist

from flwr_sharded.parallel.admission import all_finite, healthy
from flwr_sharded.parallel.alignment import check_descriptors, describe, fingerprint, local_shard
from flwr_sharded.parallel.buckets import Bucket, BucketLayout
from flwr_sharded.parallel.collectives import bounded
from flwr_sharded.parallel.flight import Flight, Overlap, Snapshot, SyncStats
from flwr_sharded.parallel.global_state import ErrorFeedback, GlobalState
from flwr_sharded.parallel.plausibility import DEFAULT_MAX_MOVE, MoveBound, bucket_norms
from flwr_sharded.parallel.rules import FedAvg, ShardRule
from flwr_sharded.parallel.sites import SiteGroups, why_not_two_level
from flwr_sharded.parallel.sparse import SparseWire
from flwr_sharded.parallel.sync_plan import Owners, Seat
from flwr_sharded.parallel.sync_verdict import admit_channels, conclude
from flwr_sharded.parallel.wire import QUANTIZED, WIRES
from flwr_sharded.parallel.wire_base import Wire
from flwr_sharded.parallel.workspace import Workspace

Groups = dist.ProcessGroup | SiteGroups | Mapping[Owners, dist.ProcessGroup] | None
"""What a sync runs over: one process group (groups shard alike), its two-level groups (`sites`), each channel's
keyed by its owners, or none."""


def _bucket_wire(wire: Wire | None, buckets: list[Bucket], rule: ShardRule, error_feedback: bool) -> tuple[Wire, bool]:
    """The wire `buckets` are reduced through, and whether it sends weighted deltas from the global shards: top-k, or
    a wire of another dtype than some bucket's (fp32 buckets, a linear rule); else the shards' own (a plain
    all-reduce). ValueError for a combination the sync cannot run."""
    delta = isinstance(wire, SparseWire) or wire is not None and any(b.dtype != wire.torch_dtype() for b in buckets)
    if delta and not rule.linear:
        raise ValueError(f"{type(rule).__name__} is not linear: it all-gathers every member's shards, which a reduced "
                         f"wire ({wire.name}) cannot carry as one delta; use a linear rule or the shards' dtype")
    if delta and any(b.dtype != torch.float32 for b in buckets):
        raise ValueError(f"a wire dtype ({wire.name}) other than the shards' needs fp32 shards, got "
                         f"{sorted({str(b.dtype) for b in buckets})}")
    chosen = wire if delta else WIRES["float32"]
    if error_feedback and not chosen.error_feedback:
        given = wire.name if wire is not None else "the shards' own dtype"
        raise ValueError(f"error feedback needs a quantized wire dtype ({', '.join(QUANTIZED)}) or top-k, not {given}")
    if isinstance(chosen, SparseWire) and not error_feedback:
        raise ValueError("a top-k sync needs error feedback")
    return chosen, delta


class ShardSync:
    """Weighted averaging of this rank's local shards (one fragment of the model) with the other members'.

    Args:
        named_params: the (name, parameter) pairs to average, in the same order on every member.
        fed_group: the federation's process group(s) (`Groups`); None until bound (`bind`), or on ranks that never
            join the reduction (FL+HSDP replicas other than 0: they receive the result by `broadcast`).
        bucket_bytes: the size of the one flat buffer reused for every collective.
        rule: how shards combine (`flwr_sharded.parallel.rules`); FedAvg by default. Rules that are not linear
            all-gather each bucket (F buckets in memory) and cannot overlap or use a reduced wire.
        wire: what the reduction sends, built once (`flwr_sharded.parallel.wire.sync_wire`: a `--sync-dtype` wire, or
            top-k rows of its values with their merge, decay and restart); None: the shards' own dtype. A wire of
            another dtype than the shards', or top-k, sends weighted deltas from the global shards (fp32 shards, a
            linear rule), which are then kept.
        error_feedback: carry each rank's rounding errors (and what top-k left out) into its next sync.
        max_move: a result is adopted only if it moves no bucket by more than this many times its recent moves
            (`flwr_sharded.parallel.plausibility`); 0: finiteness only.
        seat: where this rank sits among groups that shard differently; None: every group shards alike.
        snapshot, origin: the buffers an overlapped sync copies its buckets and its shards into (shared by the
            fragments of one model); None: its own.
        carry: an overlapped merge keeps the local steps taken since the sync started.
    """

    def __init__(self, named_params: Iterable[tuple[str, torch.Tensor]], *, fed_group: Groups,
                 bucket_bytes: int = 64 << 20, rule: ShardRule | None = None, wire: Wire | None = None,
                 error_feedback: bool = False, max_move: float = DEFAULT_MAX_MOVE, seat: Seat | None = None,
                 snapshot: Snapshot | None = None, origin: Snapshot | None = None, carry: bool = False) -> None:
        named = list(named_params)
        if not named:
            raise ValueError("ShardSync needs at least one parameter")
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.rule = rule or FedAvg()
        self.layout = BucketLayout(self.names, self.params, seat, bucket_bytes)
        self.wire, self.delta = _bucket_wire(wire, self.layout.buckets, self.rule, error_feedback)
        """The wire each bucket is reduced through; whether it sends weighted deltas from the global shards."""
        self.state = GlobalState(self.rule, self.rule.stateful or self.delta,
                                 ErrorFeedback() if error_feedback else None)
        self.bound = MoveBound(max_move)
        """How far a result may move this rank's buckets, and the moves adopted so far."""
        self.max_weight: float | None = None
        """The largest weight a member may bring (`flwr_sharded.parallel.admission`); None: unchecked."""
        self.verdict: Callable[[list[torch.Tensor], float, float | None, list[float] | None], bool] = healthy
        """This member's verdict on what it sends, taken at `start` (`admission.healthy`'s arguments); the members
        admit it as it says (a test's lying member replaces it)."""
        self.left_out: list[int] = []
        """The members (indices in the federation group) the last sync's admission left out."""
        self.confirmed: bool | None = None
        """Whether the last sync's admission found every member with the same count of adopted merges (every merge
        before it stands); None: its admission was not reached."""
        self.overlap, self.carry = Overlap(snapshot, origin), carry
        """What an overlapped sync runs on (its buffers, side stream and thread; an abandoned flight's)."""
        self._workspace = Workspace()
        self._reserved = False
        self._flight: Flight | None = None
        self._received: Flight | None = None
        """An overlapped sync whose reduction arrived (`receive`), not merged yet."""
        self.bind(fed_group)

    # ----- where it runs --------------------------------------------------------------------------------------
    @property
    def seat(self) -> Seat | None:
        return self.layout.seat

    @property
    def fed_group(self) -> dist.ProcessGroup | None:
        """The process group of this rank's (first) channel; None where it does not join the reduction."""
        return self.groups[0]

    def bind(self, fed_group: Groups) -> None:
        """Sync over these groups from now on (a round's members), keeping buckets, buffer and global state; the
        alignment with the new peers is checked before the next sync."""
        channels = self.layout.channels
        self.sites = fed_group if isinstance(fed_group, SiteGroups) else None
        """The two-level reduction's groups (`flwr_sharded.parallel.sites`); None: the flat ring."""
        if fed_group is None:
            self.groups: list[dist.ProcessGroup | None] = [None] * len(channels)
        elif isinstance(fed_group, SiteGroups):
            why = why_not_two_level(fed_group.layout.sites, dist.get_world_size(fed_group.flat),
                                    alike=self.seat is None, linear=self.rule.linear,
                                    restart_residual=isinstance(self.wire, SparseWire) and self.wire.restart)
            if why:
                raise ValueError(f"this sync cannot reduce in two levels (site-aware): {why}")
            self.groups = [fed_group.flat]
        elif self.seat is None:
            self.groups = [fed_group]
        else:
            missing = [key for key in channels if key not in fed_group]
            if missing:
                raise ValueError(f"no process group for channel(s) {missing} of shard {self.seat.shard} of group "
                                 f"{self.seat.group}")
            self.groups = [fed_group[key] for key in channels]
        self._aligned = False

    def reseat(self, seat: Seat | None, fed_group: Groups) -> None:
        """Sync as `seat` (a round whose members shard differently, or alike: None) over `fed_group`: the buckets are
        planned anew, the global state re-cut element by element and the move history restarted."""
        if seat != self.seat:
            old = self.layout.buckets
            self.layout = BucketLayout(self.names, self.params, seat, self.layout.bucket_bytes)
            self.state.relayout(old, self.layout)
            self.bound = MoveBound(self.bound.max_move)
            self._reserved = False
        self.bind(fed_group)

    def fingerprint(self) -> str:
        """Digest of parameter names, global shapes, dtypes, local shard shapes and placements."""
        return fingerprint(self.names, self.params)

    def check_alignment(self) -> None:
        """Compare what each channel's members sync, across its group; raise `ShardAlignmentError` naming the first
        mismatch. Changes nothing."""
        if self.seat is None:
            described = [(describe(self.names, self.params), self.groups[0])]
        else:
            plan, dtypes = self.layout.plan(), [str(p.dtype) for p in self.params]
            described = [(plan.describe(key, self.names, dtypes), group)
                         for key, group in zip(self.layout.channels, self.groups)]
        check_descriptors(described, local_shard(self.params[0]).device)
        self._aligned = True

    # ----- the global state ---------------------------------------------------------------------------------
    @property
    def keeps_global(self) -> bool:
        """Whether this sync keeps global shards (and rule state), which then belong in checkpoints."""
        return self.state.keeps

    def capture_global(self) -> None:
        """The current shards become the global model (the start of a sync period), when kept."""
        self.state.capture(self.layout)

    def broadcast_global(self, group: dist.ProcessGroup | None, source: int = 0) -> None:
        """Copy the global state of rank `source` of `group` to its other ranks (None: over each bucket's channel)."""
        self.state.broadcast([group if group is not None else self.groups[self.layout.channel_of(k)]
                              for k in range(len(self.layout.buckets))], source)

    # ----- a sync: start, then finish ---------------------------------------------------------------------------
    @property
    def in_flight(self) -> bool:
        return self._flight is not None or self._received is not None

    def sync(self, weight: float, *, alpha: float = 0.0, apply_rule: bool = True, dense: bool = False) -> SyncStats:
        """A blocking sync: `start` and `finish` at once."""
        self.start(weight, overlap=False, dense=dense)
        return self.finish(alpha=alpha, apply_rule=apply_rule)

    @torch.no_grad()
    def start(self, weight: float, *, overlap: bool, dense: bool = False, adopted: int = 0) -> None:
        """Begin a sync of this member's `weight` (its tokens since the last one; the same on every rank of the
        group). `overlap`: copy the buckets out now and reduce them in the background (linear rules only). `dense`:
        a top-k sync sends every entry through its values' wire this time (a warm-up or a flush). `adopted`: the
        merges this member's group adopted so far; the sync is rejected everywhere if a member is `behind`."""
        if not weight > 0:
            raise ValueError(f"FedAvg weight must be > 0, got {weight}")
        if self.in_flight:
            raise RuntimeError("a sync of this fragment is already in flight")
        self.overlap.await_abandoned()
        if self.groups[0] is None:
            raise RuntimeError("this sync is not bound to a federation's process groups")
        if overlap and not self.rule.linear:
            raise ValueError(f"{type(self.rule).__name__} is not linear: an overlapped sync reduces one mean")
        if self.state.keeps and not self.state.captured:
            why = (f"{type(self.rule).__name__} steps from the global model" if self.rule.stateful else
                   f"a {self.wire.name} wire sends deltas from the global model")
            raise RuntimeError(f"{why}: call capture_global() before training starts")
        if not self._aligned:
            self.check_alignment()  # collective over the federation's groups
        views = self.layout.views()
        if self.delta and not self._reserved:
            self.wire.reserve(self._workspace, self.layout.largest(), views[0][0].device)
            self._reserved = True
        flight = Flight(weight, True, None, None, None, time.perf_counter(), dense=dense, adopted=adopted)
        self.confirmed = None
        if overlap:
            self.overlap.copy_out(flight, views, self.layout, origins=self.carry or self.bound.enabled)
        sent = [[send] for send in flight.sends] if overlap else [shard_segments for _, shard_segments, _ in views]
        flight.norms = bucket_norms(sent) if self.bound.enabled else None
        flight.ok = self.verdict([seg for bucket in sent for seg in bucket], weight, self.max_weight, flight.norms)
        self._flight = flight
        if overlap:
            self.overlap.launch(flight, self._reduce)

    def finish(self, *, alpha: float = 0.0, apply_rule: bool = True, timeout: float | None = None) -> SyncStats:
        """Complete the sync and write the result into the shards: `receive`, then `merge`."""
        self.receive(alpha=alpha, apply_rule=apply_rule, timeout=timeout)
        return self.merge()

    def receive(self, *, alpha: float = 0.0, apply_rule: bool = True, timeout: float | None = None) -> None:
        """Complete the sync's reduction; `merge` then writes its result into the shards, where every shard becomes
        alpha * local + (1 - alpha) * global (with `carry`: local + (1 - alpha) * (global - its value at the start)).
        `apply_rule=False` (a linear rule) stops at the weighted mean (a facility's sync on the server path). A
        blocking sync merges as it reduces. Raises `SyncRejected` (nothing was merged; a blocking sync's merged
        buckets are then to be rolled back), `TimeoutError` (the sync is still in flight: `abandon` it) or the
        reduction's error."""
        flight = self._flight
        if flight is None:
            raise RuntimeError("no sync of this fragment was started")
        if not apply_rule and not self.rule.linear:
            raise ValueError(f"{type(self.rule).__name__} is not linear: it has no plain-mean level to stop at")
        flight.alpha, flight.apply_rule = alpha, apply_rule
        if flight.thread is not None:
            self.overlap.join(flight, timeout)
        self._flight = None
        if flight.thread is None:
            with torch.no_grad():
                self._reduce(flight)
        elif flight.error is not None:
            raise flight.error
        self._received = flight

    @torch.no_grad()
    def merge(self) -> SyncStats:
        """Write the received sync's result into the shards (an overlapped one's; a blocking one's already is)."""
        flight, self._received = self._received, None
        if flight is None:
            raise RuntimeError("no sync of this fragment was received")
        if flight.thread is not None:
            self.overlap.before_merge()  # the merge reads what the side stream wrote
            for k, (send, (_, shard_segments, _)) in enumerate(zip(flight.sends, self.layout.views())):
                self._merge_bucket(k, send, shard_segments, self.layout.segments_of(k, send), flight)
        return flight.stats(len(self.layout.buckets))

    def abandon(self, timeout: float = 5.0) -> None:
        """Drop a sync in flight (its round failed, or training ended): wait up to `timeout` s for its thread. One
        still running is remembered: the next `start` waits for it (`Overlap.abandoned_wait`), as it writes into the
        snapshot that every fragment shares."""
        self.overlap.abandon(self._flight, timeout)
        self._flight = self._received = None

    def _reduce(self, flight: Flight) -> None:
        """Admission, each bucket's reduction (`flat` holds this rank's values of it, then the members' mean or the
        rule's result) and check, then the members' vote. A blocking sync copies each bucket into the buffer first and
        merges it at once."""
        admitted = admit_channels(self.groups, flight, self.max_weight, local_shard(self.params[0]).device)
        self.left_out, self.confirmed = admitted.left_out, admitted.confirmed
        admitted.raise_if_behind()
        admissions = admitted.channels
        self.bound.begin(flight.weight, flight.ok, flight.norms)
        flight.total = admissions[0].total if admissions[0] is not None else 0.0
        staged, bad = flight.sends is not None, {}  # bad: channel -> its first bucket rejected here
        for k, (flat, shard_segments, buffer_segments) in enumerate(self.layout.views()):
            c = self.layout.channel_of(k)
            if not staged:
                torch._foreach_copy_(buffer_segments, shard_segments)
            if admissions[c] is None:
                continue  # nobody of this channel may contribute: it keeps everyone's values and is rejected
            send, admission, group = flight.sends[k] if staged else flat, admissions[c], self.groups[c]
            rows_ok = True  # no top-k row at fault (`sparse.outlying_rows`): the merge's clip would hide it
            if self.rule.linear:  # the members' weighted mean, through the wire
                scale = admission.mine / admission.total
                if scale == 0.0:
                    send.zero_()  # left out: it sends zeros (NaN * 0 is NaN)
                two_level_topk = self.sites is not None and isinstance(self.wire, SparseWire)  # the site's residual
                residual = (self.state.feedback.residual(k, send) if self.state.feedback is not None
                            and (scale or two_level_topk) else None)
                wire = self.wire.dense() if flight.dense else self.wire
                flight.bytes += wire.reduce(send, self.state.shards[k] if self.delta else None, scale, group,
                                            self._workspace, residual, sites=self.sites)
                if isinstance(wire, SparseWire) and self.bound.enabled:
                    rows_ok = not wire.outliers(self.bound.max_move)
            else:  # every member's values, and the rule's result of them
                members = [torch.empty_like(send) for _ in admission.weights]
                bounded(dist.all_gather, members, send, group=group)
                contributions = [(m, w) for m, w in zip(members, admission.weights) if w > 0]
                self.state.step(k, send, lambda g, st: self.rule.aggregate(g, contributions, st))
                flight.bytes += send.numel() * send.element_size()
            if staged:
                mine = flight.origins[k] if flight.origins is not None else send
                ok = rows_ok and (self.bound.plausible(k, [send], [mine]) if self.bound.enabled
                                  else all_finite([send]))
            else:
                ok = rows_ok and (self.bound.plausible(k, buffer_segments, shard_segments, flat)
                                  if self.bound.enabled else all_finite(buffer_segments))
            if c not in bad and not ok:
                bad[c] = k
            if not staged and c not in bad:
                self._merge_bucket(k, flat, shard_segments, buffer_segments, flight)
        conclude(bad, admitted, self.groups, self.layout, self.bound, self.rule.linear, flight,
                 local_shard(self.params[0]).device)

    def _merge_bucket(self, k: int, mean: torch.Tensor, shard_segments: list[torch.Tensor],
                      mean_segments: list[torch.Tensor], flight: Flight) -> None:
        """Bucket k's mean: the rule steps on it, the global state keeps it, the shards take it in."""
        if flight.apply_rule and self.rule.linear and not isinstance(self.rule, FedAvg):
            self.state.step(k, mean, lambda g, st: self.rule.apply_mean(g, mean, st))
        elif self.delta and isinstance(self.rule, FedAvg):
            self.state.shards[k].copy_(mean)  # the mean is the next sync's global model
        alpha = flight.alpha
        if self.carry and flight.origins is not None:  # origins are scratch from here: global - origin
            for shard, new, origin in zip(shard_segments, mean_segments,
                                          self.layout.segments_of(k, flight.origins[k])):
                shard.add_(torch.sub(new, origin, out=origin), alpha=1.0 - alpha)
        elif alpha == 0.0:
            torch._foreach_copy_(shard_segments, mean_segments)
        else:
            for shard, new in zip(shard_segments, mean_segments):
                shard.mul_(alpha).add_(new, alpha=1.0 - alpha)
        if isinstance(self.wire, SparseWire) and self.wire.restart and self.state.feedback is not None:
            self._restart_from_residual(k, shard_segments)

    def _restart_from_residual(self, k: int, shard_segments: list[torch.Tensor]) -> None:
        """Bucket k's shards += this rank's residual, which then starts anew from zero (`SparseWire.restart`)."""
        residual = self.state.feedback.residuals.get(str(k))
        if residual is None:
            return  # left out of this sync: nothing of its own was held back
        torch._foreach_add_(shard_segments, self.layout.segments_of(k, self.wire.carried(residual)))
        residual.zero_()

    # ----- outside a sync -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step_rule(self) -> None:
        """Treat the current shards as the members' weighted mean and step the (linear) rule on them, locally: the
        server path's last step, once the server's mean arrived."""
        if not self.rule.linear:
            raise ValueError(f"{type(self.rule).__name__} is not linear: it needs every member's shards, not a mean")
        views = self.layout.views()
        if isinstance(self.rule, FedAvg):
            if self.state.shards is not None:  # the mean is the next sync's global model
                for k, (global_k, (_, shard_segments, _)) in enumerate(zip(self.state.shards, views)):
                    torch._foreach_copy_(self.layout.segments_of(k, global_k), shard_segments)
            return
        if not self.state.captured:
            raise RuntimeError(f"{type(self.rule).__name__} steps from the global model: call capture_global() "
                               f"before training starts")
        for k, (flat, shard_segments, buffer_segments) in enumerate(views):
            torch._foreach_copy_(buffer_segments, shard_segments)
            self.state.step(k, flat, lambda g, st: self.rule.apply_mean(g, flat, st))
            torch._foreach_copy_(shard_segments, buffer_segments)

    @torch.no_grad()
    def broadcast(self, group: dist.ProcessGroup | None, source: int = 0) -> None:
        """Copy the shards of rank `source` of `group` to its other ranks, one broadcast per bucket (FL+HSDP's
        replicas; a member's shards to a newcomer). None: over each bucket's channel, from member `source`."""
        for k, (flat, shard_segments, buffer_segments) in enumerate(self.layout.views()):
            over = group if group is not None else self.groups[self.layout.channel_of(k)]
            sends = dist.get_rank(over) == source
            if sends:
                torch._foreach_copy_(buffer_segments, shard_segments)
            bounded(dist.broadcast, flat, group=over, group_src=source)
            if not sends:
                torch._foreach_copy_(shard_segments, buffer_segments)


__all__ = ["Groups", "ShardSync", "local_shard"]
