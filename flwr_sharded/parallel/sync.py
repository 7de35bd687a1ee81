"""Shard-to-shard federated averaging: every rank averages its local shards with the same shards of the other groups
(or, when the groups shard differently, each piece of them with its owners in the other groups: `sync_plan`).

The model is never gathered. Local shards are packed into one reusable flat bucket (scaled by this group's FedAvg
weight on the way in), each bucket is all-reduced (SUM) over the federation process group, and the result is copied
back. In FL+HSDP only replica 0 of each group joins the cross-group all-reduce and then broadcasts each bucket over
its replication group, so every replica of every group ends bit-identical.

With a reduced wire dtype (e.g. bfloat16, as DiLoCo-style systems send), the all-reduce carries the weighted delta
from the global model (the outer gradient) instead of the shards, so precision is lost only on that delta; every
participating rank keeps the global shards in fp32 and adds the reduced delta back in fp32.

The process groups are arguments: a static torchrun world passes its mesh's groups, a Flower round passes the
groups it formed for that round's members.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist

from flwr_sharded.errors import ConfigError
from flwr_sharded.parallel.admission import Admission, SyncRejected, admit, all_finite, healthy, vote
from flwr_sharded.parallel.alignment import check_alignment, check_descriptors, fingerprint, local_shard
from flwr_sharded.parallel.buckets import itemsize, plan_buckets
from flwr_sharded.parallel.offender import identify
from flwr_sharded.parallel.outer import FedAvg, ShardRule
from flwr_sharded.parallel.plausibility import DEFAULT_MAX_MOVE, MoveBound, bucket_norms
from flwr_sharded.parallel.quantize import ErrorFeedback, Workspace
from flwr_sharded.parallel.sparse import SparseWire
from flwr_sharded.parallel.sync_plan import Owners, Seat, SyncPlan
from flwr_sharded.parallel.sync_state import OuterState
from flwr_sharded.parallel.wire import QUANTIZED, WIRES, wire_of


@dataclass
class SyncStats:
    """What one sync did on this rank."""

    seconds: float
    """Wall time of the sync on this rank."""
    buckets: int
    """Collectives issued over the federation group (0 for ranks that only receive the broadcast)."""
    bytes: int
    """Payload bytes this rank all-reduced over the federation group."""
    total_weight: float
    """Sum of the weights of the groups that took part (0 when unknown on this rank)."""


class ShardSync(OuterState):
    """Weighted FedAvg of this rank's local parameter shards over a federation process group.

    Args:
        named_params: the (name, parameter) pairs to average, in the same order on every group.
        fed_group: process group of the ranks holding the same shard in each participating group; None on ranks that
            do not join the cross-group all-reduce (FL+HSDP replicas other than 0, or a single group).
        rep_group: replication group to broadcast the result over (FL+HSDP), with this group's replica 0 as source.
        bucket_bytes: capacity of the one flat buffer reused for every collective.
        rule: how shards are combined (`flwr_sharded.parallel.outer`); FedAvg by default. Stateful rules (outer
            optimizers) keep the global shards and their state per bucket (fp32, on this rank's device); rules that
            are not linear all-gather each bucket from every group (F buckets in memory).
        wire_dtype: dtype of the cross-group all-reduce; None: the shards' own. A dtype other than the shards' (which
            must then be fp32) sends the weighted delta from the global shards through that wire
            (`flwr_sharded.parallel.wire.WIRES`: a second buffer of a narrower float, or blockwise quantized and
            summed in fp32); the global shards are then kept for every rule (FedAvg too). Linear rules only.
        error_feedback: with a quantized or top-k wire, carry each rank's rounding errors (and what top-k left out)
            into its next sync of the same bucket (`quantize.ErrorFeedback`); part of the outer state.
        topk: send only this fraction of each chunk's delta entries, largest first, all-gathered as (index, value)
            rows in `wire_dtype` (`flwr_sharded.parallel.sparse`; fp32 shards, needs `error_feedback`); None: dense.
        max_move: a result is adopted only if it moves no bucket of any rank's shards by more than this many times
            the bucket's recent moves (`flwr_sharded.parallel.plausibility`); a rejected one names its offender
            where one member alone explains it (`flwr_sharded.parallel.offender`). 0: finiteness only.
        seat: where this rank sits among groups that shard differently (`flwr_sharded.parallel.sync_plan`): the
            sync then runs piece by piece over channels, and `fed_group` maps each channel's owners to its process
            group; None: every group shards alike, and `fed_group` is one group of the same shard index.
    """

    def __init__(self, named_params: Iterable[tuple[str, torch.Tensor]], *, fed_group: dist.ProcessGroup | None,
                 rep_group: dist.ProcessGroup | None = None, bucket_bytes: int = 64 << 20,
                 rule: ShardRule | None = None, wire_dtype: torch.dtype | None = None,
                 error_feedback: bool = False, max_move: float = DEFAULT_MAX_MOVE, topk: float | None = None,
                 seat: Seat | None = None) -> None:
        named = list(named_params)
        if not named:
            raise ValueError("ShardSync needs at least one parameter")
        rule = rule or FedAvg()
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.seat = seat
        """Where this rank sits among groups that shard differently; None: every group shards alike."""
        self.bucket_bytes = bucket_bytes
        self.groups: list[dist.ProcessGroup | None] = []
        """Each channel's process group (None on ranks that do not join the cross-group reduction)."""
        self._plan()
        self.rebind(fed_group, rep_group)
        self._buffer: torch.Tensor | None = None
        self._views: list[tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]] | None = None
        self._pointers: list[int] = []
        self.rule = rule
        self.wire_dtype = wire_dtype
        # a reduced (or top-k) wire: the reduction sends weighted deltas from the global shards, in `wire_dtype`
        self.delta = topk is not None or wire_dtype is not None and any(b.dtype != wire_dtype for b in self._buckets)
        if self.delta and not rule.linear:
            raise ValueError(f"{type(rule).__name__} is not linear: it all-gathers every member's shards, which a "
                             f"reduced wire dtype ({wire_dtype}) cannot carry as one delta; use a linear rule or "
                             f"the shards' dtype")
        if self.delta and any(b.dtype != torch.float32 for b in self._buckets):
            raise ValueError(f"a wire dtype ({wire_dtype}) other than the shards' needs fp32 shards, got "
                             f"{sorted({str(b.dtype) for b in self._buckets})}")
        values = wire_of(wire_dtype or torch.float32) if self.delta else WIRES["float32"]
        self.wire = SparseWire(values, topk) if topk is not None else values
        """How a bucket travels (`flwr_sharded.parallel.wire`): the shards as they are, or deltas in `wire_dtype`
        (all of them, or their top-k rows: `flwr_sharded.parallel.sparse`)."""
        if error_feedback and not self.wire.error_feedback:
            raise ValueError(f"error feedback needs a quantized wire dtype ({', '.join(QUANTIZED)}) or top-k, not "
                             f"{wire_dtype}")
        if topk is not None and not error_feedback:
            raise ValueError("a top-k sync needs error feedback")
        self.feedback = ErrorFeedback() if error_feedback else None
        self._workspace = Workspace() if self.delta else None
        self._global: list[torch.Tensor] | None = None
        self._rule_state: list[dict[str, torch.Tensor]] | None = None
        self.max_weight: float | None = None
        """The largest weight a member may bring to a sync (`flwr_sharded.parallel.admission`); None: unchecked."""
        self._refused: dict[int, SyncRejected] = {}
        self.left_out: list[int] = []
        """The members (indices in the federation group) the last sync's admission left out."""
        self.bound = MoveBound(max_move)
        """How far a result may move this rank's buckets, and the moves adopted so far."""

    # ----- planning -------------------------------------------------------------------------------------------
    def _plan(self) -> None:
        """This rank's channels (`_plan_channels`) and their buckets, each channel cut alike on all its members."""
        self.channels, ranges = self._plan_channels()
        self._buckets = plan_buckets(ranges, [local_shard(p).dtype for p in self.params], self.bucket_bytes)
        self._channel_buckets = [[k for k, b in enumerate(self._buckets) if b.channel == c]
                                 for c in range(len(self.channels))]

    def reseat(self, seat: Seat | None, fed_group: dist.ProcessGroup | Mapping[Owners, dist.ProcessGroup] | None,
               rep_group: dist.ProcessGroup | None = None) -> None:
        """Sync as `seat` from now on (a round whose members shard differently, or alike: None) over `fed_group`
        (`rebind`): the buckets are planned anew, the outer state carried over element by element (`relayout`) and
        the move history restarted (its buckets are other ones)."""
        if seat != self.seat:
            old, self.seat = self._buckets, seat
            self._plan()
            self.relayout(old, [local_shard(p).numel() for p in self.params])
            self._buffer, self._views = None, None
            self.bound = MoveBound(self.bound.max_move)
        self.rebind(fed_group, rep_group)

    def _plan_channels(self) -> tuple[list[Owners], list[list[tuple[int, int, int]]]]:
        """This rank's channels and, per channel, the (shard, start, end) element ranges it syncs there: every
        shard whole in one channel when the groups shard alike, else its pieces (`flwr_sharded.parallel.sync_plan`)."""
        if self.seat is None:
            return [()], [[(i, 0, local_shard(p).numel()) for i, p in enumerate(self.params)]]
        plan = self.plan()
        for i, (name, p) in enumerate(zip(self.names, self.params)):
            expected = plan.expected_numel(i, self.seat.group, self.seat.shard)
            if local_shard(p).numel() != expected:
                raise ConfigError(f"'{name}' holds {local_shard(p).numel()} elements on shard {self.seat.shard} of "
                                  f"group {self.seat.group}, but the sync plan of groups S={list(self.seat.layouts)} "
                                  f"expects {expected} (FSDP2's row chunking on dim 0)")
        ranges = plan.local_ranges(self.seat.group, self.seat.shard)
        if not ranges:
            raise ConfigError(f"shard {self.seat.shard} of group {self.seat.group} (S={self.seat.layouts[self.seat.group]}"
                              f") holds no row of any parameter: no sync plan of groups S={list(self.seat.layouts)} "
                              f"can serve it; give that group a smaller S (group-shards)")
        return list(ranges), list(ranges.values())

    def plan(self) -> SyncPlan:
        """The pieces of these parameters under the groups' layouts (`seat`)."""
        return SyncPlan(self.seat.layouts, tuple(tuple(p.shape) for p in self.params))

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def bucket_views(self) -> list[tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]]:
        """Per bucket: (flat buffer view, views of the shard segments, matching views into the buffer).

        Built on the first sync, when the one reusable buffer is allocated, and rebuilt if a shard was reallocated.
        """
        pointers = [local_shard(p).data_ptr() for p in self.params]
        if self._views is not None and pointers == self._pointers:
            return self._views
        if self._buffer is None:
            largest = max(b.numel * itemsize(b.dtype) for b in self._buckets)
            self._buffer = torch.empty(largest, dtype=torch.uint8, device=local_shard(self.params[0]).device)
            if self.delta:
                self.wire.reserve(self._workspace, max(b.numel for b in self._buckets), self._buffer.device)
        shards = [local_shard(p).view(-1) for p in self.params]
        self._views = []
        for bucket in self._buckets:
            flat = self._buffer[:bucket.numel * itemsize(bucket.dtype)].view(bucket.dtype)
            self._views.append((flat, [shards[s.shard][s.start:s.end] for s in bucket.segments],
                                [flat[s.offset:s.offset + s.end - s.start] for s in bucket.segments]))
        self._pointers = pointers
        return self._views

    # ----- alignment ------------------------------------------------------------------------------------------
    def fingerprint(self) -> str:
        """Digest of parameter names, global shapes, dtypes, local shard shapes and placements."""
        return fingerprint(self.names, self.params)

    def check_alignment(self) -> None:
        """Compare fingerprints across the federation group (each channel's pieces across its group, when the groups
        shard differently); raise `ShardAlignmentError` naming the first mismatch (on the other replicas too, told
        by replica 0). Changes nothing."""
        if self.seat is None:
            check_alignment(self.names, self.params, self.fed_group, self.rep_group)
        else:
            plan, dtypes = self.plan(), [str(p.dtype) for p in self.params]
            described = [(plan.describe(key, self.names, dtypes), group) for key, group in zip(self.channels, self.groups)]
            check_descriptors(described if self.fed_group is not None else [], self.rep_group,
                              local_shard(self.params[0]).device)
        self._aligned = True

    @property
    def aligned(self) -> bool:
        """Whether the alignment with the current peers was checked (`check_alignment`)."""
        return self._aligned

    @property
    def fed_group(self) -> dist.ProcessGroup | None:
        """The process group of this rank's (first) channel; None on ranks that do not join the reduction."""
        return self.groups[0] if self.groups else None

    def rebind(self, fed_group: dist.ProcessGroup | Mapping[Owners, dist.ProcessGroup] | None,
               rep_group: dist.ProcessGroup | None = None) -> None:
        """Sync over other groups from now on (a new round's members), keeping buckets, buffer and rule state:
        one process group, or, when the groups shard differently, every channel's (keyed by its owners).

        The alignment with the new peers is checked again before the next sync.
        """
        if fed_group is None:
            self.groups = [None] * len(self.channels)
        elif self.seat is None:
            self.groups = [fed_group]
        else:
            missing = [key for key in self.channels if key not in fed_group]
            if missing:
                raise ValueError(f"no process group for channel(s) {missing} of shard {self.seat.shard} of group "
                                 f"{self.seat.group}")
            self.groups = [fed_group[key] for key in self.channels]
        self.rep_group = rep_group
        self._aligned = False

    # ----- the sync -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def sync(self, weight: float, *, apply_rule: bool = True, alpha: float = 0.0) -> SyncStats:
        """Replace every local shard by the rule's aggregate (by default the `weight`-weighted mean) over all groups;
        with `alpha` > 0, by alpha * local + (1 - alpha) * aggregate.

        `weight` is this federation group's weight (e.g. tokens it processed since the last sync); every rank of
        the group passes the same value. Weights are normalised by their sum over the participating groups.
        `apply_rule=False` (a linear rule only) stops at the weighted mean: the lower level of a hierarchical
        federation, whose top level (`step_rule`) runs the outer optimizer. Members that are not finite or whose
        weight exceeds `max_weight` are left out (`flwr_sharded.parallel.admission`); raises `SyncRejected` on every
        member if none is left or the result is not finite or not plausible on some member (`max_move`; the shards are
        then to be rolled back), naming the offender where its search finds one (`SyncRejected.offenders`).
        """
        if not apply_rule and not self.rule.linear:
            raise ValueError(f"{type(self.rule).__name__} is not linear: it has no plain-mean level to stop at")
        if not weight > 0:
            raise ValueError(f"FedAvg weight must be > 0, got {weight}")
        if not self._aligned:
            self.check_alignment()
        if self.fed_group is not None and self.keeps_global and self._global is None:
            raise RuntimeError(f"{self._needs_global()}: call capture_global() before training starts")
        start = time.perf_counter()
        nbytes = 0
        views = self.bucket_views()
        joins = self.fed_group is not None
        admissions: list[Admission | None] = []
        bad: dict[int, int] = {}  # channel -> its first bucket rejected here; it and its later ones keep our values
        if joins:
            ok, norms = self.own_verdict([shard_segments for _, shard_segments, _ in views], weight)
            admissions = self.admit(weight, ok)
            self.bound.begin(weight, ok, norms)
        for k, (flat, shard_segments, buffer_segments) in enumerate(views):
            c = self.channel_of(k)
            torch._foreach_copy_(buffer_segments, shard_segments)
            if joins and admissions[c] is None:
                continue  # nobody of this channel may contribute: it keeps everyone's values and is rejected
            if joins and self.rule.linear:
                nbytes += self.reduce_bucket(k, flat, self.share(k, admissions))
            elif joins:
                weights = admissions[c].weights
                members = [torch.empty_like(flat) for _ in weights]
                dist.all_gather(members, flat, group=self.groups[c])
                admitted = [(m, w) for m, w in zip(members, weights) if w > 0]
                self._apply(k, flat, lambda g, st: self.rule.aggregate(g, admitted, st))
                nbytes += flat.numel() * flat.element_size()
            if joins and c not in bad and not self.accepts(k, buffer_segments, shard_segments, flat):
                bad[c] = k
            if c not in bad:
                self.finish_bucket(k, flat, shard_segments, buffer_segments,
                                   apply_rule=apply_rule and self.rule.linear, alpha=alpha)
        if joins:

            def contribution(k: int) -> tuple[torch.Tensor, bool]:
                flat, shard_segments, buffer_segments = views[k]
                torch._foreach_copy_(buffer_segments, shard_segments)
                return flat, bad.get(self._buckets[k].channel) == k  # not written: still this rank's values

            self.conclude(bad, admissions, flat.device, contribution)  # raises on every member unless adopted
        if joins and self.delta and isinstance(self.rule, FedAvg):
            self.store_global()  # after every bucket succeeded: a failed sync leaves the global shards as they were
        total = admissions[0].total if joins else 0.0
        return SyncStats(seconds=time.perf_counter() - start, buckets=len(views) if joins else 0, bytes=nbytes,
                         total_weight=total)

    def own_verdict(self, buckets: list[list[torch.Tensor]], weight: float) -> tuple[bool, list[float] | None]:
        """This member's verdict on what it sends (`buckets`: their segments) and, when the move is bounded, each
        bucket's norm from the same pass (for `MoveBound.begin`)."""
        norms = bucket_norms(buckets) if self.bound.enabled else None
        return healthy([seg for bucket in buckets for seg in bucket], weight, self.max_weight, norms), norms

    def accepts(self, k: int, means: list[torch.Tensor], contribution: list[torch.Tensor],
                whole: torch.Tensor | None = None) -> bool:
        """Whether bucket k's reduced values (`means`, laid out as `contribution`, this rank's values of it; `whole`:
        the flat bucket holding them) are finite, and plausible when the move is bounded
        (`flwr_sharded.parallel.plausibility`), on this rank."""
        if self.bound.enabled:
            return self.bound.plausible(k, means, contribution, whole)
        return all_finite(means)

    def conclude(self, bad: dict[int, int], admissions: list[Admission | None], device: torch.device,
                 contribution: Callable[[int], tuple[torch.Tensor, bool]]) -> None:
        """The members' vote on this sync's result, channel by channel (`bad`: each channel's first bucket this rank
        rejected; `admissions`: each channel's, None where nobody could contribute); adopted everywhere: its moves
        join the history. Rejected: the members of a rejecting channel search the first bucket any of them rejected
        for its offender (`contribution(k)`: a flat tensor of bucket k and whether it holds this rank's values),
        then `SyncRejected` is raised on every member of it, naming the offenders found."""
        rejected: SyncRejected | None = None
        offenders: set[int] = set()
        for c, group in enumerate(self.groups):
            if admissions[c] is None:
                rejected = rejected or self._refused[c]
                continue
            mine = self._channel_buckets[c].index(bad[c]) if c in bad else None
            try:
                vote(c not in bad, group, device, first_bad=mine)
            except SyncRejected as exc:
                rejected = rejected or exc
                if exc.bucket is not None and self.bound.enabled and self.rule.linear:
                    k = self._channel_buckets[c][exc.bucket]
                    flat, intact = contribution(k)
                    offenders.update(identify(flat, intact, admissions[c].weights, self.bound, k, group))
        if rejected is None:
            self.bound.record()
            return
        self.bound.discard()
        if offenders:
            rejected.offenders = sorted(offenders)
            rejected.args = (f"{rejected.args[0]}; member(s) {rejected.offenders} of the federation group sent it "
                             f"(their contributions alone explain it)",)
        raise rejected

    # ----- the steps of a sync, bucket by bucket (shared with the overlapped sync, `parallel/streaming.py`) -----
    def admit(self, weight: float, ok: bool) -> list[Admission | None]:
        """Each channel's admitted weights (`flwr_sharded.parallel.admission.admit`; one all-gather each), None for a
        channel where no member may contribute (its `SyncRejected` is raised when the sync concludes, after the
        other channels' collectives); the members left out anywhere are kept in `left_out`."""
        device = local_shard(self.params[0]).device
        admissions: list[Admission | None] = []
        self._refused = {}
        for c, group in enumerate(self.groups):
            try:
                admissions.append(admit(weight, ok, self.max_weight, group, device))
            except SyncRejected as exc:
                self._refused[c] = exc
                admissions.append(None)
        self.left_out = sorted({j for a in admissions if a is not None for j in a.left_out})
        return admissions

    def channel_of(self, k: int) -> int:
        """The index of bucket k's channel among this rank's."""
        return self._buckets[k].channel

    def share(self, k: int, admissions: list[Admission | None]) -> float:
        """This member's share of bucket k's mean: its admitted weight over its channel's total."""
        admission = admissions[self._buckets[k].channel]
        return admission.mine / admission.total

    def reduce_bucket(self, k: int, flat: torch.Tensor, scale: float) -> int:
        """`flat` holds this rank's values of bucket k; on return it holds the groups' weighted mean (a linear rule's
        input). One all-reduce through the wire (`Wire.reduce`: a quantized one with an 8-bit wire); returns the
        bytes sent. `scale` 0: this member is left out of the sync and sends zeros."""
        if scale == 0.0:
            flat.zero_()  # NaN * 0 is NaN; with a delta wire, flat then holds the zero delta
        residual = self.feedback.residual(k, flat) if self.feedback is not None and scale else None
        return self.wire.reduce(flat, self._global[k] if self.delta else None, scale,
                                self.groups[self._buckets[k].channel], self._workspace, residual)

    def finish_bucket(self, k: int, flat: torch.Tensor, shard_segments: list[torch.Tensor],
                      buffer_segments: list[torch.Tensor], *, apply_rule: bool, alpha: float = 0.0,
                      origin_segments: list[torch.Tensor] | None = None) -> None:
        """Bucket k's groups' mean is in `flat` (replica 0): step the rule on it, broadcast the result to the
        replicas, and write it into the shards, mixed with their current values as alpha * local + (1 - alpha) *
        global (alpha 0: replaced). `origin_segments` (the shards when an overlapped sync started; used as scratch):
        keep the local steps since, local + (1 - alpha) * (global - origin)."""
        if self.fed_group is not None and apply_rule and not isinstance(self.rule, FedAvg):
            self._apply(k, flat, lambda g, st: self.rule.apply_mean(g, flat, st))
        if self.rep_group is not None:
            dist.broadcast(flat, group=self.rep_group, group_src=0)
        if origin_segments is not None:
            for shard_segment, new, origin in zip(shard_segments, buffer_segments, origin_segments):
                shard_segment.add_(torch.sub(new, origin, out=origin), alpha=1.0 - alpha)  # origin := global - origin
        elif alpha == 0.0:
            torch._foreach_copy_(shard_segments, buffer_segments)
        else:
            for shard_segment, new in zip(shard_segments, buffer_segments):
                shard_segment.mul_(alpha).add_(new, alpha=1.0 - alpha)

    @torch.no_grad()
    def step_rule(self) -> None:
        """Treat the current shards as the members' weighted mean and run the (linear) rule on them, locally.

        The server path's last step: the server sends back the mean, each rank steps its own outer state. A no-op
        for FedAvg.
        """
        if not self.rule.linear:
            raise ValueError(f"{type(self.rule).__name__} is not linear: it needs every member's shards, not a mean")
        if isinstance(self.rule, FedAvg):
            if self._global is not None:
                self.store_global()  # the mean is the new global model (a reduced wire sends deltas from it)
            return
        if self._global is None:
            raise RuntimeError(f"{self._needs_global()}: call capture_global() before training starts")
        for k, (flat, shard_segments, buffer_segments) in enumerate(self.bucket_views()):
            torch._foreach_copy_(buffer_segments, shard_segments)
            self._apply(k, flat, lambda g, st: self.rule.apply_mean(g, flat, st))
            torch._foreach_copy_(shard_segments, buffer_segments)

    @torch.no_grad()
    def broadcast(self, rep_group: dist.ProcessGroup | None, source: int = 0) -> None:
        """Copy the shards of rank `source` of `rep_group` to its other ranks, one broadcast per bucket (FL+HSDP:
        replica 0 to the other replicas; a rejoining group: a member's shards to the newcomer). None: over each
        bucket's channel, from member `source` (a newcomer of another layout, after `reseat`)."""
        for k, (flat, shard_segments, buffer_segments) in enumerate(self.bucket_views()):
            group = rep_group if rep_group is not None else self.groups[self.channel_of(k)]
            sends = dist.get_rank(group) == source
            if sends:
                torch._foreach_copy_(buffer_segments, shard_segments)
            dist.broadcast(flat, group=group, group_src=source)
            if not sends:
                torch._foreach_copy_(shard_segments, buffer_segments)

    def segments_of(self, k: int, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of a flat tensor of bucket k's size, laid out as bucket k's shard segments."""
        return [flat[seg.offset:seg.offset + seg.end - seg.start] for seg in self._buckets[k].segments]

    def _apply(self, k: int, flat: torch.Tensor, step: Any) -> None:
        """Run the rule on bucket k: write the new global values into `flat`, keep them (and the state)."""
        global_k = self._global[k] if self._global is not None else None
        state_k = self._rule_state[k] if self._rule_state is not None else {}
        new, state = step(global_k, state_k)
        flat.copy_(new)
        if self.keeps_global:
            self._global[k].copy_(new)
            self._rule_state[k] = state

