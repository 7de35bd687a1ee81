"""How a rank's shards are packed into the flat buckets a sync sends: one channel after another (`sync_plan`), each
channel's element ranges grouped by dtype and cut at the bucket size, so that every member of a channel cuts it
into the same buckets, whatever else it holds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flwr_sharded.errors import ConfigError
from flwr_sharded.parallel.alignment import local_shard
from flwr_sharded.parallel.sync_plan import Owners, Seat, SyncPlan


@dataclass(frozen=True)
class Segment:
    """A contiguous element range of one local shard, placed at `offset` in a bucket."""

    shard: int
    start: int
    end: int
    offset: int


@dataclass(frozen=True)
class Bucket:
    """One collective's worth of a channel: its dtype and the shard segments it packs."""

    dtype: torch.dtype
    segments: list[Segment]
    channel: int
    """The index of its channel among this rank's channels."""

    @property
    def numel(self) -> int:
        return sum(s.end - s.start for s in self.segments)


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def plan_buckets(channels: list[list[tuple[int, int, int]]], dtypes: list[torch.dtype],
                 bucket_bytes: int) -> list[Bucket]:
    """Pack each channel's (shard, start, end) ranges, grouped by the shards' dtype (`dtypes`, one per shard), into
    buckets of at most `bucket_bytes`; a range larger than the room left is split."""
    buckets: list[Bucket] = []
    for c, ranges in enumerate(channels):
        by_dtype: dict[torch.dtype, list[tuple[int, int, int]]] = {}
        for r in ranges:
            by_dtype.setdefault(dtypes[r[0]], []).append(r)
        for dtype, group in by_dtype.items():
            capacity = max(1, bucket_bytes // itemsize(dtype))
            current: list[Segment] = []
            used = 0
            for shard, start, end in group:
                while start < end:
                    take = min(end - start, capacity - used)
                    current.append(Segment(shard, start, start + take, used))
                    used += take
                    start += take
                    if used == capacity:
                        buckets.append(Bucket(dtype, current, c))
                        current, used = [], 0
            if current:
                buckets.append(Bucket(dtype, current, c))
    return buckets


BucketView = tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]
"""(flat buffer view, views of the shard segments, matching views into the buffer) of one bucket."""


class BucketLayout:
    """Where each of a rank's shard elements sits in the buckets of its channels, and the one reusable buffer.

    Args:
        names, params: the parameters a sync averages, in the same order on every member.
        seat: where this rank sits among groups that shard differently (`sync_plan`): its shards are then cut into
            pieces over several channels; None: every shard whole, in one channel.
        bucket_bytes: the buffer's size, and so each bucket's at most.
    """

    def __init__(self, names: list[str], params: list[torch.Tensor], seat: Seat | None, bucket_bytes: int) -> None:
        self.names, self.params, self.seat, self.bucket_bytes = names, params, seat, bucket_bytes
        self.channels, ranges = self._plan_channels()
        self.buckets = plan_buckets(ranges, [local_shard(p).dtype for p in params], bucket_bytes)
        self.channel_buckets = [[k for k, b in enumerate(self.buckets) if b.channel == c]
                                for c in range(len(self.channels))]
        """Per channel, its buckets' indices."""
        self._buffer: torch.Tensor | None = None
        self._views: list[BucketView] | None = None
        self._pointers: list[int] = []

    def _plan_channels(self) -> tuple[list[Owners], list[list[tuple[int, int, int]]]]:
        """This rank's channels and, per channel, the (shard, start, end) element ranges it syncs there."""
        if self.seat is None:
            return [()], [[(i, 0, local_shard(p).numel()) for i, p in enumerate(self.params)]]
        plan, seat = self.plan(), self.seat
        for i, (name, p) in enumerate(zip(self.names, self.params)):
            expected = plan.expected_numel(i, seat.group, seat.shard)
            if local_shard(p).numel() != expected:
                raise ConfigError(f"'{name}' holds {local_shard(p).numel()} elements on shard {seat.shard} of group "
                                  f"{seat.group}, but the sync plan of groups S={list(seat.layouts)} expects "
                                  f"{expected} (FSDP2's row chunking on dim 0)")
        ranges = plan.local_ranges(seat.group, seat.shard)
        if not ranges:
            raise ConfigError(f"shard {seat.shard} of group {seat.group} (S={seat.layouts[seat.group]}) holds no row "
                              f"of any parameter: no sync plan of groups S={list(seat.layouts)} can serve it; give "
                              f"that group a smaller S (group-shards)")
        return list(ranges), list(ranges.values())

    def plan(self) -> SyncPlan:
        """The pieces of these parameters under the groups' layouts (`seat`)."""
        return SyncPlan(self.seat.layouts, tuple(tuple(p.shape) for p in self.params))

    def channel_of(self, k: int) -> int:
        """The index of bucket k's channel among this rank's."""
        return self.buckets[k].channel

    def largest(self) -> int:
        """The most elements of any bucket."""
        return max(b.numel for b in self.buckets)

    def views(self) -> list[BucketView]:
        """Every bucket's views, built with the buffer on first use and again if a shard was reallocated."""
        pointers = [local_shard(p).data_ptr() for p in self.params]
        if self._views is not None and pointers == self._pointers:
            return self._views
        if self._buffer is None:
            largest = max(b.numel * itemsize(b.dtype) for b in self.buckets)
            self._buffer = torch.empty(largest, dtype=torch.uint8, device=local_shard(self.params[0]).device)
        shards = [local_shard(p).view(-1) for p in self.params]
        self._views = []
        for bucket in self.buckets:
            flat = self._buffer[:bucket.numel * itemsize(bucket.dtype)].view(bucket.dtype)
            self._views.append((flat, [shards[s.shard][s.start:s.end] for s in bucket.segments],
                                [flat[s.offset:s.offset + s.end - s.start] for s in bucket.segments]))
        self._pointers = pointers
        return self._views

    def segments_of(self, k: int, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of a flat tensor of bucket k's size, laid out as bucket k's shard segments."""
        return [flat[seg.offset:seg.offset + seg.end - seg.start] for seg in self.buckets[k].segments]

    def move(self, flats: list[torch.Tensor], old: list[Bucket]) -> list[torch.Tensor]:
        """Flat tensors laid out as the buckets `old` (one per bucket), re-cut as this layout's buckets: the same
        values, element by element."""
        shards = [flats[0].new_zeros(local_shard(p).numel()) for p in self.params]
        for flat, bucket in zip(flats, old):
            for seg in bucket.segments:
                shards[seg.shard][seg.start:seg.end] = flat[seg.offset:seg.offset + seg.end - seg.start]
        return [torch.cat([shards[seg.shard][seg.start:seg.end] for seg in b.segments]) for b in self.buckets]


__all__ = ["Bucket", "BucketLayout", "BucketView", "Segment", "itemsize", "plan_buckets"]
