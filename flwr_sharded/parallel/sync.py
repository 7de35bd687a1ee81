"""Shard-to-shard federated averaging: every rank averages its local shards with the same shards of the other groups
(or, when the groups shard differently, each piece of them with its owners in the other groups: `sync_plan`).

The model is never gathered. A sync packs this rank's shards into flat buckets (`buckets.BucketLayout`), admits the
members (`admission`), reduces each bucket over its channel's process group through the wire (`wire`: the weighted
shards, or weighted deltas from the global shards in a narrower dtype), checks each result (`plausibility`), has the
members vote on it, and merges it into the shards, stepping the rule (`rules`) on the way. One path for both kinds:
a blocking sync copies, reduces and merges bucket by bucket through one reusable buffer; an overlapped one copies
every bucket out when it starts (`Snapshot`), reduces them in a background thread (a side CUDA stream on GPUs)
while training goes on, and merges them later, between two optimizer steps.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch
import torch.distributed as dist

from flwr_sharded.parallel.admission import Admission, SyncRejected, admit, all_finite, behind, healthy, vote
from flwr_sharded.parallel.alignment import check_descriptors, describe, fingerprint, local_shard
from flwr_sharded.parallel.buckets import BucketLayout
from flwr_sharded.parallel.collectives import bounded
from flwr_sharded.parallel.global_state import ErrorFeedback, GlobalState
from flwr_sharded.parallel.offender import identify
from flwr_sharded.parallel.plausibility import DEFAULT_MAX_MOVE, MoveBound, bucket_norms
from flwr_sharded.parallel.rules import FedAvg, ShardRule
from flwr_sharded.parallel.sites import SiteGroups, why_not_two_level
from flwr_sharded.parallel.sparse import DEFAULT_ERROR_DECAY, DEFAULT_MERGE, SparseWire, TopkMerge
from flwr_sharded.parallel.sync_plan import Owners, Seat
from flwr_sharded.parallel.wire import QUANTIZED, WIRES, wire_of
from flwr_sharded.parallel.workspace import Workspace

Groups = dist.ProcessGroup | SiteGroups | Mapping[Owners, dist.ProcessGroup] | None
"""What a sync runs over: one process group (groups shard alike), its two-level groups (`sites`), each channel's
keyed by its owners, or none."""


@dataclass
class SyncStats:
    """What one sync did on this rank."""

    seconds: float
    """Wall time from its start to its merge."""
    buckets: int
    """Collectives issued over the federation's groups."""
    bytes: int
    """Payload bytes this rank sent over them."""
    total_weight: float
    """Sum of the admitted members' weights."""


class Snapshot:
    """One reusable byte buffer for copies of buckets that are never held at the same time (the fragments of one
    model: at most one is in flight), sized to the largest."""

    def __init__(self) -> None:
        self._storage: torch.Tensor | None = None

    def views(self, like: list[torch.Tensor]) -> list[torch.Tensor]:
        """Tensors shaped and typed as `like`, laid out one after the other in the buffer (grown if needed)."""
        sizes = [t.numel() * t.element_size() for t in like]
        if self._storage is None or self._storage.numel() < sum(sizes) or self._storage.device != like[0].device:
            self._storage = torch.empty(sum(sizes), dtype=torch.uint8, device=like[0].device)
        out, offset = [], 0
        for t, size in zip(like, sizes):
            out.append(self._storage[offset:offset + size].view(t.dtype).view(t.shape))
            offset += size
        return out


@dataclass
class _Flight:
    """One sync from its start to its merge."""

    weight: float
    ok: bool
    """This member's own verdict on what it sends."""
    norms: list[float] | None
    sends: list[torch.Tensor] | None
    """The buckets as copied out at the start (overlapped); None: copied in one by one (blocking)."""
    origins: list[torch.Tensor] | None
    """The shards at the start (overlapped, when the move is bounded or the merge carries)."""
    started: float
    dense: bool = False
    """A top-k sync that sends every entry this time."""
    adopted: int = 0
    """The merges this member's group adopted so far, brought to the admission (`admission.behind`)."""
    alpha: float = 0.0
    apply_rule: bool = True
    thread: threading.Thread | None = None
    error: BaseException | None = None
    bytes: int = 0
    total: float = 0.0


class ShardSync:
    """Weighted averaging of this rank's local shards (one fragment of the model) with the other members'.

    Args:
        named_params: the (name, parameter) pairs to average, in the same order on every member.
        fed_group: the federation's process group(s) (`Groups`); None until bound (`bind`), or on ranks that never
            join the reduction (FL+HSDP replicas other than 0: they receive the result by `broadcast`).
        bucket_bytes: the size of the one flat buffer reused for every collective.
        rule: how shards combine (`flwr_sharded.parallel.rules`); FedAvg by default. Rules that are not linear
            all-gather each bucket (F buckets in memory) and cannot overlap or use a reduced wire.
        wire_dtype: the reduction's dtype (`flwr_sharded.parallel.wire.WIRES`); None: the shards' own. Another one
            sends weighted deltas from the global shards (fp32 shards, a linear rule), which are then kept.
        error_feedback: carry each rank's rounding errors (and what top-k left out) into its next sync.
        max_move: a result is adopted only if it moves no bucket by more than this many times its recent moves
            (`flwr_sharded.parallel.plausibility`); 0: finiteness only.
        topk: send only this fraction of each chunk's delta entries (`flwr_sharded.parallel.sparse`); None: dense.
        topk_merge, error_decay: how the top-k rows merge, and the factor on its residual before each selection.
        seat: where this rank sits among groups that shard differently; None: every group shards alike.
        snapshot, origin: the buffers an overlapped sync copies its buckets and its shards into (shared by the
            fragments of one model); None: its own.
        carry: an overlapped merge keeps the local steps taken since the sync started.
        restart_residual: after a top-k sync, this rank's shards become the global values plus its residual (what it
            did not send), which leaves the error-feedback buffer: the residual travels in the model.
    """

    def __init__(self, named_params: Iterable[tuple[str, torch.Tensor]], *, fed_group: Groups,
                 bucket_bytes: int = 64 << 20, rule: ShardRule | None = None, wire_dtype: torch.dtype | None = None,
                 error_feedback: bool = False, max_move: float = DEFAULT_MAX_MOVE, topk: float | None = None,
                 topk_merge: TopkMerge = DEFAULT_MERGE, error_decay: float = DEFAULT_ERROR_DECAY,
                 seat: Seat | None = None, snapshot: Snapshot | None = None, origin: Snapshot | None = None,
                 carry: bool = False, restart_residual: bool = False) -> None:
        named = list(named_params)
        if not named:
            raise ValueError("ShardSync needs at least one parameter")
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.rule = rule or FedAvg()
        self.layout = BucketLayout(self.names, self.params, seat, bucket_bytes)
        buckets = self.layout.buckets
        # a reduced (or top-k) wire: the reduction sends weighted deltas from the global shards, in `wire_dtype`
        self.delta = topk is not None or wire_dtype is not None and any(b.dtype != wire_dtype for b in buckets)
        if self.delta and not self.rule.linear:
            raise ValueError(f"{type(self.rule).__name__} is not linear: it all-gathers every member's shards, which "
                             f"a reduced wire dtype ({wire_dtype}) cannot carry as one delta; use a linear rule or "
                             f"the shards' dtype")
        if self.delta and any(b.dtype != torch.float32 for b in buckets):
            raise ValueError(f"a wire dtype ({wire_dtype}) other than the shards' needs fp32 shards, got "
                             f"{sorted({str(b.dtype) for b in buckets})}")
        values = wire_of(wire_dtype or torch.float32) if self.delta else WIRES["float32"]
        self.wire = SparseWire(values, topk, topk_merge, error_decay) if topk is not None else values
        if error_feedback and not self.wire.error_feedback:
            raise ValueError(f"error feedback needs a quantized wire dtype ({', '.join(QUANTIZED)}) or top-k, not "
                             f"{wire_dtype}")
        if topk is not None and not error_feedback:
            raise ValueError("a top-k sync needs error feedback")
        if restart_residual and (topk is None or self.wire.merge == "sum"):
            raise ValueError("restarting from the global values plus the residual needs a top-k sync merged by "
                             "scatter-mean")
        self.restart_residual = restart_residual
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
        self.snapshot, self.origin, self.carry = snapshot or Snapshot(), origin, carry
        self._workspace = Workspace()
        self._reserved = False
        self._refused: dict[int, SyncRejected] = {}
        self._flight: _Flight | None = None
        self._received: _Flight | None = None
        """An overlapped sync whose reduction arrived (`receive`), not merged yet."""
        self._abandoned: threading.Thread | None = None
        """The thread of an abandoned flight that was still running: it may yet write into the snapshot."""
        self.abandoned_wait = 60.0
        """Seconds `start` waits for an abandoned flight's thread before it refuses to begin."""
        self._stream = None
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
                                    restart_residual=self.restart_residual)
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
        self._await_abandoned()
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
        flight = _Flight(weight, True, None, None, None, time.perf_counter(), dense=dense, adopted=adopted)
        self.confirmed = None
        if overlap:
            if self._stream is not None:  # the last flight's side stream is done with the snapshot before it is reused
                torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
            flight.sends = self.snapshot.views([flat for flat, _, _ in views])
            for k, (send, (_, shard_segments, _)) in enumerate(zip(flight.sends, views)):
                torch._foreach_copy_(self.layout.segments_of(k, send), shard_segments)
            if self.carry or self.bound.enabled:
                self.origin = self.origin or Snapshot()
                flight.origins = self.origin.views(flight.sends)
                torch._foreach_copy_(flight.origins, flight.sends)
        sent = [[send] for send in flight.sends] if overlap else [shard_segments for _, shard_segments, _ in views]
        flight.norms = bucket_norms(sent) if self.bound.enabled else None
        flight.ok = self.verdict([seg for bucket in sent for seg in bucket], weight, self.max_weight, flight.norms)
        self._flight = flight
        if overlap:
            device = views[0][0].device
            if device.type == "cuda":  # the copies above run on the current stream
                self._stream = self._stream or torch.cuda.Stream(device=device)
                self._stream.wait_stream(torch.cuda.current_stream(device))
            flight.thread = threading.Thread(target=self._reduce_in_background, args=(flight,),
                                             name="flwr-sharded-sync", daemon=True)
            flight.thread.start()

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
            flight.thread.join(timeout)
            if flight.thread.is_alive():
                raise TimeoutError(f"the overlapped sync did not complete within {timeout} s")
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
            if self._stream is not None:  # the merge reads what the side stream wrote
                torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
            for k, (send, (_, shard_segments, _)) in enumerate(zip(flight.sends, self.layout.views())):
                self._merge_bucket(k, send, shard_segments, self.layout.segments_of(k, send), flight)
        return SyncStats(seconds=time.perf_counter() - flight.started, buckets=len(self.layout.buckets),
                         bytes=flight.bytes, total_weight=flight.total)

    def abandon(self, timeout: float = 5.0) -> None:
        """Drop a sync in flight (its round failed, or training ended): wait up to `timeout` s for its thread. One
        still running is remembered: the next `start` waits for it (`abandoned_wait`), as it writes into the
        snapshot that every fragment shares."""
        thread = self._flight.thread if self._flight is not None else None
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                self._abandoned = thread
        self._flight = self._received = None

    def _await_abandoned(self) -> None:
        """Wait for an abandoned flight's thread; RuntimeError if it outlives `abandoned_wait`."""
        thread = self._abandoned
        if thread is None:
            return
        thread.join(self.abandoned_wait)
        if thread.is_alive():
            raise RuntimeError(f"an abandoned sync of this fragment is still running after {self.abandoned_wait} s "
                               f"more (its collective has not returned); a new sync would share its buffers")
        self._abandoned = None

    def _reduce_in_background(self, flight: _Flight) -> None:
        stream = self._stream
        try:
            if stream is not None:  # the thread's current device: else CUDA makes a context on device 0
                torch.cuda.set_device(stream.device)
            with torch.no_grad(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                try:
                    self._reduce(flight)
                finally:  # the side stream's work is done before finish() (or a new flight) touches the buffers
                    if stream is not None:
                        stream.synchronize()
        except BaseException as exc:  # noqa: BLE001 - raised by finish() on the main thread
            flight.error = exc

    def _reduce(self, flight: _Flight) -> None:
        """Admission, each bucket's reduction (`flat` holds this rank's values of it, then the members' mean or the
        rule's result) and check, then the members' vote. A blocking sync copies each bucket into the buffer first and
        merges it at once."""
        admissions = self._admit(flight.weight, flight.ok, flight.adopted)
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
                admitted = [(m, w) for m, w in zip(members, admission.weights) if w > 0]
                self.state.step(k, send, lambda g, st: self.rule.aggregate(g, admitted, st))
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
        self._conclude(bad, admissions, flight)

    def _merge_bucket(self, k: int, mean: torch.Tensor, shard_segments: list[torch.Tensor],
                      mean_segments: list[torch.Tensor], flight: _Flight) -> None:
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
        if self.restart_residual and self.state.feedback is not None:
            self._restart_from_residual(k, shard_segments)

    def _restart_from_residual(self, k: int, shard_segments: list[torch.Tensor]) -> None:
        """Bucket k's shards += this rank's residual, which then starts anew from zero (`restart_residual`)."""
        residual = self.state.feedback.residuals.get(str(k))
        if residual is None:
            return  # left out of this sync: nothing of its own was held back
        torch._foreach_add_(shard_segments, self.layout.segments_of(k, self.wire.carried(residual)))
        residual.zero_()

    def _admit(self, weight: float, ok: bool, adopted: int) -> list[Admission | None]:
        """Each channel's admitted weights (one all-gather each), None for a channel where no member may contribute
        (its `SyncRejected` is raised when the sync concludes, after the other channels' collectives). Every
        member's count of adopted merges sets `confirmed`; with a member `behind`, `SyncRejected` at once (on every
        member: each channel holds one rank of every member, and a member's count is its group's)."""
        device = local_shard(self.params[0]).device
        admissions: list[Admission | None] = []
        self._refused = {}
        for c, group in enumerate(self.groups):
            try:
                admissions.append(admit(weight, ok, self.max_weight, group, device, adopted))
            except SyncRejected as exc:
                self._refused[c] = exc
                admissions.append(None)
        self.left_out = sorted({j for a in admissions if a is not None for j in a.left_out})
        lagging = sorted({j for a in admissions if a is not None for j in behind(a.adopted)})
        if any(a is not None for a in admissions):
            self.confirmed = not lagging
        if lagging:
            raise SyncRejected(f"member(s) {lagging} of the federation group did not adopt a merge the others "
                               f"adopted since the last confirmation: no member keeps it", offenders=lagging)
        return admissions

    def _conclude(self, bad: dict[int, int], admissions: list[Admission | None], flight: _Flight) -> None:
        """The members' vote, channel by channel. Adopted everywhere: its moves join the history. Rejected: the
        members of a rejecting channel search the first bucket any of them rejected for its offender, then
        `SyncRejected` is raised on every member of it, naming the offenders found."""
        rejected: SyncRejected | None = None
        offenders: set[int] = set()
        device = local_shard(self.params[0]).device
        for c, group in enumerate(self.groups):
            if admissions[c] is None:
                rejected = rejected or self._refused[c]
                continue
            buckets = self.layout.channel_buckets[c]
            try:
                vote(c not in bad, group, device, first_bad=buckets.index(bad[c]) if c in bad else None)
            except SyncRejected as exc:
                rejected = rejected or exc
                if exc.bucket is not None and self.bound.enabled and self.rule.linear:
                    k = buckets[exc.bucket]
                    if flight.sends is not None:  # the origin holds this rank's contribution (the move is bounded)
                        flat, intact = flight.origins[k], True
                    else:  # copied in again: its values, unless this rank wrote the result (found it plausible)
                        flat, shard_segments, buffer_segments = self.layout.views()[k]
                        torch._foreach_copy_(buffer_segments, shard_segments)
                        intact = bad.get(c) == k
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


__all__ = ["Groups", "ShardSync", "Snapshot", "SyncStats", "local_shard"]
