"""How a rank's shards are packed into the flat buckets a sync sends: one channel after another (`sync_plan`), each
channel's element ranges grouped by dtype and cut at the bucket size, so that every member of a channel cuts it
into the same buckets, whatever else it holds."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


__all__ = ["Bucket", "Segment", "itemsize", "plan_buckets"]
