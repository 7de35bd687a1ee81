"""A round's results at the ServerApp: bounded collects, and the news to the survivors when a member is gone.

A SuperNode handles one message at a time, so a message for a group whose round is running cannot overtake the
collect in front of it. Each collect therefore waits at most `collect-interval` seconds for the round's result; a
member whose round still runs answers `pending` and gets another collect. When a member is gone - its start or its
collect failed, its round ended with a failed sync, or its node went offline - every member of the same round (same
prefix) whose round still runs gets an abort message first (`query.abort`, naming the gone member indices), which
its ClientApp hands to the group's endpoint: that round's rendezvous waits end at once, instead of at
`rendezvous-timeout`. Delivery takes at most one collect interval plus the SuperNode's polling.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from logging import INFO, WARNING

from flwr.app import Message
from flwr.serverapp import Grid
from flwr.supercore import log

from flwr_sharded.flower import messages as M
from flwr_sharded.flower.server.grid import Polling, message, push, reply_payload


@dataclass
class Member:
    """One member of a round as the collect loop follows it."""

    node: int
    job: str
    prefix: str
    index: int
    server_round: int
    group_id: str
    result: Message | None = None
    """The reply that ends its round (its failed start, or its collect's final reply)."""
    gone: str = ""
    """Why it will not take part in any further sync of the round ('' while it may)."""

    @classmethod
    def of(cls, train: Message) -> Member:
        c = dict(train.content.config_records[M.CONFIG])
        return cls(train.metadata.dst_node_id, str(c["job"]), str(c["prefix"]), int(c["member-index"]),
                   int(c["server-round"]), train.metadata.group_id)


def train_and_collect(grid: Grid, messages: list[Message], *, round_timeout: float, collect_interval: float,
                      polling: Polling) -> list[Message]:
    """Push the train messages and one collect per member right behind them; return each member's round result (a
    failed start stands for it). Members whose result does not come before `round_timeout` are left out."""
    members = {m.metadata.dst_node_id: Member.of(m) for m in messages}
    deadline = time.monotonic() + round_timeout
    waiting: dict[str, tuple[int, str]] = {mid: (node, "start") for mid, node in push(grid, messages).items()}
    for node, member in members.items():
        if node not in {n for n, _ in waiting.values()}:
            member.gone = "the SuperLink did not take its train message"
    _collect(grid, [m for m in members.values() if not m.gone], waiting, deadline, collect_interval)
    told: set[tuple[int, int]] = set()  # (node told, gone node)
    next_check = time.monotonic() + polling.node_check
    def running() -> bool:
        return any(m.result is None and not m.gone for m in members.values())

    while running():
        for reply in grid.pull_messages(list(waiting)):
            node, kind = waiting.pop(reply.metadata.reply_to_message_id, (None, ""))
            if node is not None:
                _take(grid, members[node], kind, reply, waiting, deadline, collect_interval)
        now = time.monotonic()
        if now >= deadline or not running():  # the last result: no poll interval more
            break
        if now >= next_check:
            next_check = now + polling.node_check
            _offline(grid, members, waiting)
        _tell_survivors(grid, members, told, deadline)
        time.sleep(min(polling.interval, max(0.0, deadline - now)))
    late = sorted(m.node for m in members.values() if m.result is None and not m.gone)
    if late:
        log(WARNING, "no round result from node(s) %s within %.0f s", late, round_timeout)
    return [m.result for m in members.values() if m.result is not None]


def _collect(grid: Grid, members: list[Member], waiting: dict[str, tuple[int, str]], deadline: float,
             interval: float) -> None:
    left = deadline - time.monotonic()
    if not members or left <= 0:
        return
    wait = max(1.0, min(interval, left - 5.0))
    collects = [message(m.node, M.MSG_COLLECT, {"job": m.job, "server-round": m.server_round, "timeout": wait},
                        m.group_id, left) for m in members]
    waiting.update({mid: (node, "collect") for mid, node in push(grid, collects).items()})


def _take(grid: Grid, member: Member, kind: str, reply: Message, waiting: dict[str, tuple[int, str]],
          deadline: float, interval: float) -> None:
    metrics, error = reply_payload(reply)
    if kind == "start":
        if error:  # its collect will fail too: stop waiting for it
            member.result, member.gone = reply, f"its round did not start: {error}"
            for mid in [mid for mid, (node, _) in waiting.items() if node == member.node]:
                del waiting[mid]
        return
    if kind != "collect":
        return  # an abort's acknowledgement
    if not error and metrics.get("pending"):
        _collect(grid, [member], waiting, deadline, interval)
        return
    member.result = reply
    if error:
        member.gone = error
    elif metrics.get("sync_failed"):
        member.gone = f"its sync failed ({str(metrics.get('sync_error', ''))[:120]})"


def _offline(grid: Grid, members: dict[int, Member], waiting: dict[str, tuple[int, str]]) -> None:
    try:
        online = set(grid.get_node_ids())
    except Exception:  # noqa: BLE001 - keep waiting until the deadline
        return
    for member in members.values():
        if member.result is None and not member.gone and member.node not in online:
            log(WARNING, "node %d went offline; not waiting for its reply", member.node)
            member.gone = "its node went offline"
            for mid in [mid for mid, (node, _) in waiting.items() if node == member.node]:
                del waiting[mid]


def _tell_survivors(grid: Grid, members: dict[int, Member], told: set[tuple[int, int]], deadline: float) -> None:
    """An abort to each running member for the members of its round that are gone and it was not told of yet."""
    left = deadline - time.monotonic()
    aborts = []
    for survivor in members.values():
        if survivor.result is not None or survivor.gone:
            continue
        gone = [m for m in members.values() if m.gone and m.prefix == survivor.prefix
                and (survivor.node, m.node) not in told]
        if not gone or left <= 0:
            continue
        told.update((survivor.node, m.node) for m in gone)
        every = sorted(m.index for m in members.values() if m.gone and m.prefix == survivor.prefix)
        reason = "; ".join(f"member {m.index} (node {m.node}): {m.gone[:160]}" for m in gone)
        log(INFO, "round %s: telling node %d that member(s) %s are gone", survivor.prefix, survivor.node, every)
        aborts.append(message(survivor.node, M.MSG_ABORT, {"prefix": survivor.prefix, "gone": every,
                                                           "reason": reason, "timeout": 30.0},
                              survivor.group_id, left))
    if aborts:
        push(grid, aborts)  # their acknowledgements are not awaited
