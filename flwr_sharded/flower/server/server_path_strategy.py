"""ServerShardFedAvg: shards travel through the Flower server, for groups in facilities that share no network.

A facility is a set of groups that share a fabric (the node config's `facility`, else the run config's `facilities`
by partition id, else every group alone). In a round the groups of each facility train and sync among themselves
(stopping at the weighted mean); the facility's first group exports its shards to hand-off files and its train
reply carries their manifest (`flwr_sharded.flower.shard_files`), weighted by the facility's tokens of the round. The
server checks the manifests, streams the facilities' models through it a chunk at a time (`stream`), and every group
adopts the mean: each rank assembles its own rows and steps the outer rule on them, so the server keeps no model
state between rounds and never holds more than a few chunks.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from logging import ERROR, INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid
from flwr.supercore import log

from flwr_sharded.flower import shard_files
from flwr_sharded.flower.run_config import RoundOptions
from flwr_sharded.flower.server import records
from flwr_sharded.flower.server.aggregation import ParamSpec, RejectedReply, check_piece_layout
from flwr_sharded.flower.server.grid import reply_payload, run_id
from flwr_sharded.flower.server.membership import GroupInfo, GroupMembership
from flwr_sharded.flower.server.stream import Stream, reject
from flwr_sharded.flower.server.strategy import DecentralizedFedAvg
from flwr_sharded.parallel.token_weights import expected_weight_of, weight_verdict
from flwr_sharded.parallel.shard_transport import PieceLayout, ShardPieceError, decode_layouts
from flwr_sharded.run_dir import perplexity


class FacilityMembership(GroupMembership):
    """The groups of the server path, each in its facility; a dropped group rejoins from its facility."""

    def facility_of(self, partition_id: int, hello_info: dict[str, Any]) -> str:
        """The node config's `facility`, else the run config's `facilities[partition_id]`, else the group alone."""
        return str(hello_info.get("facility", "")) or self.run.facility_or_own(partition_id)

    def readmit(self, grid: Grid, server_round: int) -> list[int]:
        """A dropped group rejoins if its facility still has a member, catching up from it. A group whose facility
        has no member left stays out: nothing it could reach holds the model (its stale model would enter the mean)."""
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
        """The first member of the rejoining group's facility, if any."""
        return next((n for n in self.members if self.groups[n].facility == group.facility), None)


Manifests = dict[int, tuple[str, float, list[PieceLayout]]]
"""Facility leader node -> (its source label, its weight, its pieces' layouts)."""


class ServerShardFedAvg(DecentralizedFedAvg):
    """Federation through the Flower server: facility-local shard syncs, facility models averaged by the server.

    Takes the arguments of `DecentralizedFedAvg`; the run's `aggregation` must be "server".
    """

    membership_class = FacilityMembership

    def facilities(self) -> dict[str, list[int]]:
        """Facility -> this round's member nodes, in member order."""
        out: dict[str, list[int]] = {}
        for node in self.round_members or self.membership.members:
            out.setdefault(self.membership.groups[node].facility, []).append(node)
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
            messages += self.train_messages(server_round, nodes, self.membership.groups[nodes[0]].layout,
                                            f"run{run_id(grid)}/round{server_round}/{facility}", round_options,
                                            catch_up=any(n in self._rejoined for n in nodes), evaluate=False,
                                            checkpoint=False, export_first=True)
        return messages

    def after_train(self, grid: Grid, server_round: int, replies: list[Message], round_options: RoundOptions) -> None:
        """Check the facility leaders' manifests, stream their models through the server, record the adoption."""
        manifests, rejected, spec = self._manifests(server_round, replies, round_options)
        record = self.history[-1]
        start = time.monotonic()
        accepted: list[int] = []
        if manifests:
            accepted, adopted = Stream(self, grid, server_round, manifests, spec).run(rejected, record)
            if accepted:
                self._adopted(server_round, adopted, record)
        record.update(facilities=len(self.facilities()), facility_replies=len(accepted),
                      facility_rejected=len(rejected), facility_rejections=dict(rejected),
                      train_checksums=record["checksums"], facility_weights={str(n): manifests[n][1] for n in accepted})
        if not accepted:
            log(ERROR, "round %d: %s; the groups keep their facility models and the next round tries again",
                server_round, record.pop("no_server_mean", "no facility's shards reached the server"))
        record["server_sync_s"] = time.monotonic() - start
        record.update(records.timings(record["tokens"], record["work_s"], time.monotonic() - self._round_started))

    def expected_weight(self, node: int, round_options: RoundOptions) -> float:
        """The tokens the facility led by `node` trained on in this round: K syncs of A steps, by each member of
        the facility with its R x S ranks (checked at hello), of `batch-size` x `grad-accum` blocks of `seq-len`."""
        resolved = round_options.for_run(self.run)
        groups = self.membership.groups
        members = self.facilities().get(groups[node].facility, [node])
        return expected_weight_of(self.run.train, steps=resolved.syncs_per_round * resolved.aggregate_every,
                                  worlds=[groups[n].layout.replicas * groups[n].layout.shards for n in members])

    def _manifests(self, server_round: int, replies: list[Message], round_options: RoundOptions
                   ) -> tuple[Manifests, dict[str, str], dict[str, ParamSpec] | None]:
        """The facility leaders' manifests that fit the model, the rejected ones (source -> reason) and the model's
        spec. A weight must be the facility's tokens of the round (`expected_weight`); the model is the one most
        manifests describe (the first of equals), so one bad manifest cannot make the others look wrong."""
        manifests: Manifests = {}
        rejected: dict[str, str] = {}
        specs: dict[int, dict[str, ParamSpec]] = {}
        for reply in replies:
            if reply.has_error() or shard_files.SHARD_SHAPES not in reply.content:
                continue
            node = reply.metadata.src_node_id
            group = self.membership.groups.get(node)
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
                specs[node] = check_piece_layout(None, layouts, complete=False)
            except (RejectedReply, ShardPieceError, ValueError) as exc:
                reject(server_round, rejected, source, f"manifest: {exc}")
                continue
            manifests[node] = (source, weight, layouts)
        if not specs:
            return manifests, rejected, None
        common, _ = Counter(frozenset(s.items()) for s in specs.values()).most_common(1)[0]
        spec = next(s for s in specs.values() if frozenset(s.items()) == common)
        for node, (source, _, layouts) in list(manifests.items()):
            try:
                check_piece_layout(spec, layouts, complete=True)
            except RejectedReply as exc:
                reject(server_round, rejected, source, f"manifest: {exc} (the model most facilities announced)")
                del manifests[node]
        return manifests, rejected, spec

    def _adopted(self, server_round: int, replies: dict[int, Message | None], record: dict[str, Any]) -> None:
        """Record what the members reported after adopting the mean; drop those that could not."""
        checksums, evals, dropped, adopted = {}, {}, {}, {}
        for node in self.round_members:
            metrics, error = reply_payload(replies.get(node))
            if error:
                dropped[node] = f"could not adopt the server's shards: {error}"
                continue
            adopted[node] = metrics
            checksums[node] = [float(x) for x in metrics.get("checksums", [])]
            if "eval_loss" in metrics:
                evals[node] = float(metrics["eval_loss"])
        records.note_checkpoint_errors(server_round, adopted, record)
        self.membership.drop(server_round, dropped, rejoin=False)
        by_layout: dict[str, list[list[float]]] = {}  # groups sharded alike hold the same rows
        for node, vector in checksums.items():
            by_layout.setdefault(self.membership.groups[node].fingerprint, []).append(vector)
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


__all__ = ["FacilityMembership", "ServerShardFedAvg"]
