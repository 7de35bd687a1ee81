"""ServerShardFedAvg: shards travel through the Flower server, for groups in facilities that share no network.

A facility is a set of groups that share a fabric (named per SuperNode by the node config's `facility`, or per
partition id by the run config's `facilities`; by default every group is a facility of its own). One round:

1. train: inside each facility the groups run K periods of A local steps, each followed by a shard all-reduce among
   the facility's groups (the decentralised sync, stopping at the weighted mean); the facility's first group then
   exports its shards (each replica-0 rank writes its own pieces to a hand-off file) and its train reply carries
   a manifest of them (`flwr_sharded.flower.shard_files`), weighted by the facility's tokens of the round;
2. stream: the server checks the manifests against the model, cuts the model into chunks of global rows (at most
   `server-buffer-mb` in fp32, and a sixteenth of the model or 8 MiB, whichever is larger) and, chunk by chunk, pulls
   each facility's rows of it, folds them into the chunk's fp32 sums as they arrive (`StreamingShardAggregator` over
   that window: a bad chunk is rejected with a log line), and sends the chunk of the weighted mean to every group. A
   facility whose manifest or chunk is refused is left out; if that happens mid-stream, the stream starts over
   without it, so every row is the mean of the same facilities. Pulls run one chunk ahead, so SuperNodes do not idle
   between chunks. Refused: a weight other than the facility's tokens of the round (`expected_weight`), NaN/Inf,
   values out of bounds or that would overflow the sums (`robust.out_of_bounds`); one log line each. The
   `server-rule` median or trimmed-mean replaces the weighted mean with a coordinate-wise rule per chunk;
3. apply: when a group has all chunks, each of its ranks assembles its own rows, whatever its S, and steps the
   outer optimizer on them (its state is sharded like the parameters and lives with the ranks, so the server keeps
   no model state between rounds).

Memory at the server: one chunk's sums, one pulled chunk and one chunk of the mean, whatever the model size and
the number of facilities; nothing of the model stays between chunks.
Without facilities (each group alone), this is the plain server path: the groups' syncs are over a group of one.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from logging import ERROR, INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.supercore import log

from flwr_sharded.flower import shard_files
from flwr_sharded.flower import messages as M
from flwr_sharded.flower.run_config import RoundOptions
from flwr_sharded.flower.server import grid as G
from flwr_sharded.flower.server.records import note_checkpoint_errors
from flwr_sharded.flower.server.membership import GroupInfo
from flwr_sharded.flower.server.strategy import DecentralizedFedAvg
from flwr_sharded.run_dir import perplexity


class ServerShardFedAvg(DecentralizedFedAvg):
    """Federation through the Flower server: facility-local shard syncs, facility models averaged by the server.

    Takes the arguments of `DecentralizedFedAvg`; the run's `aggregation` must be "server".
    """

    MIN_CHUNKS = 16
    """The model travels in at least this many chunks (but see `CHUNK_FLOOR_MB`), so the server holds a fraction
    of it."""
    CHUNK_FLOOR_MB = 8
    """Chunks are not cut smaller than this unless `server-buffer-mb` asks: below it, every extra message costs more
    time than the chunk's memory is worth."""
    PULL_AHEAD = 1
    """Chunks each facility has pull requests queued for beyond the one the server is averaging."""

    def facility_of(self, partition_id: int, hello_info: dict[str, Any]) -> str:
        """The node config's `facility`, else the run config's `facilities[partition_id]`, else the group alone."""
        return str(hello_info.get("facility", "")) or self.run.facility_or_own(partition_id)

    def readmit(self, grid: Grid, server_round: int) -> list[int]:
        """A dropped group rejoins if its facility still has a member: the facility's round starts with a catch-up
        from that member (shards, outer state, step). A group whose facility has no member left stays out: nothing
        it could reach holds the model (its stale model would enter the server's mean)."""
        live = {self.groups[n].facility for n in self.members}
        alone = {n for n in self.dropped if self.groups[n].facility not in live}
        if self.rejoin and alone:
            log(WARNING, "round %d: dropped group(s) on node(s) %s stay out: no member of their facility is left to "
                "catch up from", server_round, sorted(alone))
        self.dropped -= alone
        try:
            return super().readmit(grid, server_round)
        finally:
            self.dropped |= alone

    def catch_up_source(self, group: GroupInfo) -> int | None:
        """The first member of the rejoining group's facility (the facility's catch-up source), if any."""
        return next((n for n in self.members if self.groups[n].facility == group.facility), None)

    def facilities(self) -> dict[str, list[int]]:
        """Facility -> this round's member nodes, in member order."""
        out: dict[str, list[int]] = {}
        for node in self.round_members or self.members:
            out.setdefault(self.groups[node].facility, []).append(node)
        return out

    def summary(self) -> None:
        super().summary()
        log(INFO, "\t    Server path: facilities %s; the server averages facility models every round",
            {f: len(nodes) for f, nodes in self.facilities().items()} or "(after hello)")

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> list[Message]:
        """Per facility: its members sync among themselves; its first member exports its shards at the end."""
        round_options = RoundOptions.from_config(dict(config))
        messages = []
        for facility, nodes in self.facilities().items():
            messages += self.train_messages(server_round, nodes, self.groups[nodes[0]].layout,
                                            f"run{self.run_id}/round{server_round}/{facility}", round_options,
                                            catch_up=any(n in self._rejoined for n in nodes), evaluate=False,
                                            checkpoint=False, export_first=True)
        return messages

    def run_round(self, grid: Grid, server_round: int, result: Result, train_config: ConfigRecord | None) -> None:
        t0 = time.monotonic()
        messages = self.configure_train(server_round, ArrayRecord(), ConfigRecord(dict(train_config or {})), grid)
        replies = self.train_and_collect(grid, messages)
        round_options = RoundOptions.from_config(dict(train_config or {}))
        manifests, rejected, spec = self._manifests(server_round, replies, round_options)
        self._round_wall = time.monotonic() - t0
        _, metrics = self.aggregate_train(server_round, replies)
        del replies
        record = self.history[-1]
        start = time.monotonic()
        accepted: list[int] = []
        if manifests:
            accepted = self._stream(grid, server_round, manifests, spec, rejected, record)
        record.update(facilities=len(self.facilities()), facility_replies=len(accepted),
                      facility_rejected=len(rejected), facility_rejections=dict(rejected),
                      train_checksums=record["checksums"], facility_weights={str(n): manifests[n][1] for n in accepted})
        if not accepted:
            log(ERROR, "round %d: %s; the groups keep their facility models and the next round tries again",
                server_round, record.pop("no_server_mean", "no facility's shards reached the server"))
        record["server_sync_s"] = time.monotonic() - start
        self._round_wall = time.monotonic() - t0
        record.update(round_s=self._round_wall, overhead_s=max(0.0, self._round_wall - record["work_s"]))
        record["overhead_pct"] = 100.0 * record["overhead_s"] / self._round_wall if self._round_wall > 0 else 0.0
        record["tokens_per_s"] = record["tokens"] / self._round_wall if self._round_wall > 0 else 0.0
        if metrics is not None:
            result.train_metrics_clientapp[server_round] = metrics
        self.evaluate_round(grid, server_round, result)
        self.publish_round()

    def expected_weight(self, node: int, round_options: RoundOptions) -> float:
        """The tokens the facility led by `node` trained on in this round: K syncs of A steps, by each member of
        the facility with its R x S ranks (checked at hello), of `batch-size` x `grad-accum` blocks of `seq-len`."""
        from flwr_sharded.parallel.contribution import expected_weight_of

        resolved = round_options.for_run(self.run)
        members = self.facilities().get(self.groups[node].facility, [node])
        return expected_weight_of(self.run.train, steps=resolved.syncs_per_round * resolved.aggregate_every,
                                  worlds=[self.groups[n].layout.replicas * self.groups[n].layout.shards
                                          for n in members])

    def _reject(self, server_round: int, rejected: dict[str, str], source: str, reason: str, then: str = "") -> None:
        """Leave a facility's shards out of the round: the one log line, and its reason for the round's record."""
        rejected[source] = reason
        log(WARNING, "round %d: server path: rejected the shards of %s: %s%s", server_round, source, reason, then)

    def _manifests(self, server_round: int, replies: list[Message], round_options: RoundOptions
                   ) -> tuple[dict[int, tuple[str, float, list[Any]]], dict[str, str], dict[str, Any] | None]:
        """The facility leaders' manifests that fit the model (node -> (source, weight, piece layouts)), the
        rejected ones (source -> reason), and the model's spec (global shapes and dtypes).

        The weight must be the facility's tokens of the round (`expected_weight`). The model is the one most
        manifests describe (the first of equals on a tie), so one bad manifest cannot make the others look wrong;
        each manifest must cover it exactly once."""
        from flwr_sharded.flower.server.aggregation import RejectedReply, check_layout
        from flwr_sharded.parallel.contribution import weight_verdict
        from flwr_sharded.parallel.shard_transport import ShardPieceError, decode_layouts

        manifests: dict[int, tuple[str, float, list[Any]]] = {}
        rejected: dict[str, str] = {}
        specs: dict[int, dict[str, Any]] = {}
        for reply in replies:
            if reply.has_error() or shard_files.SHARD_SHAPES not in reply.content:
                continue
            node = reply.metadata.src_node_id
            group = self.groups.get(node)
            source = f"facility {group.facility if group else '?'} (node {node})"
            try:
                shapes, meta, info = shard_files.from_manifest_records(reply.content)
                weight = float(info.get("weight", float("nan")))
                if int(info.get("round", -1)) != server_round:
                    raise RejectedReply(f"round {info.get('round')} is not the current round {server_round}")
                if group is None or node not in self.round_members:
                    raise RejectedReply("the node is not a member of this round")
                bound = self.expected_weight(node, round_options) if math.isfinite(weight) else None
                verdict = weight_verdict(source, weight, bound)
                if verdict is not None:
                    raise RejectedReply(verdict.reason)
                layouts = decode_layouts(shapes, meta)
                specs[node] = check_layout(None, layouts, complete=False)
            except (RejectedReply, ShardPieceError, ValueError) as exc:
                self._reject(server_round, rejected, source, f"manifest: {exc}")
                continue
            manifests[node] = (source, weight, layouts)
        if not specs:
            return manifests, rejected, None
        common, _ = Counter(frozenset(s.items()) for s in specs.values()).most_common(1)[0]
        spec = next(s for s in specs.values() if frozenset(s.items()) == common)
        for node, (source, _, layouts) in list(manifests.items()):
            try:
                check_layout(spec, layouts, complete=True)
            except RejectedReply as exc:
                self._reject(server_round, rejected, source, f"manifest: {exc} (the model most facilities announced)")
                del manifests[node]
        return manifests, rejected, spec

    def _stream(self, grid: Grid, server_round: int, manifests: dict[int, tuple[str, float, list[Any]]],
                spec: dict[str, Any], rejected: dict[str, str], record: dict[str, Any]) -> list[int]:
        """Pull, average and send back the model one chunk of global rows at a time; returns the facilities whose
        shards are in the mean ([] if none).

        A facility whose chunk is refused or does not come is left out, with its reason in `rejected`, and the
        pass starts over without it: every row is then the mean of the same facilities, and no group adopts
        anything before the last chunk of a pass has reached it. A robust `server-rule` combines each chunk from
        every facility's rows at once, so its chunks are cut F times smaller (the same memory in all).
        """
        from flwr_sharded.flower.server.aggregation import fp32_bytes, plan_ranges
        from flwr_sharded.flower.server.robust import min_contributors

        f = self.run.federation
        chunk_bytes = min(int(f.server_buffer_mb * 2**20),
                          max(fp32_bytes(spec) // self.MIN_CHUNKS, self.CHUNK_FLOOR_MB * 2**20))
        if f.server_rule != "mean":
            chunk_bytes //= len(manifests)
        chunks = plan_ranges(spec, max(1, chunk_bytes))
        participants = list(manifests)
        need = min_contributors(f.server_rule, f.server_trim)
        stats = {"fold_s": 0.0, "pull_chunks": 0, "apply_chunks": len(chunks), "stream_restarts": 0}
        while participants:
            if len(participants) < need:
                record["no_server_mean"] = (f"server-rule {f.server_rule} with server-trim {f.server_trim} needs "
                                            f"{need} facilities, {len(participants)} sent valid shards")
                participants = []
                break
            failed, replies = self._stream_pass(grid, server_round, stats["stream_restarts"], chunks, participants,
                                                manifests, spec, stats)
            if not failed:
                self._adopted(server_round, replies, record)
                break
            participants = [n for n in participants if n not in failed]
            then = f"; pulling the model again from the {len(participants)} other(s)" if participants else ""
            for node, reason in failed.items():
                self._reject(server_round, rejected, manifests[node][0], reason, then)
            if participants:
                stats["stream_restarts"] += 1
        record.update(stats)
        return participants

    def _stream_pass(self, grid: Grid, server_round: int, attempt: int, chunks: list[list[tuple[str, int, int]]],
                     participants: list[int], manifests: dict[int, tuple[str, float, list[Any]]],
                     spec: dict[str, Any], stats: dict[str, Any]
                     ) -> tuple[dict[int, str], dict[int, Message | None]]:
        """One pass over the chunks with these facilities (`flwr_sharded.flower.server.stream_pass`). Returns the
        facilities that failed (which ends the pass at that chunk) and, for a pass that ended, each member's last
        apply reply (or its first failed one)."""
        from flwr_sharded.flower.server.stream_pass import StreamPass

        return StreamPass(self, grid, server_round, attempt, chunks, participants, manifests, spec, stats).run()

    def _adopted(self, server_round: int, replies: dict[int, Message | None], record: dict[str, Any]) -> None:
        """Record what the members reported after adopting the mean; drop those that could not."""
        checksums, evals, dropped, adopted = {}, {}, {}, {}
        for node in list(self.round_members):
            metrics, error = G.reply_payload(replies.get(node))
            if error:
                dropped[node] = error
                continue
            adopted[node] = metrics
            checksums[node] = [float(x) for x in metrics.get("checksums", [])]
            if "eval_loss" in metrics:
                evals[node] = float(metrics["eval_loss"])
        note_checkpoint_errors(server_round, adopted, record)
        for node, reason in dropped.items():
            self.left_out[node] = f"dropped in round {server_round} (apply): {reason}"
            log(WARNING, "round %d: group on node %d could not adopt the server's shards, dropped: %s",
                server_round, node, reason)
        self.members = [n for n in self.members if n not in dropped]
        by_layout: dict[str, list[list[float]]] = {}  # groups sharded alike hold the same rows
        for node, vector in checksums.items():
            by_layout.setdefault(self.groups[node].fingerprint, []).append(vector)
        record["checksums_equal"] = int(all(v == same[0] for same in by_layout.values() for v in same[1:]))
        record["checksums"] = {str(n): v for n, v in checksums.items()}
        record["dropped"] += len(dropped)
        record["synced"] = int(record["synced"] and not dropped)
        if evals:
            record["eval_losses"] = {str(n): loss for n, loss in evals.items()}
            record["eval_loss"] = sum(evals.values()) / len(evals)
            record["eval_ppl"] = perplexity(record["eval_loss"])
        if not record["checksums_equal"]:
            log(ERROR, "round %d: the groups' shard checksums differ after adopting the server's mean", server_round)


__all__ = ["ServerShardFedAvg"]
