"""The server path's stream: the facilities' models a chunk of global rows at a time, pulled, averaged and sent back
to every group, pass after pass until one ends with no facility refused.

Each facility has the pulls of the next `PULL_AHEAD` chunks queued while the server averages one, and a facility
leader's apply of chunk c rides in its pull of chunk c + PULL_AHEAD + 1: a chunk costs one message per group and no
SuperNode idles. In this process at once: one chunk's sums, one pulled chunk and the chunk of the mean being sent.
"""

from __future__ import annotations

import math
import time
from logging import WARNING
from typing import Any, Sequence

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

from flwr_sharded import host_memory
from flwr_sharded.flower import shard_files
from flwr_sharded.flower.messages import CONFIG, MSG_APPLY, MSG_PULL
from flwr_sharded.flower.server.aggregation import (ExcludedContributions, ParamSpec, StreamingShardAggregator,
                                                    add_content, fp32_bytes, min_contributors)
from flwr_sharded.flower.server.grid import await_replies, message, push, reply_payload
from flwr_sharded.parallel.shard_transport import PieceLayout, ShardPiece, encode_pieces

MIN_CHUNKS = 16
"""The model travels in at least this many chunks (but see `CHUNK_FLOOR_MB`), so the server holds a fraction of it."""
CHUNK_FLOOR_MB = 8
"""Chunks are not cut smaller than this unless `server-buffer-mb` asks: below it, every extra message costs more
time than the chunk's memory is worth."""
PULL_AHEAD = 1
"""Chunks each facility has pull requests queued for beyond the one the server is averaging."""

Chunk = list[tuple[str, int, int]]
"""Global rows of the model: (parameter, first row, end row) per piece."""


def plan_ranges(spec: dict[str, ParamSpec], budget_bytes: int) -> list[Chunk]:
    """Cut a model into chunks of global rows of at most `budget_bytes` in fp32 (at least one row; a parameter
    larger than the budget is split by rows)."""
    budget = max(1, int(budget_bytes))
    chunks: list[Chunk] = []
    current: Chunk = []
    used = 0
    for name, param in spec.items():
        start, row_bytes = 0, max(1, 4 * math.prod(param.shape[1:]))
        while start < param.rows:
            take = min(param.rows - start, max(1, (budget - used) // row_bytes))
            if current and used + take * row_bytes > budget:
                chunks.append(current)
                current, used = [], 0
                continue
            current.append((name, start, start + take))
            used += take * row_bytes
            start += take
        if used >= budget:
            chunks.append(current)
            current, used = [], 0
    if current:
        chunks.append(current)
    return chunks


def requests_for(pieces: Sequence[PieceLayout], chunk: Chunk) -> list[tuple[str, int, int]]:
    """The rows `(key, start, stop)` (local to each piece) of a group's pieces that hold a chunk's global rows."""
    by_name: dict[str, list[PieceLayout]] = {}
    for piece in pieces:
        by_name.setdefault(piece.name, []).append(piece)
    out = []
    for name, start, stop in chunk:
        for piece in sorted(by_name.get(name, []), key=lambda p: p.row_offset):
            a, b = max(start, piece.row_offset), min(stop, piece.row_offset + piece.rows)
            if a < b:
                out.append((piece.key, a - piece.row_offset, b - piece.row_offset))
    return out


def reject(server_round: int, rejected: dict[str, str], source: str, reason: str, then: str = "") -> None:
    """Leave a facility's shards out of the round: its one log line, and its reason in `rejected`."""
    rejected[source] = reason
    log(WARNING, "round %d: server path: rejected the shards of %s: %s%s", server_round, source, reason, then)


class Stream:
    """One round's stream for `strategy` (a ServerShardFedAvg) over the facility leaders' `manifests` of the model
    `spec`. A chunk holds at most `server-buffer-mb` in fp32 and the larger of a sixteenth of the model and 8 MiB; a
    robust `server-rule` stacks every facility's rows of a chunk, so its chunks are F times smaller."""

    def __init__(self, strategy: Any, grid: Grid, server_round: int,
                 manifests: dict[int, tuple[str, float, list[PieceLayout]]], spec: dict[str, ParamSpec]) -> None:
        self.strategy, self.grid, self.round, self.manifests, self.spec = strategy, grid, server_round, manifests, spec
        self.deadlines, f = strategy.deadlines, strategy.run.federation
        budget = min(int(f.server_buffer_mb * 2**20), max(fp32_bytes(spec) // MIN_CHUNKS, CHUNK_FLOOR_MB * 2**20))
        self.chunks = plan_ranges(spec, max(1, budget // len(manifests) if f.server_rule != "mean" else budget))
        self.requests = {node: [requests_for(layouts, chunk) for chunk in self.chunks]
                         for node, (_, _, layouts) in manifests.items()}
        self.scalar = {node: {p.key for p in layouts if not p.shape} for node, (_, _, layouts) in manifests.items()}
        self.stats = {"fold_s": 0.0, "pull_chunks": 0, "apply_chunks": len(self.chunks), "stream_restarts": 0}

    def run(self, rejected: dict[str, str], record: dict[str, Any]) -> tuple[list[int], dict[int, Message | None]]:
        """The facilities in the mean ([] if none) and each member's last apply reply (or its first failed one). A
        facility whose chunk is refused or missing is left out (`rejected`) and the pass starts over without it, so
        every row is the mean of the same facilities and no group adopts an abandoned pass."""
        f = self.strategy.run.federation
        need = min_contributors(f.server_rule, f.server_trim)
        participants, replies = list(self.manifests), {}
        while participants:
            if len(participants) < need:
                record["no_server_mean"] = (f"server-rule {f.server_rule} with server-trim {f.server_trim} needs "
                                            f"{need} facilities, {len(participants)} sent valid shards")
                participants = []
                break
            failed, replies = self._pass(participants)
            if not failed:
                break
            participants = [n for n in participants if n not in failed]
            then = f"; pulling the model again from the {len(participants)} other(s)" if participants else ""
            for node, reason in failed.items():
                reject(self.round, rejected, self.manifests[node][0], reason, then)
            if participants:
                self.stats["stream_restarts"] += 1
        record.update(self.stats)
        return participants, replies

    def _pass(self, participants: list[int]) -> tuple[dict[int, str], dict[int, Message | None]]:
        """One pass: the facilities that failed (ending it at that chunk), else each member's last apply reply."""
        self.participants, self.attempt = participants, self.stats["stream_restarts"]
        self.failed: dict[int, str] = {}
        self.pulls: dict[int, dict[str, int]] = {}
        """Chunk -> the pull messages queued for it (message id -> node)."""
        self.applies: dict[str, int] = {}
        self.last_ids: set[str] = set()
        self.errors: dict[int, Message] = {}
        self.final: dict[int, Message] = {}
        self.aggregator: StreamingShardAggregator | None = None
        for c in range(min(PULL_AHEAD + 1, len(self.chunks))):
            messages = [message(node, MSG_PULL, self._pull_config(node, c), f"pull{self.round}.{self.attempt}/{c}",
                                self.deadlines.round_timeout) for node in participants]
            self.pulls[c] = push(self.grid, messages)
        for c, chunk in enumerate(self.chunks):
            if not self._pull(c, chunk):
                return self.failed, {}
            self._send_mean(c, chunk)
        self._take_applies(await_replies(self.grid, self.applies, time.monotonic() + self.deadlines.round_timeout,
                                         self.strategy.polling))
        return {}, {node: self.errors.get(node, self.final.get(node)) for node in self.strategy.round_members}

    def _pull_config(self, node: int, c: int) -> dict[str, Any]:
        return {"server-round": self.round, "pieces": [f"{k}|{a}|{b}" for k, a, b in self.requests[node][c]],
                "timeout": max(1.0, self.deadlines.round_timeout - 5.0)}

    def _take_applies(self, replies: list[Message]) -> None:
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply_payload(reply)[1]:
                self.errors.setdefault(node, reply)
            elif reply.metadata.reply_to_message_id in self.last_ids:
                self.final[node] = reply

    def _pull(self, c: int, chunk: Chunk) -> bool:
        """Every facility's rows of chunk `c`, folded into `self.aggregator` as they arrive; False if one failed."""
        f = self.strategy.run.federation
        label = f"chunk {c + 1}/{len(self.chunks)}"
        aggregator = StreamingShardAggregator(round=self.round, spec=self.spec, complete=False,
                                              window={name: (a, b) for name, a, b in chunk}, combine=f.server_rule,
                                              trim=f.server_trim, slots=len(self.participants),
                                              outlier_ratio=f.server_outlier_ratio, log_rejections=False)
        self.aggregator = aggregator
        nodes_of: dict[str, int] = {}
        asked = {node: {shard_files.row_key(k, a): () if k in self.scalar[node] else (b - a,)
                        for k, a, b in self.requests[node][c]} for node in self.participants}
        pending = self.pulls.pop(c)
        for node in set(self.participants) - set(pending.values()):
            self.failed.setdefault(node, f"{label}: the SuperLink did not take the pull")

        def fold(reply: Message) -> Message:
            node = reply.metadata.src_node_id
            key = f"{self.manifests[node][0]} {label}"
            nodes_of[key] = node
            return self._fold(reply, label, aggregator, key, asked[node])

        await_replies(self.grid, pending, time.monotonic() + self.deadlines.round_timeout, self.strategy.polling,
                      on_reply=fold)
        for node in pending.values():
            self.failed.setdefault(node, f"{label}: no reply")
        if self.failed:
            return False
        try:
            aggregator.finalize()  # every participant sent every row of the chunk
        except ExcludedContributions as exc:  # out of bounds: the pass restarts without them
            self.failed.update({nodes_of[key]: f"{label}: {why}" for key, why in exc.reasons.items()})
            return False
        return True

    def _fold(self, reply: Message, label: str, aggregator: StreamingShardAggregator, key: str,
              asked: dict[str, tuple[int, ...]]) -> Message:
        """Fold one facility's pulled rows into the chunk's sums (or record why not), then drop them."""
        start = time.perf_counter()
        node = reply.metadata.src_node_id
        weight = self.manifests[node][1]
        content, error = reply.content, ""
        if reply.has_error() or shard_files.SHARDS not in content:
            error = reply_payload(reply)[1] or "the reply carries no shards"
        elif {k: tuple(v.shape[:1]) for k, v in content[shard_files.SHARDS].items()} != asked:
            error = "it holds other pieces or rows than those asked for"
        elif float(content[shard_files.SHARD_INFO].get("weight", -1.0)) != weight:
            error = f"its weight differs from the manifest's {weight}"
        else:
            try:
                if not add_content(aggregator, key, content):
                    error = aggregator.report.rejected[key]
            except Exception as exc:  # noqa: BLE001 - never crash the round; the pass restarts without it
                error = f"the aggregation failed on it: {type(exc).__name__}: {exc}"
        if error:
            self.failed[node] = f"{label}: {error}"
        else:
            self.stats["pull_chunks"] += 1
        for name in (shard_files.SHARDS, shard_files.SHARD_META):
            if name in content:
                del content[name]
        host_memory.trim()  # the chunk's buffers
        self.stats["fold_s"] += time.perf_counter() - start
        return reply

    def _send_mean(self, c: int, chunk: Chunk) -> None:
        """Send chunk `c` of the mean to every member, with the pulls of chunk c + `PULL_AHEAD` + 1."""
        s, d = self.strategy, self.deadlines
        aggregator, self.aggregator = self.aggregator, None
        pieces = [ShardPiece(name, a, self.spec[name].shape,
                             aggregator.result(name, a, b - a).to(self.spec[name].dtype)) for name, a, b in chunk]
        content = shard_files.shard_records(*encode_pieces(pieces), self.round, aggregator.report.total_weight)
        del pieces, aggregator
        last = c == len(self.chunks) - 1
        config = {"server-round": self.round, "chunk": c, "chunks": len(self.chunks), "attempt": self.attempt,
                  "evaluate": s.run.federation.evaluate_in_train and last,
                  "checkpoint": s.run.checkpoint_due(self.round) and last, "timeout": max(1.0, d.round_timeout - 5.0)}
        ahead = c + PULL_AHEAD + 1  # the chunk whose pulls go out now, with this chunk's applies
        pulling = set(self.participants) if ahead < len(self.chunks) else set()
        messages = []
        for node in s.round_members:  # a facility leader's apply and pull travel in one message
            applying = node not in self.errors
            if node in pulling:
                records = {**content, CONFIG: ConfigRecord({**config, **self._pull_config(node, ahead)})} \
                    if applying else {CONFIG: ConfigRecord(self._pull_config(node, ahead))}
                messages.append(Message(RecordDict(records), node, MSG_PULL, ttl=d.round_timeout,
                                        group_id=f"pull{self.round}.{self.attempt}/{ahead}"))
            elif applying:
                messages.append(Message(RecordDict({**content, CONFIG: ConfigRecord(config)}), node, MSG_APPLY,
                                        ttl=d.round_timeout, group_id=f"apply{self.round}.{self.attempt}/{c}"))
        del content
        pushed = push(self.grid, messages)
        if pulling:
            self.pulls[ahead] = {mid: node for mid, node in pushed.items() if node in pulling}
        for mid, node in pushed.items():
            if node not in pulling:
                self.applies[mid] = node
                if last:
                    self.last_ids.add(mid)
        del messages, pushed
        host_memory.trim()
        self._take_applies(await_replies(self.grid, self.applies, time.monotonic(), s.polling))  # those already there
