"""One pass of the server path's stream (`ServerShardFedAvg`): every chunk pulled, folded, averaged and sent back.

Pipelined: each facility has the pulls of the next `PULL_AHEAD` chunks queued while the server averages one, and
the apply replies are collected as they come, so SuperNodes do not idle between chunks. A facility leader's apply
of chunk c travels in the pull message of chunk c + PULL_AHEAD + 1 (an apply failure then fails that pull), so each
chunk costs one message per group. In this process at once: one chunk's fp32 sums, one pulled chunk and the chunk
of the mean being sent.
"""

from __future__ import annotations

import time
from typing import Any

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from flwr_sharded import memory_release
from flwr_sharded.flower import shard_files
from flwr_sharded.flower import messages as M
from flwr_sharded.flower.server import grid as G
from flwr_sharded.flower.server.aggregation import (ExcludedContributions, StreamingShardAggregator, add_content,
                                                    requests_for)
from flwr_sharded.parallel.shard_transport import ShardPiece, encode_pieces

Chunk = list[tuple[str, int, int]]
"""Global rows of the model: (parameter, first row, end row) per piece."""


class StreamPass:
    """One pass over `chunks` with `participants` (facility leaders), for `strategy` (a ServerShardFedAvg)."""

    def __init__(self, strategy: Any, grid: Grid, server_round: int, attempt: int, chunks: list[Chunk],
                 participants: list[int], manifests: dict[int, tuple[str, float, list[Any]]], spec: dict[str, Any],
                 stats: dict[str, Any]) -> None:
        self.strategy, self.grid, self.round, self.attempt = strategy, grid, server_round, attempt
        self.chunks, self.participants, self.manifests, self.spec, self.stats = (chunks, participants, manifests,
                                                                                  spec, stats)
        self.deadlines = strategy.deadlines
        self.requests = {node: [requests_for(manifests[node][2], chunk) for chunk in chunks]
                         for node in participants}
        self.scalar = {node: {p.key for p in manifests[node][2] if not p.shape} for node in participants}
        self.failed: dict[int, str] = {}
        """Facility -> why it failed; the pass ends at the chunk where one does."""
        self.pulls: dict[int, dict[str, int]] = {}
        """Chunk -> the pull messages queued for it (message id -> node)."""
        self.applies: dict[str, int] = {}
        self.last_ids: set[str] = set()
        self.errors: dict[int, Message] = {}
        self.final: dict[int, Message] = {}
        self.aggregator: StreamingShardAggregator | None = None
        self.nodes_of: dict[str, int] = {}

    def run(self) -> tuple[dict[int, str], dict[int, Message | None]]:
        """The facilities that failed (which ends the pass at that chunk) and, for a pass that ended, each member's
        last apply reply (or its first failed one)."""
        for c in range(min(self.strategy.PULL_AHEAD + 1, len(self.chunks))):
            self._push_pulls(c)
        for c, chunk in enumerate(self.chunks):
            if not self._pull(c, chunk):
                return self.failed, {}
            self._send_mean(c, chunk)
        self._take_applies(self.strategy.await_replies(self.grid, self.applies,
                                                       time.monotonic() + self.deadlines.round_timeout))
        return {}, {node: self.errors.get(node, self.final.get(node)) for node in self.strategy.round_members}

    def _pull_config(self, node: int, c: int) -> dict[str, Any]:
        return {"server-round": self.round, "pieces": [f"{k}|{a}|{b}" for k, a, b in self.requests[node][c]],
                "timeout": max(1.0, self.deadlines.round_timeout - 5.0)}

    def _push_pulls(self, c: int) -> None:
        messages = [G.message(node, M.MSG_PULL, self._pull_config(node, c), f"pull{self.round}.{self.attempt}/{c}",
                              self.deadlines.round_timeout) for node in self.participants]
        self.pulls[c] = self.strategy.push(self.grid, messages)

    def _take_applies(self, replies: list[Message]) -> None:
        for reply in replies:
            node = reply.metadata.src_node_id
            if G.reply_payload(reply)[1]:
                self.errors.setdefault(node, reply)
            elif reply.metadata.reply_to_message_id in self.last_ids:
                self.final[node] = reply

    def _pull(self, c: int, chunk: Chunk) -> bool:
        """Collect every facility's rows of chunk `c` into `self.aggregator`; False if one failed (`self.failed`)."""
        f = self.strategy.run.federation
        label = f"chunk {c + 1}/{len(self.chunks)}"
        self.aggregator = StreamingShardAggregator(round=self.round, spec=self.spec, complete=False,
                                                   window={name: (a, b) for name, a, b in chunk},
                                                   combine=f.server_rule, trim=f.server_trim,
                                                   slots=len(self.participants),
                                                   outlier_ratio=f.server_outlier_ratio, log_rejections=False)
        self.nodes_of = {}
        asked = {node: {shard_files.row_key(k, a): () if k in self.scalar[node] else (b - a,)
                        for k, a, b in self.requests[node][c]} for node in self.participants}
        pending = self.pulls.pop(c)
        for node in set(self.participants) - set(pending.values()):
            self.failed.setdefault(node, f"{label}: the SuperLink did not take the pull")
        self.strategy.await_replies(self.grid, pending, time.monotonic() + self.deadlines.round_timeout,
                                    on_reply=lambda reply: self._fold(reply, label, asked[reply.metadata.src_node_id]))
        for node in pending.values():
            self.failed.setdefault(node, f"{label}: no reply")
        if self.failed:
            return False
        try:
            self.aggregator.finalize()  # every participant sent every row of the chunk
        except ExcludedContributions as exc:  # out of bounds: the pass restarts without them
            self.failed.update({self.nodes_of[key]: f"{label}: {why}" for key, why in exc.reasons.items()})
            return False
        return True

    def _fold(self, reply: Message, label: str, asked: dict[str, tuple[int, ...]]) -> Message:
        """Add one facility's pulled rows to the chunk's sums (or record why not), then drop them from the reply."""
        start = time.perf_counter()
        node = reply.metadata.src_node_id
        source, weight, _ = self.manifests[node]
        error = ""
        if reply.has_error() or shard_files.SHARDS not in reply.content:
            error = G.reply_payload(reply)[1] or "the reply carries no shards"
        elif {k: tuple(v.shape[:1]) for k, v in reply.content[shard_files.SHARDS].items()} != asked:
            error = "it holds other pieces or rows than those asked for"
        elif float(reply.content[shard_files.SHARD_INFO].get("weight", -1.0)) != weight:
            error = f"its weight differs from the manifest's {weight}"
        else:
            key = f"{source} {label}"
            self.nodes_of[key] = node
            try:
                if not add_content(self.aggregator, key, reply.content):
                    error = self.aggregator.report.rejected[key]
            except Exception as exc:  # noqa: BLE001 - never crash the round; the pass restarts without it
                error = f"the aggregation failed on it: {type(exc).__name__}: {exc}"
        if error:
            self.failed[node] = f"{label}: {error}"
        else:
            self.stats["pull_chunks"] += 1
        for name in (shard_files.SHARDS, shard_files.SHARD_META):
            if name in reply.content:
                del reply.content[name]
        memory_release.trim()  # the chunk's buffers
        self.stats["fold_s"] += time.perf_counter() - start
        return reply

    def _mean_records(self, chunk: Chunk) -> dict[str, Any]:
        """The chunk of the mean as records; the chunk's sums are dropped."""
        aggregator, self.aggregator = self.aggregator, None
        pieces = [ShardPiece(name, a, self.spec[name].shape,
                             aggregator.result(name, a, b - a).to(self.spec[name].dtype)) for name, a, b in chunk]
        return shard_files.to_records(*encode_pieces(pieces), self.round, aggregator.report.total_weight)

    def _send_mean(self, c: int, chunk: Chunk) -> None:
        """Send chunk `c` of the mean to every member, with the pulls of the chunk `PULL_AHEAD` + 1 further on."""
        s, d = self.strategy, self.deadlines
        content = self._mean_records(chunk)
        last = c == len(self.chunks) - 1
        config = {"server-round": self.round, "chunk": c, "chunks": len(self.chunks), "attempt": self.attempt,
                  "evaluate": s.evaluate_in_train and last, "checkpoint": s.run.checkpoint_due(self.round) and last,
                  "timeout": max(1.0, d.round_timeout - 5.0)}
        ahead = c + s.PULL_AHEAD + 1  # the chunk whose pulls go out now, with this chunk's applies
        pulling = set(self.participants) if ahead < len(self.chunks) else set()
        messages = []
        for node in s.round_members:  # a facility leader's apply and pull travel in one message
            applying = node not in self.errors
            if node in pulling:
                records = {**content, M.CONFIG: ConfigRecord({**config, **self._pull_config(node, ahead)})} \
                    if applying else {M.CONFIG: ConfigRecord(self._pull_config(node, ahead))}
                messages.append(Message(RecordDict(records), node, M.MSG_PULL, ttl=d.round_timeout,
                                        group_id=f"pull{self.round}.{self.attempt}/{ahead}"))
            elif applying:
                messages.append(Message(RecordDict({**content, M.CONFIG: ConfigRecord(config)}), node,
                                        M.MSG_APPLY, ttl=d.round_timeout,
                                        group_id=f"apply{self.round}.{self.attempt}/{c}"))
        del content
        pushed = s.push(self.grid, messages)
        if pulling:
            self.pulls[ahead] = {mid: node for mid, node in pushed.items() if node in pulling}
        for mid, node in pushed.items():
            if node not in pulling:
                self.applies[mid] = node
                if last:
                    self.last_ids.add(mid)
        del messages, pushed
        memory_release.trim()
        self._take_applies(s.await_replies(self.grid, self.applies, time.monotonic()))  # those already there
