"""Groups that shard differently in one decentralised round: what the strategy checks at hello and at a rejoin, and
what it tells the round's members (every member's S, from which each derives the round's sync plan:
`flwr_sharded.flower.group.channels`; with `group-steps speed`, every member's local steps per sync).

Groups of one S must agree on the model/sharding fingerprint (it covers their local shard shapes); groups of any S
must agree on the model digest (parameter names, global shapes, dtypes). On the decentralised path, a group whose S
leaves a shard without a row of any parameter cannot sit in any sync plan of groups that shard differently: it is
left out at hello, named, before anything trains.
"""

from __future__ import annotations

from logging import ERROR
from typing import Any

from flwr.supercore import log

from flwr_sharded.parallel.sync_plan import shard_rows
from flwr_sharded.parallel.schedule import local_steps


def member_shards(groups: dict[int, Any], members: list[int]) -> list[int]:
    """Every member's S, in member order, when the members shard differently; [] when they shard alike."""
    shards = [groups[n].layout.shards for n in members]
    return shards if len(set(shards)) > 1 else []


def member_steps(groups: dict[int, Any], members: list[int], round_steps: int, group_steps: str) -> list[int]:
    """Every member's local steps per sync of a round of A = `round_steps`, in member order, with `group-steps speed`:
    from each one's step time in its last round (`schedule.local_steps`: the fastest trains A). [] (every member A) with
    `equal`, while a member has no step time yet (its first round, or a rejoin), or when all come out alike."""
    times = [groups[n].step_s for n in members]
    if group_steps != "speed" or len(members) < 2 or min(times) <= 0:
        return []
    steps = list(local_steps(round_steps, times))
    return steps if len(set(steps)) > 1 else []


def layout_of(group: Any) -> str:
    """A group's layout as the run's records name it: "R x S"."""
    return f"{group.layout.replicas}x{group.layout.shards}"


def empty_shards(param_rows: list[int], shards: int) -> list[int]:
    """The shard indices of a group of S = `shards` that hold no row of any parameter."""
    return [s for s in range(shards) if all(shard_rows(rows, shards, s)[0] == shard_rows(rows, shards, s)[1]
                                            for rows in param_rows)]


def seat_refusal(group: Any, layouts: set[int]) -> str:
    """'' when every shard of `group` holds rows to sync with groups of S in `layouts`; else why not."""
    empty = empty_shards(group.param_rows, group.layout.shards)
    if not empty:
        return ""
    return (f"its S={group.layout.shards} leaves shard(s) {empty} without a row of any parameter: no sync plan of "
            f"groups of S={sorted(layouts)} can serve it; relaunch it with a smaller S")


def check_layouts(membership: Any, candidates: dict[int, Any]) -> None:
    """Leave out (logged, named) the candidates whose model differs from the majority's and, on the decentralised
    path, those whose S no sync plan can serve; `candidates` shard differently."""
    membership._keep_majority(candidates, lambda g: g.model_digest, lambda g, common: (
        f"its model (parameter names, shapes and dtypes: digest {g.model_digest[:12]}) differs from the "
        f"majority's {common[:12]}: another model or dtype"))
    if membership.run.federation.aggregation == "server":
        return  # the server combines rows: any shard may be empty
    layouts = {g.layout.shards for g in candidates.values()}
    if len(layouts) < 2:
        return
    for node, g in list(candidates.items()):
        refused = seat_refusal(g, layouts)
        if refused:
            membership.left_out[node] = refused
            log(ERROR, "group on node %d left out: %s", node, refused)
            del candidates[node]


def rejoin_refusal(membership: Any, group: Any, source: Any) -> str:
    """'' when `group` may rejoin and catch up from member `source`; else why not. A group of the source's S must
    match its fingerprint; one of another S its model digest, and sit in a plan with the members."""
    if group.layout.shards == source.layout.shards:
        if group.fingerprint != source.fingerprint:
            return f"fingerprint {group.fingerprint[:12]} != the members' {source.fingerprint[:12]}"
        return ""
    if group.model_digest != source.model_digest:
        return (f"its model (digest {group.model_digest[:12]}) differs from the members' ({source.model_digest[:12]}):"
                f" another model or dtype")
    if membership.run.federation.aggregation == "server":
        return ""
    layouts = {membership.groups[n].layout.shards for n in membership.members} | {group.layout.shards}
    return seat_refusal(group, layouts)
