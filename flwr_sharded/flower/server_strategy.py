"""ServerShardFedAvg: shards travel through the Flower server, for groups in facilities that share no network.

A facility is a set of groups that share a fabric (named per SuperNode by the node config's `facility`, or per
partition id by the run config's `facilities`; by default every group is a facility of its own). One round:

1. train: inside each facility the groups run K periods of A local steps, each followed by a shard all-reduce among
   the facility's groups (the decentralised sync, stopping at the weighted mean); the facility's first group then
   exports its shards (each replica-0 rank writes its own pieces to a hand-off file) and its train reply carries
   a manifest of them (`flwr_sharded.flower.handoff`), weighted by the facility's tokens of the round;
2. pull: the server checks the manifests against the model, then pulls the pieces in chunks of rows, at most
   `server-buffer-mb` per step for all facilities together, and folds each chunk into one fp32 accumulator as it
   arrives (`StreamingShardAggregator`: a bad manifest or chunk is rejected with a log line, the rest kept);
3. apply: every group receives the weighted mean in chunks (cut like one facility's pieces, at most
   `server-buffer-mb` in flight); each of its ranks assembles its own rows, whatever its S, and steps the outer
   optimizer on them (its state is sharded like the parameters and lives with the ranks, so the server keeps no
   model state between rounds).

Memory at the server: one fp32 model plus the chunks in flight, whatever the number of facilities.
Without facilities (each group alone), this is the plain server path: the groups' syncs are over a group of one.
"""

from __future__ import annotations

import math
import time
from logging import ERROR, INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.supercore import log

from flwr_sharded.flower import handoff
from flwr_sharded.flower import protocol as P
from flwr_sharded.flower.strategy import DecentralizedFedAvg, _ppl, _reply_payload


class ServerShardFedAvg(DecentralizedFedAvg):
    """Federation through the Flower server: facility-local shard syncs, facility models averaged by the server.

    Takes the arguments of `DecentralizedFedAvg`; the run spec's `aggregation` must be "server".
    """

    _rss_base: int | None = None
    """The ServerApp's RSS before its first aggregation: the baseline of every round's `server_peak_mib`."""

    def facility_of(self, partition_id: int, hello_info: dict[str, Any]) -> str:
        """The node config's `facility`, else the run config's `facilities[partition_id]`, else the group alone."""
        return (str(hello_info.get("facility", "")) or self.spec.facility_of(partition_id)
                or f"partition-{partition_id}")

    def readmit(self, grid: Grid, server_round: int) -> list[int]:
        """Dropped groups do not rejoin on the server path: a group alone in its facility has no member to catch
        up from, and its stale model would enter the server's mean."""
        if self.rejoin and self.dropped:
            log(WARNING, "round %d: %d dropped group(s) stay out (rejoining is not supported on the server path)",
                server_round, len(self.dropped))
        return []

    def facilities(self) -> dict[str, list[int]]:
        """Facility -> its current member nodes, in member order."""
        out: dict[str, list[int]] = {}
        for node in self.members:
            out.setdefault(self.groups[node].facility, []).append(node)
        return out

    def summary(self) -> None:
        super().summary()
        log(INFO, "\t    Server path: facilities %s; the server averages facility models every round",
            {f: len(nodes) for f, nodes in self.facilities().items()} or "(after hello)")

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> list[Message]:
        """Per facility: its members sync among themselves; its first member exports its shards at the end."""
        d = self.deadlines
        messages = []
        for facility, nodes in self.facilities().items():
            leader = self.groups[nodes[0]].layout
            base = {**dict(config), "syncs": self.spec.syncs_per_round, "steps": self.spec.aggregate_every,
                    "members": [str(m) for m in nodes], "rendezvous-host": leader.rendezvous_host,
                    "rendezvous-ports": list(leader.rendezvous_ports),
                    "prefix": f"run{self.run_id}/round{server_round}/{facility}",
                    "rendezvous-timeout": d.rendezvous_timeout, "sync-timeout": d.sync_timeout, "evaluate": False,
                    "server-round": server_round, "checkpoint": False, "timeout": max(1.0, d.round_timeout - 5.0)}
            messages += [self._message(node, P.MSG_TRAIN, {**base, "member-index": i, "export": i == 0},
                                       str(server_round), d.round_timeout) for i, node in enumerate(nodes)]
        return messages

    def run_round(self, grid: Grid, server_round: int, result: Result, train_config: ConfigRecord | None,
                  evaluate_config: ConfigRecord | None) -> None:
        from flwr_sharded.flower.server_aggregation import StreamingShardAggregator
        from flwr_sharded.perf.memory import PeakRSS, current_rss

        t0 = time.monotonic()
        if self._rss_base is None:  # once, with torch imported: what the server path needs, rounds after rounds
            self._rss_base = current_rss()
        memory = PeakRSS(self._rss_base)
        messages = self.configure_train(server_round, ArrayRecord(), train_config or ConfigRecord(), grid)
        replies = self.send_and_receive(grid, messages, self.deadlines.round_timeout)
        manifests, rejected, spec = self._manifests(server_round, replies)
        self._round_wall = time.monotonic() - t0
        _, metrics = self.aggregate_train(server_round, replies)
        del replies
        record = self.history[-1]
        start = time.monotonic()
        accepted: list[int] = []
        aggregator = None
        if manifests:
            aggregator = StreamingShardAggregator(round=server_round, spec=spec, complete=False)
            accepted = self._pull(grid, server_round, manifests, aggregator, rejected, record)
            if accepted:
                try:
                    aggregator.finalize()
                except RuntimeError as exc:  # rows that no accepted facility sent
                    log(ERROR, "round %d: server path: %s", server_round, exc)
                    accepted = []
        for source, reason in rejected.items():
            log(WARNING, "round %d: server path: rejected the shards of %s: %s", server_round, source, reason)
        record.update(facilities=len(self.facilities()), facility_replies=len(accepted),
                      facility_rejected=len(rejected), train_checksums=record["checksums"],
                      facility_weights={str(n): manifests[n][1] for n in accepted})
        peaks = {"pull": memory.extra_bytes()}  # train, pull, fold and finalize
        if not accepted:
            log(ERROR, "round %d: no facility's shards reached the server; the groups keep their facility models "
                "and the next round tries again", server_round)
        else:
            memory = PeakRSS(self._rss_base)
            self._apply(grid, server_round, aggregator, manifests[accepted[0]][2], record)
            peaks["apply"] = memory.extra_bytes()
        aggregator = None
        record["server_sync_s"] = time.monotonic() - start
        if spec and None not in peaks.values():
            fp32_bytes = 4 * sum(math.prod(p.shape) for p in spec.values())
            for phase, extra in peaks.items():
                record[f"server_peak_{phase}_x"] = extra / fp32_bytes
            record.update(server_peak_mib=max(peaks.values()) / 2**20,
                          server_peak_x=max(peaks.values()) / fp32_bytes)
        self._round_wall = time.monotonic() - t0
        record.update(round_s=self._round_wall, overhead_s=max(0.0, self._round_wall - record["work_s"]))
        record["overhead_pct"] = 100.0 * record["overhead_s"] / self._round_wall if self._round_wall > 0 else 0.0
        record["tokens_per_s"] = record["tokens"] / self._round_wall if self._round_wall > 0 else 0.0
        if metrics is not None:
            result.train_metrics_clientapp[server_round] = metrics
        self.evaluate_round(grid, server_round, result, evaluate_config)
        self.publish_round()

    def _manifests(self, server_round: int, replies: list[Message]
                   ) -> tuple[dict[int, tuple[str, float, list[Any]]], dict[str, str], dict[str, Any] | None]:
        """The facility leaders' manifests that fit the model (node -> (source, weight, piece layouts)), the
        rejected ones (source -> reason), and the model's spec (global shapes and dtypes)."""
        from flwr_sharded.flower.server_aggregation import RejectedReply, check_layout
        from flwr_sharded.parallel.shard_transport import ShardPieceError, decode_layouts

        manifests: dict[int, tuple[str, float, list[Any]]] = {}
        rejected: dict[str, str] = {}
        spec = None
        for reply in replies:
            if reply.has_error() or handoff.SHARD_SHAPES not in reply.content:
                continue
            node = reply.metadata.src_node_id
            group = self.groups.get(node)
            source = f"facility {group.facility if group else '?'} (node {node})"
            try:
                shapes, meta, info = handoff.from_manifest_records(reply.content)
                weight = float(info.get("weight", float("nan")))
                if int(info.get("round", -1)) != server_round:
                    raise RejectedReply(f"round {info.get('round')} is not the current round {server_round}")
                if not (math.isfinite(weight) and weight > 0):
                    raise RejectedReply(f"weight must be a finite number > 0, got {weight!r}")
                layouts = decode_layouts(shapes, meta)
                spec = check_layout(spec, layouts, complete=True)
            except (RejectedReply, ShardPieceError, ValueError) as exc:
                rejected[source] = f"manifest: {exc}"
                continue
            manifests[node] = (source, weight, layouts)
        return manifests, rejected, spec

    def _pull(self, grid: Grid, server_round: int, manifests: dict[int, tuple[str, float, list[Any]]],
              aggregator: Any, rejected: dict[str, str], record: dict[str, Any]) -> list[int]:
        """Pull every manifest's pieces in chunks, from all sources at once and at most `server-buffer-mb` per
        step, folding each chunk into `aggregator` as it arrives. Returns the nodes whose every chunk was accepted.

        A source whose chunk is refused (or does not come) is pulled no further; the rows it sent before stay in
        the mean (each row is the weighted mean of the valid values sent for it). Groups check their shards for
        NaN/Inf before exporting, so a diverged group is refused whole, at its manifest.
        """
        from flwr_sharded.flower.server_aggregation import add_content, plan_chunks
        from flwr_sharded.perf.memory import release_free_memory

        d = self.deadlines
        budget = max(1, int(self.spec.server_buffer_mb * 2**20) // len(manifests))
        plans = {node: plan_chunks(layouts, budget) for node, (_, _, layouts) in manifests.items()}
        shapes = {node: {p.key: p.shape for p in layouts} for node, (_, _, layouts) in manifests.items()}
        asked = {node: [{handoff.row_key(k, a): (b - a,) if shapes[node][k] else () for k, a, b in chunk}
                        for chunk in chunks] for node, chunks in plans.items()}
        failed: dict[int, str] = {}
        stats = {"fold_s": 0.0, "pull_chunks": 0}

        def fold(reply: Message) -> Message:
            start = time.perf_counter()
            node = reply.metadata.src_node_id
            c = int(reply.metadata.group_id.rpartition("/")[2])
            source, weight, _ = manifests[node]
            label = f"chunk {c + 1}/{len(plans[node])}"
            error = ""
            if reply.has_error() or handoff.SHARDS not in reply.content:
                error = _reply_payload(reply)[1] or "the reply carries no shards"
            elif {k: tuple(v.shape[:1]) for k, v in reply.content[handoff.SHARDS].items()} != asked[node][c]:
                error = "it holds other pieces or rows than those asked for"
            elif float(reply.content[handoff.SHARD_INFO].get("weight", -1.0)) != weight:
                error = f"its weight differs from the manifest's {weight}"
            elif not add_content(aggregator, f"{source} {label}", reply.content):
                error = aggregator.report.rejected[f"{source} {label}"]
            if error:
                failed[node] = f"{label}: {error}"
            else:
                stats["pull_chunks"] += 1
            for name in (handoff.SHARDS, handoff.SHARD_META):
                if name in reply.content:
                    del reply.content[name]
            release_free_memory()  # the chunk's buffers, between the accumulator's pages
            stats["fold_s"] += time.perf_counter() - start
            return reply

        for c in range(max(len(chunks) for chunks in plans.values())):
            messages = [self._message(node, P.MSG_PULL, {
                "server-round": server_round, "pieces": [f"{k}|{a}|{b}" for k, a, b in chunks[c]],
                "last": c == len(chunks) - 1, "timeout": max(1.0, d.round_timeout - 5.0)},
                f"pull{server_round}/{c}", d.round_timeout)
                for node, chunks in plans.items() if node not in failed and c < len(chunks)]
            answered = {m.metadata.src_node_id for m in self.send_and_receive(grid, messages, d.round_timeout,
                                                                               on_reply=fold)}
            for message in messages:
                node = message.metadata.dst_node_id
                if node not in answered and node not in failed:
                    failed[node] = f"chunk {c + 1}/{len(plans[node])}: no reply"
        for node, reason in failed.items():
            rejected[manifests[node][0]] = reason
        record.update(stats)
        return [node for node in manifests if node not in failed]

    def _apply(self, grid: Grid, server_round: int, aggregator: Any, layouts: list[Any],
               record: dict[str, Any]) -> None:
        """Send the mean to every member in chunks (cut like one accepted manifest, at most `server-buffer-mb` in
        flight); each rank assembles its own rows, whatever its sharding. Members that fail are dropped."""
        from flwr_sharded.flower.server_aggregation import plan_chunks
        from flwr_sharded.parallel.shard_transport import ShardPiece, encode_pieces
        from flwr_sharded.perf.memory import release_free_memory

        d = self.deadlines
        budget = max(1, int(self.spec.server_buffer_mb * 2**20) // max(1, len(self.members)))
        by_key = {layout.key: layout for layout in layouts}
        chunks = plan_chunks(layouts, budget)
        replies: dict[int, Message | None] = {}
        for c, chunk in enumerate(chunks):
            pieces = []
            for key, a, b in chunk:
                layout = by_key[key]
                value = aggregator.result(layout.name, layout.row_offset + a, b - a)
                shape = (b - a, *layout.shape[1:]) if layout.shape else layout.shape
                pieces.append(ShardPiece(layout.name, layout.row_offset + a, layout.global_shape,
                                         value.reshape(shape).to(layout.dtype)))
            content = handoff.to_records(*encode_pieces(pieces), server_round, aggregator.report.total_weight)
            del pieces
            last = c == len(chunks) - 1
            messages = []
            for node in self.members:
                if node in replies:  # failed an earlier chunk
                    continue
                config = {"server-round": server_round, "chunk": c, "chunks": len(chunks),
                          "evaluate": self.evaluate_in_train and last,
                          "checkpoint": self.spec.checkpoint_due(server_round) and last,
                          "timeout": max(1.0, d.round_timeout - 5.0)}
                messages.append(Message(RecordDict({**content, P.CONFIG: ConfigRecord(config)}), node, P.MSG_APPLY,
                                        ttl=d.round_timeout, group_id=f"apply{server_round}/{c}"))
            del content
            got = {m.metadata.src_node_id: m for m in self.send_and_receive(grid, messages, d.round_timeout)}
            del messages
            release_free_memory()
            for node in [n for n in self.members if n not in replies]:
                if last or _reply_payload(got.get(node))[1]:
                    replies[node] = got.get(node)
        record["apply_chunks"] = len(chunks)
        checksums, evals, dropped = {}, {}, {}
        for node in list(self.members):
            metrics, error = _reply_payload(replies.get(node))
            if error:
                dropped[node] = error
                continue
            checksums[node] = [float(x) for x in metrics.get("checksums", [])]
            if "eval_loss" in metrics:
                evals[node] = float(metrics["eval_loss"])
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
            record["eval_ppl"] = _ppl(record["eval_loss"])
        if not record["checksums_equal"]:
            log(ERROR, "round %d: the groups' shard checksums differ after adopting the server's mean", server_round)


__all__ = ["ServerShardFedAvg"]
