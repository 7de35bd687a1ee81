"""The offender a rejected sync exposes: its first rejected bucket reduced again, in the open.

After a rejection (`flwr_sharded.parallel.plausibility`) each member all-gathers its contribution of that bucket (F x
one bucket of memory, only then) and judges every admitted member from what it received, taking nobody's word about
itself: a contribution that is not finite is at fault; else, if the mean is implausible here but leaving out exactly
one member makes it plausible (`MoveBound.within`), that member is. The judgements are exchanged (one F x F mask) and
a member is named when more than half the group names it: one liar can neither name an honest member nor clear itself.

Limits: with two members it takes both; several offenders are told apart only by non-finite values (the sync is
rejected all the same, and a robust rule, median or trimmed-mean, bounds them). A member that already wrote the
bucket sends what it wrote (judged like anyone) and, like one whose own values are not finite, judges only
finiteness. Members left out by admission (weight 0) are not judged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flwr_sharded.parallel.admission import all_finite
from flwr_sharded.parallel.collectives import bounded
from flwr_sharded.parallel.plausibility import MoveBound, norm_of
from flwr_sharded.parallel.torch_compat import all_gather_single


def judge(gathered: list[torch.Tensor], weights: list[float], me: int, intact: bool, bound: MoveBound,
          k: int) -> set[int]:
    """The members this rank finds at fault in bucket k, from every member's flat values (`gathered`) and admitted
    weights (0: not judged). `intact`: this rank's entry is still its contribution (else it judges only finiteness)."""
    contributors = [j for j, w in enumerate(weights) if w > 0]
    named = {j for j in contributors if not all_finite([gathered[j]])}
    if named or not intact or not all_finite([gathered[me]]) or len(contributors) < 2:
        return named
    mine, own_norm = [gathered[me]], norm_of([gathered[me]])  # one norm for every candidate

    def mean_without(excluded: int | None) -> torch.Tensor:
        kept = [j for j in contributors if j != excluded]
        total = sum(weights[j] for j in kept)
        out = torch.zeros_like(gathered[me], dtype=torch.float32)
        for j in kept:
            out.add_(gathered[j], alpha=weights[j] / total)
        return out

    if bound.within(k, [mean_without(None)], mine, own_norm):
        return set()  # what they send now is plausible: it names nobody
    explains = [j for j in contributors if bound.within(k, [mean_without(j)], mine, own_norm)]
    return set(explains) if len(explains) == 1 else set()


def identify(flat: torch.Tensor, intact: bool, weights: list[float], bound: MoveBound, k: int,
             group: dist.ProcessGroup) -> list[int]:
    """The members at fault in a rejected sync's bucket k (indices in `group`, the same list on every honest member).
    `flat`: this rank's values of it, its contribution when `intact` (else the result it wrote). Two collectives over
    `group`: the values, the judgements."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    gathered = [torch.empty_like(flat) for _ in range(size)]
    bounded(dist.all_gather, gathered, flat, group=group)
    named = judge(gathered, weights, me, intact, bound, k)
    del gathered
    mine = torch.tensor([1.0 if j in named else 0.0 for j in range(size)], device=flat.device)
    masks = torch.empty(size * size, dtype=torch.float32, device=flat.device)
    bounded(all_gather_single, masks, mine, group=group)
    counts = masks.view(size, size).sum(dim=0).tolist()
    return [j for j, count in enumerate(counts) if 2 * count > size]


__all__ = ["identify", "judge"]
