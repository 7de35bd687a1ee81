"""A shard sync's verdict over its channels (each a process group of one rank of every member): before the reduction
each channel admits its members (`admit_channels`: one all-gather each of weights, verdicts and counts of adopted
merges), after it the members vote on the result channel by channel (`conclude`), and a rejected result's first bad
bucket is searched for the members who sent it (`flwr_sharded.parallel.offender`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from flwr_sharded.parallel.admission import Admission, SyncRejected, admit, behind, vote
from flwr_sharded.parallel.buckets import BucketLayout
from flwr_sharded.parallel.flight import Flight
from flwr_sharded.parallel.offender import identify
from flwr_sharded.parallel.plausibility import MoveBound


@dataclass
class Admitted:
    """Each channel's admission of one sync."""

    channels: list[Admission | None]
    """None: no member of that channel may contribute (`refused` says why; raised when the sync concludes, after the
    other channels' collectives)."""
    refused: dict[int, SyncRejected]
    left_out: list[int]
    """The members (indices in the federation group) some channel left out."""
    lagging: list[int]
    """The members whose count of adopted merges is behind the others' (`admission.behind`)."""

    @property
    def confirmed(self) -> bool | None:
        """Whether every member brought the same count of adopted merges (every merge before this sync stands);
        None: no channel admitted anyone."""
        return not self.lagging if any(a is not None for a in self.channels) else None

    def raise_if_behind(self) -> None:
        """`SyncRejected` on every member when one is `behind` (each channel holds one rank of every member, and a
        member's count is its group's)."""
        if self.lagging:
            raise SyncRejected(f"member(s) {self.lagging} of the federation group did not adopt a merge the others "
                               f"adopted since the last confirmation: no member keeps it", offenders=self.lagging)


def admit_channels(groups: list[dist.ProcessGroup | None], flight: Flight, max_weight: float | None,
                   device: torch.device) -> Admitted:
    """Each channel's admitted weights of `flight`'s weight, verdict and adopted merges (one all-gather each)."""
    channels: list[Admission | None] = []
    refused: dict[int, SyncRejected] = {}
    for c, group in enumerate(groups):
        try:
            channels.append(admit(flight.weight, flight.ok, max_weight, group, device, flight.adopted))
        except SyncRejected as exc:
            refused[c] = exc
            channels.append(None)
    return Admitted(channels, refused, left_out=sorted({j for a in channels if a is not None for j in a.left_out}),
                    lagging=sorted({j for a in channels if a is not None for j in behind(a.adopted)}))


def conclude(bad: dict[int, int], admitted: Admitted, groups: list[dist.ProcessGroup | None], layout: BucketLayout,
             bound: MoveBound, linear: bool, flight: Flight, device: torch.device) -> None:
    """The members' vote, channel by channel (`bad`: channel -> the first bucket this rank rejected). Adopted
    everywhere: its moves join the history. Rejected: the members of a rejecting channel search the first bucket any
    of them rejected for its offender (a linear rule with a bounded move), then `SyncRejected` is raised on every
    member of it, naming the offenders found."""
    rejected: SyncRejected | None = None
    offenders: set[int] = set()
    for c, group in enumerate(groups):
        if admitted.channels[c] is None:
            rejected = rejected or admitted.refused[c]
            continue
        buckets = layout.channel_buckets[c]
        try:
            vote(c not in bad, group, device, first_bad=buckets.index(bad[c]) if c in bad else None)
        except SyncRejected as exc:
            rejected = rejected or exc
            if exc.bucket is not None and bound.enabled and linear:
                k = buckets[exc.bucket]
                if flight.sends is not None:  # the origin holds this rank's contribution (the move is bounded)
                    flat, intact = flight.origins[k], True
                else:  # copied in again: its values, unless this rank wrote the result (found it plausible)
                    flat, shard_segments, buffer_segments = layout.views()[k]
                    torch._foreach_copy_(buffer_segments, shard_segments)
                    intact = bad.get(c) == k
                offenders.update(identify(flat, intact, admitted.channels[c].weights, bound, k, group))
    if rejected is None:
        bound.record()
        return
    bound.discard()
    if offenders:
        rejected.offenders = sorted(offenders)
        rejected.args = (f"{rejected.args[0]}; member(s) {rejected.offenders} of the federation group sent it "
                         f"(their contributions alone explain it)",)
    raise rejected
