"""Bounded message exchange with Flower's Grid: push, then pull replies until all came, a deadline passed, or the
awaited nodes went offline. (Flower's own `Grid.send_and_receive` and `FedAvg.sample_nodes` can wait forever.)"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from logging import WARNING
from typing import Any

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

from flwr_sharded.flower import messages as M


@dataclass
class Polling:
    """How often the ServerApp looks at the Grid."""

    interval: float = 0.1
    """Seconds between two pulls of replies."""
    node_check: float = 2.0
    """Seconds between two checks that the awaited nodes are still online."""


def message(node: int, message_type: str, config: dict[str, Any], group_id: str, ttl: float) -> Message:
    """A config-only message (its TTL equals the wait, so a late reply is dropped by Flower)."""
    return Message(RecordDict({M.CONFIG: ConfigRecord(config)}), node, message_type, ttl=ttl, group_id=group_id)


def push(grid: Grid, messages: list[Message]) -> dict[str, int]:
    """Push `messages`; returns message id -> destination node of those the SuperLink took."""
    ids = list(grid.push_messages(messages))
    return {mid: m.metadata.dst_node_id for mid, m in zip(ids, messages) if mid}


def await_replies(grid: Grid, pending: dict[str, int], deadline: float, polling: Polling,
                  on_reply: Callable[[Message], Message] | None = None) -> list[Message]:
    """Pull the replies to `pending` (message id -> node) until all arrived, `deadline` passed, or the awaited nodes
    went offline; answered and given-up ids leave `pending`, which then holds those still unanswered.

    `on_reply` sees each reply as it arrives (e.g. to fold its arrays into an aggregate and drop them); what it
    returns is kept. With `on_reply`, replies are pulled one at a time, so only one is in this process at once.
    """
    replies: list[Message] = []
    next_check = time.monotonic() + polling.node_check
    while pending:
        batches = [[mid] for mid in pending] if on_reply is not None else [list(pending)]
        for batch in batches:
            for reply in grid.pull_messages(batch):
                if pending.pop(reply.metadata.reply_to_message_id, None) is not None:
                    replies.append(on_reply(reply) if on_reply is not None else reply)
        now = time.monotonic()
        if not pending or now >= deadline:
            break
        if now >= next_check:
            next_check = now + polling.node_check
            try:
                online = set(grid.get_node_ids())
            except Exception:  # noqa: BLE001 - keep waiting until the deadline
                online = set(pending.values())
            for mid, node in list(pending.items()):
                if node not in online:
                    log(WARNING, "node %d went offline; not waiting for its reply", node)
                    del pending[mid]
        time.sleep(min(polling.interval, max(0.0, deadline - now)))
    return replies


def send_and_receive(grid: Grid, messages: list[Message], timeout: float, polling: Polling,
                     on_reply: Callable[[Message], Message] | None = None) -> list[Message]:
    """Push `messages` and await their replies for at most `timeout` seconds (see `await_replies`)."""
    if not messages:
        return []
    pending = push(grid, messages)
    replies = await_replies(grid, pending, time.monotonic() + timeout, polling, on_reply)
    if pending:
        log(WARNING, "no reply from node(s) %s within %.0f s", sorted(set(pending.values())), timeout)
    return replies


def reply_info(reply: Message | None) -> dict[str, Any]:
    if reply is None or reply.has_error():
        return {}
    return dict(reply.content.config_records.get(M.INFO, {}))


def reply_payload(reply: Message | None) -> tuple[dict[str, Any], str]:
    """(metrics, error): error is '' for a good reply, else why the group cannot be used."""
    if reply is None:
        return {}, "no reply before the deadline"
    if reply.has_error():
        return {}, f"Flower error {reply.error.code}: {reply.error.reason}"
    info = reply_info(reply)
    metrics = dict(reply.content.metric_records.get(M.METRICS, {}))
    if not info.get("ok", False):
        return metrics, str(info.get("error") or "the group reported a failure")
    return metrics | {k: v for k, v in info.items() if k not in ("ok", "error")}, ""


def run_id(grid: Grid) -> int:
    try:
        return int(grid.run.run_id)
    except Exception:  # noqa: BLE001 - a grid without a run (tests)
        return 0
