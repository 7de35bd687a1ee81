"""Bounded message exchange with Flower's Grid (its own `send_and_receive` can wait forever): every wait ends when
all replies came, a deadline passed or the awaited nodes went offline; and a round's train-and-collect exchange.

A SuperNode handles one message at a time, so a round's result comes back through collects: each waits at most
`collect-interval` for it and a member whose round still runs answers `pending` and gets another. When a member is
gone (its start or collect failed, its sync failed, its node went offline), every running member of the same round
(same prefix) gets an abort naming the gone member indices, which ends that round's rendezvous waits at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

from flwr_sharded.flower.messages import CONFIG, INFO as INFO_RECORD, METRICS, MSG_ABORT, MSG_COLLECT


@dataclass
class Polling:
    """How often the ServerApp looks at the Grid."""

    interval: float = 0.1
    """Seconds between two pulls of replies."""
    node_check: float = 2.0
    """Seconds between two checks that the awaited nodes are still online."""


def message(node: int, message_type: str, config: dict[str, Any], group_id: str, ttl: float) -> Message:
    """A config-only message (its TTL equals the wait, so a late reply is dropped by Flower)."""
    return Message(RecordDict({CONFIG: ConfigRecord(config)}), node, message_type, ttl=ttl, group_id=group_id)


def push(grid: Grid, messages: list[Message]) -> dict[str, int]:
    """Push `messages`; returns message id -> destination node of those the SuperLink took."""
    ids = list(grid.push_messages(messages))
    return {mid: m.metadata.dst_node_id for mid, m in zip(ids, messages) if mid}


def offline(grid: Grid, nodes: set[int]) -> set[int]:
    """Those of `nodes` no longer online (none when the Grid cannot tell), each logged."""
    try:
        gone = nodes - set(grid.get_node_ids())
    except Exception:  # noqa: BLE001 - keep waiting until the deadline
        return set()
    for node in sorted(gone):
        log(WARNING, "node %d went offline; not waiting for its reply", node)
    return gone


def await_replies(grid: Grid, pending: dict[str, int], deadline: float, polling: Polling,
                  on_reply: Callable[[Message], Message] | None = None) -> list[Message]:
    """The replies to `pending` (message id -> node), which then holds those given up on.

    `on_reply` sees each reply as it arrives (e.g. to fold its arrays and drop them) and returns what is kept; with
    it, replies are pulled one at a time, so only one is in this process at once.
    """
    replies: list[Message] = []
    next_check = time.monotonic() + polling.node_check
    while pending:
        for batch in [[mid] for mid in pending] if on_reply is not None else [list(pending)]:
            for reply in grid.pull_messages(batch):
                if pending.pop(reply.metadata.reply_to_message_id, None) is not None:
                    replies.append(on_reply(reply) if on_reply is not None else reply)
        now = time.monotonic()
        if not pending or now >= deadline:
            break
        if now >= next_check:
            next_check = now + polling.node_check
            gone = offline(grid, set(pending.values()))
            for mid in [mid for mid, node in pending.items() if node in gone]:
                del pending[mid]
        time.sleep(min(polling.interval, max(0.0, deadline - now)))
    return replies


def send_and_receive(grid: Grid, messages: list[Message], timeout: float, polling: Polling) -> list[Message]:
    """Push `messages` and await their replies for at most `timeout` seconds."""
    if not messages:
        return []
    pending = push(grid, messages)
    replies = await_replies(grid, pending, time.monotonic() + timeout, polling)
    if pending:
        log(WARNING, "no reply from node(s) %s within %.0f s", sorted(set(pending.values())), timeout)
    return replies


def reply_info(reply: Message | None) -> dict[str, Any]:
    if reply is None or reply.has_error():
        return {}
    return dict(reply.content.config_records.get(INFO_RECORD, {}))


def reply_payload(reply: Message | None) -> tuple[dict[str, Any], str]:
    """(metrics, error): error is '' for a good reply, else why the group cannot be used."""
    if reply is None:
        return {}, "no reply before the deadline"
    if reply.has_error():
        return {}, f"Flower error {reply.error.code}: {reply.error.reason}"
    info = reply_info(reply)
    metrics = dict(reply.content.metric_records.get(METRICS, {}))
    if not info.get("ok", False):
        return metrics, str(info.get("error") or "the group reported a failure")
    return metrics | {k: v for k, v in info.items() if k not in ("ok", "error")}, ""


def run_id(grid: Grid) -> int:
    try:
        return int(grid.run.run_id)
    except Exception:  # noqa: BLE001 - a grid without a run (tests)
        return 0


# ----- a round: train, then collects ------------------------------------------------------------------------------
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
    """Why it takes part in no further sync of the round ('' while it may)."""

    @classmethod
    def of(cls, train: Message) -> Member:
        c = dict(train.content.config_records[CONFIG])
        return cls(train.metadata.dst_node_id, str(c["job"]), str(c["prefix"]), int(c["member-index"]),
                   int(c["server-round"]), train.metadata.group_id)


def train_and_collect(grid: Grid, messages: list[Message], *, round_timeout: float, collect_interval: float,
                      polling: Polling) -> list[Message]:
    """Push the train messages and one collect per member right behind them (so no ClientApp call waits for a group
    whose round has not started); return each member's round result (a failed start stands for it). Members whose
    result does not come before `round_timeout` are left out."""
    members = {m.metadata.dst_node_id: Member.of(m) for m in messages}
    deadline = time.monotonic() + round_timeout
    waiting: dict[str, tuple[int, str]] = {mid: (node, "start") for mid, node in push(grid, messages).items()}
    for node, member in members.items():
        if node not in {n for n, _ in waiting.values()}:
            member.gone = "the SuperLink did not take its train message"
    _collect(grid, [m for m in members.values() if not m.gone], waiting, deadline, collect_interval)
    told: set[int] = set()  # the nodes told their round is aborted
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
            for node in offline(grid, {m.node for m in members.values() if m.result is None and not m.gone}):
                members[node].gone = "its node went offline"
                _forget(waiting, node)
        _tell_survivors(grid, members, told, deadline)
        time.sleep(min(polling.interval, max(0.0, deadline - now)))
    late = sorted(m.node for m in members.values() if m.result is None and not m.gone)
    if late:
        log(WARNING, "no round result from node(s) %s within %.0f s", late, round_timeout)
    return [m.result for m in members.values() if m.result is not None]


def _forget(waiting: dict[str, tuple[int, str]], node: int) -> None:
    for mid in [mid for mid, (n, _) in waiting.items() if n == node]:
        del waiting[mid]


def _collect(grid: Grid, members: list[Member], waiting: dict[str, tuple[int, str]], deadline: float,
             interval: float) -> None:
    left = deadline - time.monotonic()
    if not members or left <= 0:
        return
    wait = max(1.0, min(interval, left - 5.0))
    collects = [message(m.node, MSG_COLLECT, {"job": m.job, "server-round": m.server_round, "timeout": wait},
                        m.group_id, left) for m in members]
    waiting.update({mid: (node, "collect") for mid, node in push(grid, collects).items()})


def _take(grid: Grid, member: Member, kind: str, reply: Message, waiting: dict[str, tuple[int, str]],
          deadline: float, interval: float) -> None:
    metrics, error = reply_payload(reply)
    if kind == "start":
        if error:  # its collect will fail too: stop waiting for it
            member.result, member.gone = reply, f"its round did not start: {error}"
            _forget(waiting, member.node)
    elif kind == "collect" and not error and metrics.get("pending"):
        _collect(grid, [member], waiting, deadline, interval)
    elif kind == "collect":  # else: an abort's acknowledgement
        member.result = reply
        if error:
            member.gone = error
        elif metrics.get("sync_failed"):
            member.gone = f"its sync failed ({str(metrics.get('sync_error', ''))[:120]})"


def _tell_survivors(grid: Grid, members: dict[int, Member], told: set[int], deadline: float) -> None:
    """An abort to each running member of a round with members gone, once: its rendezvous of that round stops
    waiting at the first (a later one could only name more members; a survivor that gives the round up is itself
    no cause for another)."""
    left = deadline - time.monotonic()
    aborts = []
    for survivor in members.values():
        if survivor.result is not None or survivor.gone or left <= 0 or survivor.node in told:
            continue
        gone = [m for m in members.values() if m.gone and m.prefix == survivor.prefix]
        if not gone:
            continue
        told.add(survivor.node)
        every = sorted(m.index for m in members.values() if m.gone and m.prefix == survivor.prefix)
        reason = "; ".join(f"member {m.index} (node {m.node}): {m.gone[:160]}" for m in gone)
        log(INFO, "round %s: telling node %d that member(s) %s are gone", survivor.prefix, survivor.node, every)
        aborts.append(message(survivor.node, MSG_ABORT, {"prefix": survivor.prefix, "gone": every, "reason": reason,
                                                         "timeout": 30.0}, survivor.group_id, left))
    if aborts:
        push(grid, aborts)  # their acknowledgements are not awaited
