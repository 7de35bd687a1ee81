"""Overlapped, fragmented shard syncs (Streaming DiLoCo, Douillard et al. 2025, shard-to-shard under FSDP2).

The model's parameters are cut into N fragments of contiguous transformer blocks (`fragment_parameters`), each with
its own `ShardSync` (buckets, outer-rule state). Within every period of A steps, fragment i syncs at the boundary
b_i = round((i + 1) A / N) (`Schedule`): with a delay tau > 0 its values are copied out (`OverlappedSync.start`)
tau steps before the boundary, reduced across the groups by a communication thread while training goes on, and
merged at the boundary (`wait`, `merge`) as alpha * local + (1 - alpha) * global, so the slow link carries about 1/N of
the model at a time, and carries it while the groups compute. tau = 0 is `ShardSync.sync` at each boundary.

Every step of the reduction is `ShardSync`'s own (`reduce_bucket`, `finish_bucket`), so an overlapped sync computes
the values a blocking sync of the same snapshot would; the inner optimizer never sees a half-written shard (merges
happen between optimizer steps, on the main thread). Linear rules only: the thread reduces one weighted mean.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Sequence

import torch
from torch import nn

from flwr_sharded.parallel.outer import FedAvg
from flwr_sharded.parallel.schedule import Schedule
from flwr_sharded.parallel.sync import ShardSync, SyncStats


def fragment_parameters(model: nn.Module, blocks: Sequence[nn.Module],
                        fragments: int) -> list[list[tuple[str, nn.Parameter]]]:
    """Cut `model`'s named parameters into `fragments` groups of contiguous blocks, in parameter order: what comes
    before the first block (embeddings) goes with the first group, what follows the last block (final norm, output
    head) with the last one. ValueError if there are more fragments than blocks."""
    if not 1 <= fragments <= len(blocks):
        raise ValueError(f"{fragments} fragments of a model with {len(blocks)} blocks: at most one per block")
    block_of = {id(p): b for b, block in enumerate(blocks) for p in block.parameters()}
    out: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(fragments)]
    seen_block = False
    for name, param in model.named_parameters():
        b = block_of.get(id(param))
        if b is not None:
            seen_block = True
            out[b * fragments // len(blocks)].append((name, param))
        else:
            out[-1 if seen_block else 0].append((name, param))
    return out


class Snapshot:
    """One reusable byte buffer for the snapshots of overlapped syncs that are never in flight at the same time (the
    fragments of one model): its size is the largest fragment's, not the model's."""

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


class OverlappedSync:
    """One fragment's sync in flight: a snapshot of its buckets, reduced by a background thread, merged later."""

    def __init__(self, sync: ShardSync, snapshot: Snapshot | None = None, origin: Snapshot | None = None,
                 carry: bool = False) -> None:
        self.sync = sync
        self.snapshot = snapshot or Snapshot()
        self.origin = origin if origin is not None or not (carry or sync.bound.enabled) else Snapshot()
        """Where the shards are kept as they were at the sync's start (when the result's move is checked, or the
        merge carries): this rank's contribution, which the result's plausibility is measured against (and its
        offender searched in), and from which a carrying merge adds the steps since."""
        self.carry = carry
        self._origins: list[torch.Tensor] | None = None
        self._sends: list[torch.Tensor] = []
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._bytes, self._total, self._started = 0, 0.0, 0.0
        self._waited = False
        self._stream = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    @torch.no_grad()
    def start(self, weight: float) -> None:
        """Copy this rank's values of every bucket (the snapshot the groups will average) and reduce them in a
        thread; training may go on at once. A replica > 0 starts nothing: it receives the result when it merges."""
        s = self.sync
        if not s.rule.linear:
            raise ValueError(f"{type(s.rule).__name__} is not linear: an overlapped sync reduces one mean")
        if not weight > 0:
            raise ValueError(f"FedAvg weight must be > 0, got {weight}")
        if self.in_flight:
            raise RuntimeError("a sync of this fragment is already in flight")
        if s.fed_group is not None and s.keeps_global and not s.has_outer_state:
            raise RuntimeError("call capture_global() before training starts: the sync sends deltas from it")
        if not s.aligned:
            s.check_alignment()  # collective over the federation group (replica 0) and the replicas
        views = s.bucket_views()
        self._sends = self.snapshot.views([flat for flat, _, _ in views])
        for k, (send, (_, shard_segments, _)) in enumerate(zip(self._sends, views)):
            torch._foreach_copy_(s.segments_of(k, send), shard_segments)
        if self.origin is not None:
            self._origins = self.origin.views(self._sends)
            torch._foreach_copy_(self._origins, self._sends)
        self._error, self._bytes, self._total, self._started = None, 0, 0.0, time.perf_counter()
        if s.fed_group is None:  # nothing to reduce here; merge() receives the result from replica 0
            return
        ok, norms = s.own_verdict([[send] for send in self._sends], weight)
        if self._sends[0].is_cuda:  # the copies above run on the current stream
            self._stream = self._stream or torch.cuda.Stream(device=self._sends[0].device)
            self._stream.wait_stream(torch.cuda.current_stream(self._sends[0].device))
        self._thread = threading.Thread(target=self._reduce, args=(weight, ok, norms),
                                        name="flwr-sharded-sync", daemon=True)
        self._thread.start()

    def _reduce(self, weight: float, ok: bool, norms: list[float] | None) -> None:
        try:
            stream = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
            with torch.no_grad(), stream:
                admissions = self.sync.admit(weight, ok)
                self.sync.bound.begin(weight, ok, norms)
                self._total = admissions[0].total if admissions[0] is not None else 0.0
                for k, send in enumerate(self._sends):
                    if admissions[self.sync.channel_of(k)] is not None:
                        self._bytes += self.sync.reduce_bucket(k, send, self.sync.share(k, admissions))
                self._conclude(admissions)  # before any merge
                if self._stream is not None:
                    self._stream.synchronize()
        except BaseException as exc:  # noqa: BLE001 - raised by wait() on the main thread
            self._error = exc

    def _conclude(self, admissions: list) -> None:
        """The members' vote on the reduced snapshot, each bucket checked against this rank's contribution (the
        origin; without one, finiteness only); raises `SyncRejected`, naming the offenders found, if rejected."""
        s, origins = self.sync, self._origins
        bad: dict[int, int] = {}  # channel -> its first bucket rejected here
        for k, send in enumerate(self._sends):
            c = s.channel_of(k)
            # no origin: the move is not bounded, and `accepts` checks finiteness only (the contribution unread)
            if admissions[c] is not None and c not in bad and not s.accepts(
                    k, [send], [origins[k] if origins is not None else send]):
                bad[c] = k
        s.conclude(bad, admissions, self._sends[0].device, lambda k: (origins[k], True))  # origins: when checked

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the reduction; raises what it raised (then nothing may be merged: roll back)."""
        if self._thread is None:
            raise RuntimeError("no sync of this fragment is in flight")
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the overlapped sync did not complete within {timeout} s")
        self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        self._waited = True

    @torch.no_grad()
    def merge(self, *, alpha: float = 0.0, apply_rule: bool = True) -> SyncStats:
        """Merge the reduced snapshot (after `wait` on replica 0; replicas > 0 call it directly): the rule steps on
        the groups' mean, replicas receive it, and every shard becomes alpha * local + (1 - alpha) * global."""
        s = self.sync
        if s.fed_group is not None and not self._waited:
            raise RuntimeError("merge() before wait(): the reduction may still be running")
        self._waited = False
        for k, (send, (_, shard_segments, _)) in enumerate(zip(self._sends, s.bucket_views())):
            origin = s.segments_of(k, self._origins[k]) if self.carry else None
            s.finish_bucket(k, send, shard_segments, s.segments_of(k, send), apply_rule=apply_rule, alpha=alpha,
                            origin_segments=origin)
        if s.fed_group is not None and s.delta and isinstance(s.rule, FedAvg):
            s.store_global(self._sends)  # the mean, not the alpha-mixed shards
        return SyncStats(seconds=time.perf_counter() - self._started,
                         buckets=len(self._sends) if s.fed_group is not None else 0, bytes=self._bytes,
                         total_weight=self._total)

    def abandon(self, timeout: float = 5.0) -> None:
        """Drop a sync in flight (its round failed): wait a little for the thread, forget its result."""
        if self._thread is not None:
            self._thread.join(timeout)
        self._thread, self._error, self._waited = None, None, False


class FragmentedSync:
    """The shard syncs of a model cut into fragments, presented as one sync: what spans fragments (fingerprint,
    rebinding to a round's groups, outer state, broadcasts, the server path's rule step) goes to each in order;
    `sync_fragment`, `start`, `wait` and `merge` act on one. One fragment and no delay is exactly a `ShardSync`."""

    def __init__(self, syncs: list[ShardSync], schedule: Schedule, carry: bool = False) -> None:
        if len(syncs) != schedule.fragments:
            raise ValueError(f"{len(syncs)} syncs for a schedule of {schedule.fragments} fragments")
        self.fragments = syncs
        self.schedule = schedule
        snapshot = Snapshot()  # the schedule never has two fragments in flight at once
        checked = any(s.bound.enabled for s in syncs)  # the result's move is measured against the origin
        origin = Snapshot() if carry or checked else None
        self.flights = [OverlappedSync(s, snapshot, origin, carry=carry) for s in syncs]

    # ----- one fragment ---------------------------------------------------------------------------------------
    def sync_fragment(self, i: int, weight: float, *, apply_rule: bool = True, alpha: float = 0.0) -> SyncStats:
        """A blocking sync of fragment i."""
        return self.fragments[i].sync(weight, apply_rule=apply_rule, alpha=alpha)

    def start(self, i: int, weight: float) -> None:
        self.flights[i].start(weight)

    def wait(self, i: int, timeout: float | None = None) -> None:
        """Wait for fragment i's reduction; raises its error (then nothing is merged)."""
        self.flights[i].wait(timeout)

    def merge(self, i: int, *, alpha: float, apply_rule: bool = True) -> SyncStats:
        return self.flights[i].merge(alpha=alpha, apply_rule=apply_rule)

    def abandon(self, timeout: float = 5.0) -> None:
        """Drop every sync in flight (a round failed, or training ended mid-period), waiting at most `timeout`
        seconds for its thread."""
        for flight in self.flights:
            flight.abandon(timeout)

    def params(self, i: int) -> list[torch.Tensor]:
        return self.fragments[i].params

    # ----- every fragment -------------------------------------------------------------------------------------
    def sync(self, weight: float, *, apply_rule: bool = True) -> SyncStats:
        """A blocking sync of every fragment, one after the other."""
        stats = [s.sync(weight, apply_rule=apply_rule) for s in self.fragments]
        return SyncStats(seconds=sum(x.seconds for x in stats), buckets=sum(x.buckets for x in stats),
                         bytes=sum(x.bytes for x in stats), total_weight=stats[0].total_weight)

    def fingerprint(self) -> str:
        return "|".join(s.fingerprint() for s in self.fragments)

    def set_max_weight(self, max_weight: float | None) -> None:
        """The largest weight a member may bring to the next syncs (`flwr_sharded.parallel.admission`)."""
        for s in self.fragments:
            s.max_weight = max_weight

    def rebind(self, fed_group: object, rep_group: object = None) -> None:
        for s in self.fragments:
            s.rebind(fed_group, rep_group)

    @property
    def keeps_global(self) -> bool:
        return self.fragments[0].keeps_global

    @property
    def has_outer_state(self) -> bool:
        return self.fragments[0].has_outer_state

    def capture_global(self) -> None:
        for s in self.fragments:
            s.capture_global()

    def outer_state_dict(self) -> dict[str, object]:
        return {"fragments": [s.outer_state_dict() for s in self.fragments]}

    def load_outer_state_dict(self, state: dict[str, object]) -> None:
        saved = state["fragments"]
        if len(saved) != len(self.fragments):
            raise ValueError(f"outer state of {len(saved)} fragments, this sync has {len(self.fragments)}")
        for s, sd in zip(self.fragments, saved):
            s.load_outer_state_dict(sd)

    def broadcast(self, group: object, source: int = 0) -> None:
        for s in self.fragments:
            s.broadcast(group, source)

    def broadcast_outer_state(self, group: object, source: int = 0) -> None:
        for s in self.fragments:
            s.broadcast_outer_state(group, source)

    def reseat(self, seat: object, fed_group: object, rep_group: object = None) -> None:
        """Every fragment's `ShardSync.reseat` (a round whose members shard differently)."""
        for s in self.fragments:
            s.reseat(seat, fed_group, rep_group)

    def step_rule(self) -> None:
        for s in self.fragments:
            s.step_rule()
