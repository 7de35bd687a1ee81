"""ServerShardFedAvg: shards travel through the Flower server, for groups in facilities that share no network.

A facility is a set of groups that share a fabric (named per SuperNode by the node config's `facility`, or per
partition id by the run config's `facilities`; by default every group is a facility of its own). One round:

1. train: inside each facility the groups run K periods of A local steps, each followed by a shard all-reduce among
   the facility's groups (the decentralised sync, stopping at the weighted mean); the facility's first group then
   exports its shards: each of its replica-0 ranks writes its own pieces to a hand-off file, and its ClientApp
   sends them in the train reply (`flwr_sharded.flower.handoff`), weighted by the facility's tokens of the round;
2. aggregate: the server folds each facility's reply into one fp32 accumulator as it arrives
   (`StreamingShardAggregator`: validated reply by reply, a bad one rejected with a log line, the rest kept);
3. apply: every group receives the weighted mean of the facilities; each of its ranks reads only its own rows and
   steps the outer optimizer on them (its state is sharded like the parameters and lives with the ranks, so the
   server keeps no model state between rounds).

Without facilities (each group alone), this is the plain server path: the groups' syncs are over a group of one.
"""

from __future__ import annotations

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
        from flwr_sharded.flower.server_aggregation import StreamingShardAggregator, add_content

        t0 = time.monotonic()
        aggregator = StreamingShardAggregator(round=server_round)
        index: dict[str, tuple[tuple[int, ...], str]] = {}  # piece key -> (local shape, "dtype|global shape")
        facility_of = {n: g.facility for n, g in self.groups.items()}
        fold_s = 0.0

        def fold(reply: Message) -> Message:
            """Fold a facility's shards into the accumulator and drop them from the reply."""
            nonlocal fold_s
            if reply.has_error() or handoff.SHARDS not in reply.content:
                return reply
            start = time.perf_counter()
            node = reply.metadata.src_node_id
            source = f"facility {facility_of.get(node, '?')} (node {node})"
            if add_content(aggregator, source, reply.content) and not index:
                shards, meta = reply.content[handoff.SHARDS], reply.content[handoff.SHARD_META]
                index.update({k: (tuple(shards[k].shape), str(meta[k])) for k in shards.keys()})
            for name in (handoff.SHARDS, handoff.SHARD_META):
                del reply.content[name]
            fold_s += time.perf_counter() - start
            return reply

        messages = self.configure_train(server_round, ArrayRecord(), train_config or ConfigRecord(), grid)
        replies = self.send_and_receive(grid, messages, self.deadlines.round_timeout, on_reply=fold)
        train_wall = time.monotonic() - t0
        self._round_wall = train_wall
        _, metrics = self.aggregate_train(server_round, replies)
        record = self.history[-1]
        report = aggregator.report
        for source, reason in report.rejected.items():
            log(WARNING, "round %d: server path: rejected the shards of %s: %s", server_round, source, reason)
        record.update(facilities=len(self.facilities()), facility_replies=len(report.accepted),
                      facility_rejected=len(report.rejected), fold_s=fold_s)
        if not report.accepted:
            log(ERROR, "round %d: no facility's shards reached the server; the groups keep their facility models "
                "and the next round tries again", server_round)
        else:
            start = time.monotonic()
            aggregator.finalize()
            content = self._result_content(aggregator, index, server_round)
            del aggregator
            self._apply(grid, server_round, content, record)
            record["server_sync_s"] = time.monotonic() - start
        self._round_wall = time.monotonic() - t0
        record.update(round_s=self._round_wall, overhead_s=max(0.0, self._round_wall - record["work_s"]))
        record["overhead_pct"] = 100.0 * record["overhead_s"] / self._round_wall if self._round_wall > 0 else 0.0
        record["tokens_per_s"] = record["tokens"] / self._round_wall if self._round_wall > 0 else 0.0
        if metrics is not None:
            result.train_metrics_clientapp[server_round] = metrics
        self.evaluate_round(grid, server_round, result, evaluate_config)
        self.publish_round()

    def _result_content(self, aggregator: Any, index: dict[str, tuple[tuple[int, ...], str]],
                        server_round: int) -> RecordDict:
        """The new global pieces (the keys and dtypes the groups sent) as one message content for every group."""
        from flwr_sharded.parallel.shard_transport import ShardPiece, dtype_of_tag, encode_pieces, split_key

        pieces = []
        for key, (shape, tag) in index.items():
            name, offset = split_key(key)
            rows = shape[0] if shape else 1
            value = aggregator.result(name, offset, rows).reshape(shape).to(dtype_of_tag(tag))
            pieces.append(ShardPiece(name, offset, aggregator.spec[name].shape, value))
        arrays, meta = encode_pieces(pieces)
        return RecordDict(handoff.to_records(arrays, meta, server_round, aggregator.report.total_weight))

    def _apply(self, grid: Grid, server_round: int, content: RecordDict, record: dict[str, Any]) -> None:
        """Send the mean to every member; those that fail to adopt it are dropped. Checksums must then agree."""
        d = self.deadlines
        messages = []
        for node in self.members:
            body = RecordDict({**content, P.CONFIG: ConfigRecord({
                "server-round": server_round, "evaluate": self.evaluate_in_train,
                "checkpoint": self.spec.checkpoint_due(server_round), "timeout": max(1.0, d.round_timeout - 5.0)})})
            messages.append(Message(body, node, P.MSG_APPLY, ttl=d.round_timeout, group_id=f"apply{server_round}"))
        replies = {m.metadata.src_node_id: m for m in self.send_and_receive(grid, messages, d.round_timeout)}
        checksums, evals, dropped = {}, [], {}
        for node in list(self.members):
            metrics, error = _reply_payload(replies.get(node))
            if error:
                dropped[node] = error
                continue
            checksums[node] = [float(x) for x in metrics.get("checksums", [])]
            if "eval_loss" in metrics:
                evals.append(float(metrics["eval_loss"]))
        for node, reason in dropped.items():
            self.left_out[node] = f"dropped in round {server_round} (apply): {reason}"
            log(WARNING, "round %d: group on node %d could not adopt the server's shards, dropped: %s",
                server_round, node, reason)
        self.members = [n for n in self.members if n not in dropped]
        vectors = list(checksums.values())
        record["checksums_equal"] = int(all(v == vectors[0] for v in vectors[1:]))
        record["checksums"] = {str(n): v for n, v in checksums.items()}
        record["dropped"] += len(dropped)
        record["synced"] = int(record["synced"] and not dropped)
        if evals:
            record["eval_loss"] = sum(evals) / len(evals)
            record["eval_ppl"] = _ppl(record["eval_loss"])
        if not record["checksums_equal"]:
            log(ERROR, "round %d: the groups' shard checksums differ after adopting the server's mean", server_round)


__all__ = ["ServerShardFedAvg"]
