"""DecentralizedFedAvg: Flower orchestrates rounds, the groups average their shards among themselves.

No arrays cross the server: every message carries a ConfigRecord only. Per run:

1. sample nodes with a deadline (Flower's `FedAvg.sample_nodes` waits forever);
2. hello: each group builds (or reuses) its trainer and replies with its layout, model/sharding fingerprint and a
   rendezvous offer; groups that fail it (unreachable, other R*S or method, other fingerprint) are left out, with
   the reason in the ServerApp log;
3. rounds: the members (ordered by partition id) get a train message naming all members, member 0's rendezvous
   offer (one store port per shard index) and a round prefix; each group runs K periods of A local steps and a
   shard sync after each. Metrics are aggregated weighted by tokens. A group that replies with an error, or not
   at all before the round deadline, or whose node goes offline, is dropped; the survivors of a failed sync have
   rolled back to their last synced shards, and the next round re-forms the membership from them;
4. finish: every sampled node gets a finish message (simulation: its launched group is shut down).

Every wait is bounded (sample, hello, round and finish deadlines); the message TTL equals the wait, so a reply
that comes later is dropped by Flower rather than mistaken for a later round's.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.supercore import log

from flwr_sharded.errors import ConfigError
from flwr_sharded.flower import protocol as P


@dataclass
class Deadlines:
    """How long the strategy waits for each step, and how many groups it needs (all bounded)."""

    num_groups: int = 2
    """Groups to wait for before starting (0: whatever is connected when sample_timeout expires)."""
    min_groups: int = 1
    """Fewest groups the run goes on with; below it the run stops with an error."""
    sample_timeout: float = 120.0
    """Seconds to wait for num_groups nodes to connect."""
    hello_timeout: float = 300.0
    """Seconds for the hello round (in simulation it includes launching the groups and building the models)."""
    round_timeout: float = 900.0
    """Seconds one training round may take, all K syncs included."""
    rendezvous_timeout: float = 60.0
    """Seconds a group waits at a sync's rendezvous for the other members (covers their speed differences)."""
    sync_timeout: float = 120.0
    """Timeout of each cross-group collective."""
    finish_timeout: float = 60.0
    """Seconds for the finish messages at the end."""
    poll_interval: float = 0.1
    """Seconds between two pulls of replies."""
    node_check_interval: float = 2.0
    """Seconds between two checks that the awaited nodes are still online."""


@dataclass
class GroupInfo:
    """What the strategy knows of one group (one Flower node)."""

    node_id: int
    partition_id: int
    layout: P.GroupLayout
    fingerprint: str
    tokens: int = 0
    resumed_round: int = 0
    """The round this group's checkpoint holds (resume)."""
    facility: str = ""
    """The facility (set of groups sharing a fabric) of the server path; '' on the decentralised path."""
    failures: list[str] = field(default_factory=list)


class DecentralizedFedAvg(Strategy):
    """Decentralised FedAvg of sharded models: config-only messages, shard syncs between the groups.

    Args:
        spec: the run's training settings (validated before anything is sent).
        deadlines: waits and group counts.
        evaluate_in_train: evaluate at the end of each train message (saves a message round trip per round);
            False sends separate evaluate messages.
        metrics_path: append one JSON object per round (and a summary) to this file.
        save_dir: at the end, member 0 writes its merged model here.
        stop_groups: at the end, also shut down groups that were not launched by the ClientApp (deployment).
        group_idle_timeout: idle timeout given to groups the ClientApp launches (simulation).
        rejoin: at the start of each round, offer groups dropped earlier to rejoin (with a catch-up).
    """

    def __init__(self, spec: P.RunSpec, deadlines: Deadlines | None = None, *, evaluate_in_train: bool = True,
                 metrics_path: str = "", save_dir: str = "", stop_groups: bool = False,
                 group_idle_timeout: float = 600.0, rejoin: bool = True) -> None:
        self.spec = spec
        self.deadlines = deadlines or Deadlines()
        self.evaluate_in_train = evaluate_in_train
        self.metrics_path = metrics_path
        self.save_dir = save_dir
        self.stop_groups = stop_groups
        self.group_idle_timeout = group_idle_timeout
        self.run_id = 0
        self.sampled: list[int] = []
        self.groups: dict[int, GroupInfo] = {}
        self.members: list[int] = []
        self.left_out: dict[int, str] = {}
        self.history: list[dict[str, Any]] = []
        self.resumed_round = 0
        """The round the groups' checkpoints hold (resume); training goes on with the next one."""
        self.rejoin = rejoin
        self.dropped: set[int] = set()
        """Nodes whose group was dropped during the run (candidates to rejoin)."""
        self._catch_up = False
        self._rejoined: list[int] = []
        self._round_wall = 0.0

    # ----- Strategy interface ---------------------------------------------------------------------------------
    def summary(self) -> None:
        s, d = self.spec, self.deadlines
        log(INFO, "\t├── Groups: %s R=%d x S=%d (%d ranks each); wait for %d, go on with >= %d", s.method,
            s.replicas, s.shards, s.group_world, d.num_groups, d.min_groups)
        log(INFO, "\t├── Per round: K=%d syncs x A=%d steps; %d rounds = %d steps; model %s, seq %d, batch %d",
            s.syncs_per_round, s.aggregate_every, s.rounds, s.total_steps, s.model, s.seq_len, s.batch_size)
        log(INFO, "\t└── Deadlines: sample %.0f s, hello %.0f s, round %.0f s, rendezvous %.0f s, sync %.0f s",
            d.sample_timeout, d.hello_timeout, d.round_timeout, d.rendezvous_timeout, d.sync_timeout)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """One train message per member: K, A, the ordered members, member 0's rendezvous offer, a fresh prefix."""
        d = self.deadlines
        host = self.groups[self.members[0]].layout.rendezvous_host
        ports = list(self.groups[self.members[0]].layout.rendezvous_ports)
        base = {**dict(config), "syncs": self.spec.syncs_per_round, "steps": self.spec.aggregate_every,
                "members": [str(m) for m in self.members], "rendezvous-host": host, "rendezvous-ports": ports,
                "prefix": f"run{self.run_id}/round{server_round}", "rendezvous-timeout": d.rendezvous_timeout,
                "sync-timeout": d.sync_timeout, "evaluate": self.evaluate_in_train,
                "server-round": server_round, "checkpoint": self.spec.checkpoint_due(server_round),
                "catch-up": self._catch_up, "timeout": max(1.0, d.round_timeout - 5.0)}
        return [self._message(node, P.MSG_TRAIN, {**base, "member-index": i}, str(server_round), d.round_timeout)
                for i, node in enumerate(self.members)]

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Token-weighted metrics of the groups that trained; decide who stays for the next round."""
        by_node = {m.metadata.src_node_id: m for m in replies}
        ok: dict[int, dict[str, Any]] = {}
        rolled_back: dict[int, dict[str, Any]] = {}
        dropped: dict[int, str] = {}
        for node in self.members:
            metrics, error = _reply_payload(by_node.get(node))
            if error:
                dropped[node] = error
            elif metrics.get("sync_failed"):
                rolled_back[node] = metrics
            else:
                ok[node] = metrics
        alive = {**ok, **rolled_back}
        record = self._round_record(server_round, ok, rolled_back, dropped)
        for node, reason in dropped.items():
            self.dropped.add(node)
            self.groups[node].failures.append(f"round {server_round}: {reason}")
            self.left_out[node] = f"dropped in round {server_round}: {reason}"
            log(WARNING, "round %d: group on node %d dropped: %s", server_round, node, reason)
        if rolled_back:
            log(WARNING, "round %d: sync failed; %d surviving group(s) restored their last synced shards; the next "
                "round re-forms with %d member(s)", server_round, len(rolled_back), len(alive))
        elif dropped:
            log(WARNING, "round %d: %d group(s) dropped; the next round goes on with %d member(s)", server_round,
                len(dropped), len(alive))
        self.members = [n for n in self.members if n in alive]
        for node, metrics in alive.items():
            self.groups[node].tokens = int(metrics.get("total_tokens", 0))
        self.history.append(record)  # written and logged by run_round once the round is complete
        return None, MetricRecord({k: v for k, v in record.items() if isinstance(v, (int, float))
                                   and not isinstance(v, bool)} | {"losses": record["losses"] or [0.0]})

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        if self.evaluate_in_train:
            return []
        timeout = self.deadlines.round_timeout
        return [self._message(n, P.MSG_EVALUATE, {**dict(config), "timeout": max(1.0, timeout - 5.0)},
                              f"eval{server_round}", timeout) for n in self.members]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        losses = []
        for reply in replies:
            metrics, error = _reply_payload(reply)
            if not error and "eval_loss" in metrics:
                losses.append(float(metrics["eval_loss"]))
        if not losses:
            return None
        loss = sum(losses) / len(losses)
        if self.history and self.history[-1]["round"] == server_round:
            self.history[-1].update(eval_loss=loss, eval_ppl=_ppl(loss))
        log(INFO, "round %d: eval loss %.4f ppl %.2f (%d groups)", server_round, loss, _ppl(loss), len(losses))
        return MetricRecord({"eval_loss": loss, "eval_ppl": _ppl(loss)})

    # ----- the run ----------------------------------------------------------------------------------------------
    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int | None = None,
              timeout: float | None = None, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Run hello, `num_rounds` (default: spec.rounds) training rounds and finish; returns Flower's Result.

        `timeout`, when given, replaces the round deadline. No arrays are used: `initial_arrays` is ignored.
        """
        if timeout is not None:
            self.deadlines.round_timeout = float(timeout)
        rounds = int(num_rounds or self.spec.rounds)
        result = Result()
        try:
            self.spec.validate()
            if rounds > self.spec.rounds:
                raise ConfigError(f"num_rounds {rounds} exceeds the spec's rounds {self.spec.rounds} (the "
                                  f"learning-rate schedule spans rounds * K * A steps)")
        except ConfigError as exc:
            log(ERROR, "%s", exc)
            raise
        self.run_id = _run_id(grid)
        log(INFO, "Starting %s:", type(self).__name__)
        self.summary()
        start = time.monotonic()
        try:
            self.sampled = self.sample_nodes(grid)
            self.hello(grid, self.sampled)
            if self.resumed_round:
                log(INFO, "resuming after round %d of %d", self.resumed_round, rounds)
            for server_round in range(self.resumed_round + 1, rounds + 1):
                self._catch_up = bool(self.readmit(grid, server_round))
                if len(self.members) < self.deadlines.min_groups:
                    log(ERROR, "only %d group(s) left, fewer than min-groups %d: stopping before round %d",
                        len(self.members), self.deadlines.min_groups, server_round)
                    break
                log(INFO, "")
                log(INFO, "[ROUND %d/%d] %d group(s): nodes %s", server_round, rounds, len(self.members),
                    self.members)
                self.run_round(grid, server_round, result, train_config, evaluate_config)
            self._log_summary(time.monotonic() - start)
        finally:
            self.finish(grid)
        return result

    # ----- steps ------------------------------------------------------------------------------------------------
    def run_round(self, grid: Grid, server_round: int, result: Result, train_config: ConfigRecord | None,
                  evaluate_config: ConfigRecord | None) -> None:
        """Train (K syncs among the groups), aggregate the metrics, evaluate; results go into `result`."""
        t0 = time.monotonic()
        messages = list(self.configure_train(server_round, ArrayRecord(), train_config or ConfigRecord(), grid))
        replies = self.send_and_receive(grid, messages, self.deadlines.round_timeout)
        self._round_wall = time.monotonic() - t0
        _, metrics = self.aggregate_train(server_round, replies)
        if metrics is not None:
            result.train_metrics_clientapp[server_round] = metrics
        self.evaluate_round(grid, server_round, result, evaluate_config)
        self.publish_round()

    def evaluate_round(self, grid: Grid, server_round: int, result: Result,
                       evaluate_config: ConfigRecord | None) -> None:
        """Separate evaluate messages, or the evaluation that came with the round's replies."""
        evaluate = list(self.configure_evaluate(server_round, ArrayRecord(), evaluate_config or ConfigRecord(), grid))
        if evaluate:
            eval_metrics = self.aggregate_evaluate(
                server_round, self.send_and_receive(grid, evaluate, self.deadlines.round_timeout))
            if eval_metrics is not None:
                result.evaluate_metrics_clientapp[server_round] = eval_metrics
        elif self.history and "eval_loss" in self.history[-1]:
            h = self.history[-1]
            result.evaluate_metrics_clientapp[server_round] = MetricRecord(
                {"eval_loss": h["eval_loss"], "eval_ppl": h["eval_ppl"]})

    def publish_round(self) -> None:
        """Write and log the round's record (the last in `history`)."""
        if self.history and self.history[-1].get("kind") == "round":
            self._write(self.history[-1])
            self._log_round(self.history[-1])

    def sample_nodes(self, grid: Grid) -> list[int]:
        """The connected nodes, once `num_groups` are there or at `sample_timeout` (then at least min_groups)."""
        d = self.deadlines
        deadline = time.monotonic() + d.sample_timeout
        while True:
            nodes = sorted(grid.get_node_ids())
            if d.num_groups and len(nodes) >= d.num_groups:
                return nodes[:d.num_groups]
            if time.monotonic() >= deadline:
                if len(nodes) >= max(1, d.min_groups):
                    if d.num_groups:
                        log(WARNING, "only %d of %d expected nodes connected within %.0f s; going on with them",
                            len(nodes), d.num_groups, d.sample_timeout)
                    return nodes
                message = (f"only {len(nodes)} node(s) connected within {d.sample_timeout:.0f} s, fewer than "
                           f"min-groups {d.min_groups}")
                log(ERROR, "%s", message)
                raise RuntimeError(message)
            time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))

    def hello(self, grid: Grid, nodes: list[int]) -> None:
        """Set up every sampled group; keep those that match the run and each other."""
        log(INFO, "hello to %d node(s): %s", len(nodes), nodes)
        candidates = self._hello_round(grid, {node: i for i, node in enumerate(nodes)}, len(nodes))
        if candidates:
            by_shards: dict[int, dict[int, GroupInfo]] = {}  # groups of one S must shard alike (server path: S
            for node, g in candidates.items():               # may differ between facilities)
                by_shards.setdefault(g.layout.shards, {})[node] = g
            for same_s in by_shards.values():
                self._keep_majority(same_s, lambda g: g.fingerprint, lambda g, common: (
                    f"model/sharding fingerprint {g.fingerprint[:12]} differs from the majority's {common[:12]} "
                    f"(another model or dtype)"))
            candidates = {n: g for same_s in by_shards.values() for n, g in same_s.items()}
            if self.spec.resume:  # the run goes on after the round most groups' checkpoints hold
                self.resumed_round = self._keep_majority(candidates, lambda g: g.resumed_round, lambda g, common: (
                    f"its checkpoint holds round {g.resumed_round}, the majority's round {common} (a group that "
                    f"missed a checkpoint would train from another model)"))
            partitions = Counter(g.partition_id for g in candidates.values())
            for pid, count in partitions.items():
                if count > 1:
                    log(WARNING, "%d groups train on the same data partition %d", count, pid)
        self.groups = candidates
        self.members = sorted(candidates, key=lambda n: (candidates[n].partition_id, n))
        if len(self.members) < max(1, self.deadlines.min_groups):
            reasons = "; ".join(f"node {n}: {r}" for n, r in self.left_out.items()) or "no replies"
            message = (f"{len(self.members)} group(s) passed the hello, fewer than min-groups "
                       f"{self.deadlines.min_groups}: {reasons}")
            log(ERROR, "%s", message)
            raise ConfigError(message)
        log(INFO, "hello: %d group(s) ready: %s", len(self.members),
            ", ".join(f"node {n} (partition {self.groups[n].partition_id})" for n in self.members))

    def _hello_round(self, grid: Grid, partitions: dict[int, int], num_partitions: int,
                     rejoin: bool = False) -> dict[int, GroupInfo]:
        """Send hello to the nodes (node -> partition id); the groups whose reply fits the run's layout."""
        d = self.deadlines
        spec_json = self.spec.to_json()
        messages = [self._message(node, P.MSG_HELLO,
                                  {"spec": spec_json, "partition-id": pid, "num-partitions": num_partitions,
                                   "run-key": str(self.run_id), "group-idle-timeout": self.group_idle_timeout,
                                   "rejoin": rejoin, "timeout": max(1.0, d.hello_timeout - 5.0)}, "hello",
                                  d.hello_timeout)
                    for node, pid in partitions.items()]
        replies = {m.metadata.src_node_id: m for m in self.send_and_receive(grid, messages, d.hello_timeout)}
        candidates: dict[int, GroupInfo] = {}
        for node in partitions:
            metrics, error = _reply_payload(replies.get(node))
            info = _reply_info(replies.get(node))
            layout = P.GroupLayout(method=str(info.get("method", "?")), replicas=int(metrics.get("replicas", 0)),
                                   shards=int(metrics.get("shards", 0)), world=int(metrics.get("world", 0)),
                                   rendezvous_host=str(info.get("rendezvous_host", "")),
                                   rendezvous_ports=[int(p) for p in metrics.get("rendezvous_ports", [])])
            partition = int(metrics.get("partition_id", 0))
            expected = self.spec.for_group(partition, str(info.get("facility", "")))
            if not error and layout.mismatch(expected):
                error = layout.mismatch(expected)
            if not error and len(layout.rendezvous_ports) != expected.shards:
                error = f"offers {len(layout.rendezvous_ports)} rendezvous ports for {expected.shards} shard indices"
            if error:
                self.left_out[node] = error
                log(ERROR, "group on node %d left out: %s", node, error)
                continue
            candidates[node] = GroupInfo(node, partition, layout, str(info.get("fingerprint", "")),
                                         int(metrics.get("tokens", 0)), int(metrics.get("resumed_round", 0)),
                                         self.facility_of(partition, info))
        return candidates

    def readmit(self, grid: Grid, server_round: int) -> list[int]:
        """Groups dropped in an earlier round whose node is online get a hello (a lost group is relaunched or
        restarted there); those that pass it and match the members' fingerprint rejoin: this round starts with a
        catch-up in which every member adopts member 0's shards, outer state and step. Returns the rejoined nodes."""
        if not self.rejoin or not self.dropped or not self.members:
            return []
        try:
            online = set(grid.get_node_ids())
        except Exception:  # noqa: BLE001 - try again next round
            return []
        nodes = [n for n in sorted(self.dropped) if n in online]
        if not nodes:
            return []
        log(INFO, "round %d: hello to %d dropped group(s) to rejoin: %s", server_round, len(nodes), nodes)
        partitions = {n: self.groups[n].partition_id for n in nodes}
        candidates = self._hello_round(grid, partitions, len(self.sampled), rejoin=True)
        joined = []
        for node, g in candidates.items():
            source = self.catch_up_source(g)
            if source is None:
                self.left_out[node] = "rejoin refused: no member to catch up from"
                log(ERROR, "group on node %d: %s", node, self.left_out[node])
                continue
            fingerprint = self.groups[source].fingerprint
            if g.fingerprint != fingerprint:
                self.left_out[node] = f"rejoin refused: fingerprint {g.fingerprint[:12]} != the members' {fingerprint[:12]}"
                log(ERROR, "group on node %d: %s", node, self.left_out[node])
                continue
            g.failures = self.groups[node].failures
            self.groups[node] = g
            self.dropped.discard(node)
            self.left_out.pop(node, None)
            self.members.append(node)  # after the established members: member 0 is the catch-up source
            joined.append(node)
        if joined:
            log(INFO, "round %d: group(s) on node(s) %s rejoin; the round starts with a catch-up", server_round,
                joined)
        self._rejoined = joined
        return joined

    def catch_up_source(self, group: GroupInfo) -> int | None:
        """The member a rejoining group must match (fingerprint) and catches up from: member 0."""
        return self.members[0] if self.members else None

    def _keep_majority(self, candidates: dict[int, GroupInfo], key: Callable[[GroupInfo], Any],
                       reason: Callable[[GroupInfo, Any], str]) -> Any:
        """Leave out the candidates whose `key` differs from the most common value (logged); return that value."""
        common, _ = Counter(key(g) for g in candidates.values()).most_common(1)[0]
        for node, g in list(candidates.items()):
            if key(g) != common:
                self.left_out[node] = reason(g, common)
                log(ERROR, "group on node %d left out: %s", node, self.left_out[node])
                del candidates[node]
        return common

    def facility_of(self, partition_id: int, hello_info: dict[str, Any]) -> str:
        """The decentralised path has no facilities (the server path overrides this)."""
        return ""

    def finish(self, grid: Grid) -> None:
        """Tell every sampled node the run is over (bounded); a launched group is shut down."""
        nodes = self.sampled
        if not nodes:
            return
        try:
            online = set(grid.get_node_ids())
        except Exception:  # noqa: BLE001 - best effort at the end of the run
            online = set(nodes)
        targets = [n for n in nodes if n in online]
        d = self.deadlines
        messages = [self._message(n, P.MSG_FINISH, {
            "save-dir": self.save_dir if self.members and n == self.members[0] else "",
            "stop-group": self.stop_groups, "timeout": max(1.0, d.finish_timeout - 5.0)}, "finish",
            d.finish_timeout) for n in targets]
        if not messages:
            return
        replies = self.send_and_receive(grid, messages, d.finish_timeout)
        stopped = sum(1 for r in replies if _reply_payload(r)[0].get("stopped"))
        log(INFO, "finish: %d of %d node(s) answered (%d group(s) shut down)", len(replies), len(messages), stopped)

    def send_and_receive(self, grid: Grid, messages: list[Message], timeout: float,
                         on_reply: Callable[[Message], Message] | None = None) -> list[Message]:
        """Push `messages`, pull replies until all arrived, `timeout` passed, or the awaited nodes went offline.

        `on_reply` sees each reply as it arrives (e.g. to fold its arrays into an aggregate and drop them); what it
        returns is kept. With `on_reply`, replies are pulled one at a time, so only one is in this process at once
        (the others wait at the SuperLink).
        """
        if not messages:
            return []
        pending = self.push(grid, messages)
        replies = self.await_replies(grid, pending, time.monotonic() + timeout, on_reply)
        if pending:
            log(WARNING, "no reply from node(s) %s within %.0f s", sorted(set(pending.values())), timeout)
        return replies

    def push(self, grid: Grid, messages: list[Message]) -> dict[str, int]:
        """Push `messages`; returns message id -> destination node of those the SuperLink took."""
        ids = list(grid.push_messages(messages))
        return {mid: m.metadata.dst_node_id for mid, m in zip(ids, messages) if mid}

    def await_replies(self, grid: Grid, pending: dict[str, int], deadline: float,
                      on_reply: Callable[[Message], Message] | None = None) -> list[Message]:
        """Pull the replies to `pending` (message id -> node) until all arrived, `deadline` passed, or the awaited
        nodes went offline; answered and given-up ids leave `pending`, which then holds those still unanswered.

        `on_reply` as in `send_and_receive` (replies pulled one at a time)."""
        d = self.deadlines
        replies: list[Message] = []
        next_check = time.monotonic() + d.node_check_interval
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
                next_check = now + d.node_check_interval
                try:
                    online = set(grid.get_node_ids())
                except Exception:  # noqa: BLE001 - keep waiting until the deadline
                    online = set(pending.values())
                for mid, node in list(pending.items()):
                    if node not in online:
                        log(WARNING, "node %d went offline; not waiting for its reply", node)
                        del pending[mid]
            time.sleep(min(d.poll_interval, max(0.0, deadline - now)))
        return replies

    # ----- helpers ----------------------------------------------------------------------------------------------
    def _message(self, node: int, message_type: str, config: dict[str, Any], group_id: str, ttl: float) -> Message:
        return Message(RecordDict({P.CONFIG: ConfigRecord(config)}), node, message_type, ttl=ttl,
                       group_id=group_id)

    def _round_record(self, server_round: int, ok: dict[int, dict[str, Any]], rolled_back: dict[int, dict[str, Any]],
                      dropped: dict[int, str]) -> dict[str, Any]:
        alive = {**ok, **rolled_back}
        tokens = {n: float(m.get("tokens", 0)) for n, m in alive.items()}
        total_tokens = sum(tokens.values())
        losses_by_node = {n: [float(x) for x in m.get("losses", [])] for n, m in alive.items()}
        steps = min((len(v) for v in losses_by_node.values()), default=0)
        weights = {n: (tokens[n] or 1.0) for n in alive}
        weight_sum = sum(weights.values()) or 1.0
        step_losses = [sum(weights[n] * losses_by_node[n][i] for n in alive) / weight_sum for i in range(steps)]
        train_loss = sum(step_losses) / len(step_losses) if step_losses else float("nan")
        work = {n: float(m.get("train_s", 0)) + float(m.get("sync_s", 0)) + float(m.get("eval_s", 0))
                for n, m in alive.items()}
        work_s = max(work.values(), default=0.0)
        round_s = self._round_wall
        evals = [float(m["eval_loss"]) for m in alive.values() if "eval_loss" in m]
        checksums = {str(n): [float(x) for x in m.get("checksums", [])] for n, m in alive.items()}
        syncs = min((int(m.get("syncs", 0)) for m in alive.values()), default=0)
        record: dict[str, Any] = {
            "kind": "round", "round": server_round, "groups": len(ok), "rolled_back": len(rolled_back),
            "dropped": len(dropped), "members": [str(n) for n in self.members],
            "rejoined": [str(n) for n in self._rejoined] if self._catch_up else [],
            "synced": int(bool(ok) and not rolled_back and not dropped), "syncs": syncs, "steps": steps,
            "train_loss": train_loss, "train_ppl": _ppl(train_loss), "tokens": int(total_tokens),
            "tokens_per_s": total_tokens / round_s if round_s > 0 else 0.0, "round_s": round_s,
            "train_s": max((float(m.get("train_s", 0)) for m in alive.values()), default=0.0),
            "sync_s": max((float(m.get("sync_s", 0)) for m in alive.values()), default=0.0),
            "eval_s": max((float(m.get("eval_s", 0)) for m in alive.values()), default=0.0),
            "work_s": work_s, "overhead_s": max(0.0, round_s - work_s),
            "overhead_pct": 100.0 * max(0.0, round_s - work_s) / round_s if round_s > 0 else 0.0,
            "checksums_equal": int(_checksums_equal(checksums, syncs, self.spec.group_world)),
            "losses": step_losses, "checksums": checksums,
            "errors": {str(n): e for n, e in dropped.items()} | {
                str(n): str(m.get("sync_error", "")) for n, m in rolled_back.items()},
        }
        if evals:
            record["eval_loss"] = sum(evals) / len(evals)
            record["eval_ppl"] = _ppl(record["eval_loss"])
        return record

    def _log_round(self, r: dict[str, Any]) -> None:
        eval_part = f", eval ppl {r['eval_ppl']:.2f}" if "eval_ppl" in r else ""
        log(INFO, "round %d: train loss %.4f ppl %.2f%s | %.0f tokens/s | %d group(s), %d sync(s)%s | round %.2f s"
            " = groups' work %.2f s (train %.2f + sync %.2f + eval %.2f) + orchestration %.2f s (%.1f%%)",
            r["round"], r["train_loss"], r["train_ppl"], eval_part, r["tokens_per_s"], r["groups"] + r["rolled_back"],
            r["syncs"], "" if r["synced"] else " [SYNC FAILED: rolled back]", r["round_s"], r["work_s"],
            r["train_s"], r["sync_s"], r["eval_s"], r["overhead_s"], r["overhead_pct"])
        if r["syncs"] and not r["checksums_equal"]:
            log(ERROR, "round %d: the groups' shard checksums differ after a sync", r["round"])

    def _log_summary(self, seconds: float) -> None:
        rounds = [h for h in self.history if h.get("kind") == "round"]
        if not rounds:
            return
        round_s = sum(h["round_s"] for h in rounds)
        overhead = sum(h["overhead_s"] for h in rounds)
        summary = {"kind": "summary", "rounds": len(rounds), "seconds": seconds, "round_s": round_s,
                   "overhead_s": overhead, "overhead_pct": 100.0 * overhead / round_s if round_s else 0.0,
                   "tokens": sum(h["tokens"] for h in rounds),
                   "tokens_per_s": sum(h["tokens"] for h in rounds) / round_s if round_s else 0.0,
                   "final_train_loss": rounds[-1]["train_loss"], "final_eval_ppl": rounds[-1].get("eval_ppl"),
                   "members": [str(m) for m in self.members], "left_out": {str(k): v for k, v in self.left_out.items()}}
        self.history.append(summary)
        self._write(summary)
        log(INFO, "")
        log(INFO, "Summary: %d round(s) in %.1f s (run %.1f s); orchestration overhead %.2f s = %.1f%% of round time;"
            " %.0f tokens/s", len(rounds), round_s, seconds, overhead, summary["overhead_pct"],
            summary["tokens_per_s"])
        log(INFO, "  round | train ppl | eval ppl | tokens/s | round s | work s | overhead")
        for h in rounds:
            log(INFO, "  %5d | %9.2f | %8s | %8.0f | %7.2f | %6.2f | %5.1f%%", h["round"], h["train_ppl"],
                f"{h['eval_ppl']:.2f}" if "eval_ppl" in h else "-", h["tokens_per_s"], h["round_s"], h["work_s"],
                h["overhead_pct"])

    def _write(self, record: dict[str, Any]) -> None:
        if not self.metrics_path:
            return
        path = Path(self.metrics_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")


def _run_id(grid: Grid) -> int:
    try:
        return int(grid.run.run_id)
    except Exception:  # noqa: BLE001 - a grid without a run (tests)
        return 0


def _ppl(loss: float) -> float:
    return math.exp(loss) if loss == loss and loss < 50 else float("inf")


def _reply_info(reply: Message | None) -> dict[str, Any]:
    if reply is None or reply.has_error():
        return {}
    return dict(reply.content.config_records.get(P.INFO, {}))


def _reply_payload(reply: Message | None) -> tuple[dict[str, Any], str]:
    """(metrics, error): error is '' for a good reply, else why the group cannot be used."""
    if reply is None:
        return {}, "no reply before the deadline"
    if reply.has_error():
        return {}, f"Flower error {reply.error.code}: {reply.error.reason}"
    info = _reply_info(reply)
    metrics = dict(reply.content.metric_records.get(P.METRICS, {}))
    if not info.get("ok", False):
        return metrics, str(info.get("error") or "the group reported a failure")
    return metrics | {k: v for k, v in info.items() if k not in ("ok", "error")}, ""


def _checksums_equal(checksums: dict[str, list[float]], syncs: int, group_world: int) -> bool:
    """After each of the first `syncs` syncs, every group's rank holding shard s has the same checksum."""
    if len(checksums) < 2 or syncs == 0:
        return True
    vectors = [v[: syncs * group_world] for v in checksums.values()]
    if any(len(v) < syncs * group_world for v in vectors):
        return False
    return all(v == vectors[0] for v in vectors[1:])


def deadlines_from_run_config(run_config: dict[str, Any]) -> Deadlines:
    """Deadlines from run-config keys with '-' (e.g. round-timeout); missing keys keep their defaults."""
    values = {}
    for f in Deadlines.__dataclass_fields__.values():
        key = f.name.replace("_", "-")
        if key in run_config:
            default = getattr(Deadlines(), f.name)
            values[f.name] = type(default)(run_config[key])
    return Deadlines(**values)


__all__ = ["DecentralizedFedAvg", "Deadlines", "GroupInfo", "deadlines_from_run_config"]
