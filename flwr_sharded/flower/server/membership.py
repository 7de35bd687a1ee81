"""Who takes part: sampling with a deadline, the hello that admits groups, and the rejoin of dropped ones.

`GroupMembership` is the part of `DecentralizedFedAvg` that owns `groups` (what is known of each node's group),
`members` (this round's, ordered: member 0 hosts the rendezvous), `left_out` (node -> why) and `dropped` (candidates
to rejoin). Strategies change who trains in a round by overriding `select_members`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from logging import ERROR, INFO, WARNING
from typing import Any

from flwr.serverapp import Grid
from flwr.supercore import log

from flwr_sharded.errors import ConfigError
from flwr_sharded.flower import messages as M
from flwr_sharded.flower.server import unequal
from flwr_sharded.flower.server.grid import message, reply_info, reply_payload
from flwr_sharded.parallel.verdict import DROPPED, NAMED, Verdict, reasons


@dataclass
class GroupInfo:
    """What the strategy knows of one group (one Flower node)."""

    node_id: int
    partition_id: int
    layout: M.GroupLayout
    fingerprint: str
    tokens: int = 0
    resumed_round: int = 0
    """The round this group's checkpoint holds (resume)."""
    facility: str = ""
    """The facility (set of groups sharing a fabric) of the server path; '' on the decentralised path."""
    log_file: str = ""
    """Where the group writes its log (groups launched in simulation)."""
    model_digest: str = ""
    """Digest of the model's parameter names, global shapes and dtypes (the same for groups of any S)."""
    param_rows: list[int] = field(default_factory=list)
    """Each parameter's rows (the dimension FSDP2 shards), for the sync plan of groups that shard differently."""
    step_s: float = 0.0
    """Seconds per inner step in its last round (`group-steps speed` sets its local steps from it); 0: unmeasured."""
    failures: list[str] = field(default_factory=list)
    strikes: int = 0
    """Consecutive rounds this group was held at fault (`GroupMembership.hold_at_fault`)."""
    benched: int = 0
    """How many times `max-strikes` has left it out."""
    benched_until: int = 0
    """The first round it may rejoin in after being left out by `max-strikes`."""


class GroupMembership:
    """Sampling, hello, rejoin; mixed into the strategy, whose `run`, `deadlines` and `send_and_receive` it uses."""

    groups: dict[int, GroupInfo]
    members: list[int]
    left_out: dict[int, str]
    dropped: set[int]
    sampled: list[int]

    def save_dir(self) -> str:
        """Where member 0 writes the final model at the end ('' for nowhere). It travels in every hello, so that a
        group whose node config does not allow it refuses before training (`flwr_sharded.flower.node_policy`)."""
        raise NotImplementedError

    def select_members(self, server_round: int) -> list[int]:
        """The members that train in `server_round` (default: every member); override to let some groups sit a
        round out. Member 0 of the result hosts the round's rendezvous."""
        return list(self.members)

    def sample_nodes(self, grid: Grid) -> list[int]:
        """The connected nodes, once `num-groups` are there or at `sample-timeout` (then at least min-groups)."""
        d = self.deadlines
        deadline = time.monotonic() + d.sample_timeout
        told = time.monotonic() - 30.0 + min(5.0, d.sample_timeout / 4)  # first said after 5 s, then every 30 s
        while True:
            nodes = sorted(grid.get_node_ids())
            if d.num_groups and len(nodes) >= d.num_groups:
                return nodes[:d.num_groups]
            if d.num_groups and told + 30.0 <= time.monotonic() < deadline:  # say what it waits for
                told = time.monotonic()
                log(INFO, "waiting for nodes: %d of num-groups %d connected; in %.0f s (sample-timeout) the run goes on "
                    "with those connected, if at least min-groups %d (a simulation has as many nodes as SuperNodes: "
                    "--federation-config num-supernodes=N)", len(nodes), d.num_groups, deadline - told, d.min_groups)
            if time.monotonic() >= deadline:
                if len(nodes) >= max(1, d.min_groups):
                    if d.num_groups:
                        log(WARNING, "only %d of %d expected nodes connected within %.0f s; going on with them",
                            len(nodes), d.num_groups, d.sample_timeout)
                    return nodes
                text = (f"only {len(nodes)} node(s) connected within {d.sample_timeout:.0f} s, fewer than "
                        f"min-groups {d.min_groups}")
                log(ERROR, "%s", text)
                raise RuntimeError(text)
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
            if len(by_shards) > 1:  # groups that shard differently: one model, and seats every plan can serve
                unequal.check_layouts(self, candidates)
            if self.run.train.checkpoint.resume:  # the run goes on after the round most groups' checkpoints hold
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
            by_reason: dict[str, list[str]] = {}  # the same error of several groups said once
            for n, r in self.left_out.items():
                by_reason.setdefault(r, []).append(str(n))
            reasons = "; ".join(f"node{'s' * (len(ns) > 1)} {', '.join(ns)}: {r}" for r, ns in by_reason.items()) \
                or "no replies"
            text = (f"{len(self.members)} group(s) passed the hello, fewer than min-groups "
                    f"{self.deadlines.min_groups}: {reasons}")
            log(ERROR, "%s", text)
            raise ConfigError(text)
        log(INFO, "hello: %d group(s) ready: %s", len(self.members),
            ", ".join(f"node {n} (partition {self.groups[n].partition_id})" for n in self.members))
        for node in self.members:
            if self.groups[node].log_file:
                log(INFO, "  node %d's group logs its progress to %s", node, self.groups[node].log_file)

    def _hello_round(self, grid: Grid, partitions: dict[int, int], num_partitions: int,
                     rejoin: bool = False) -> dict[int, GroupInfo]:
        """Send hello to the nodes (node -> partition id); the groups whose reply fits the run's layout."""
        d = self.deadlines
        run_json = self.run.to_json()
        messages = [message(node, M.MSG_HELLO,
                            {"run": run_json, "partition-id": pid, "num-partitions": num_partitions,
                             "run-key": str(self.run_id), "group-idle-timeout": d.group_idle_timeout,
                             "save-dir": self.save_dir(),
                             "rejoin": rejoin, "timeout": max(1.0, d.hello_timeout - 5.0)}, "hello", d.hello_timeout)
                    for node, pid in partitions.items()]
        replies = {m.metadata.src_node_id: m for m in self.send_and_receive(grid, messages, d.hello_timeout)}
        candidates: dict[int, GroupInfo] = {}
        for node in partitions:
            metrics, error = reply_payload(replies.get(node))
            info = reply_info(replies.get(node))
            layout = M.GroupLayout(method=str(info.get("method", "?")), replicas=int(metrics.get("replicas", 0)),
                                   shards=int(metrics.get("shards", 0)), world=int(metrics.get("world", 0)),
                                   rendezvous_host=str(info.get("rendezvous_host", "")),
                                   rendezvous_ports=[int(p) for p in metrics.get("rendezvous_ports", [])])
            partition = int(metrics.get("partition_id", 0))
            expected = self.run.for_group(partition, str(info.get("facility", "")), own_shards=layout.shards)
            if not error and layout.mismatch(expected):
                error = layout.mismatch(expected)
            if not error and len(layout.rendezvous_ports) != expected.train.parallel.shards:
                error = (f"offers {len(layout.rendezvous_ports)} rendezvous ports for "
                         f"{expected.train.parallel.shards} shard indices")
            if error:
                self.left_out[node] = error
                log(ERROR, "group on node %d left out: %s", node, error)
                continue
            candidates[node] = GroupInfo(node, partition, layout, str(info.get("fingerprint", "")),
                                         int(metrics.get("tokens", 0)), int(metrics.get("resumed_round", 0)),
                                         self.facility_of(partition, info), str(info.get("log_file", "")),
                                         str(info.get("model_digest", "")),
                                         [int(r) for r in metrics.get("param_rows", [])])
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
        nodes = [n for n in sorted(self.dropped) if n in online and self.groups[n].benched_until <= server_round]
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
            refused = unequal.rejoin_refusal(self, g, self.groups[source])
            if refused:
                self.left_out[node] = f"rejoin refused: {refused}"
                log(ERROR, "group on node %d: %s", node, self.left_out[node])
                continue
            old = self.groups[node]
            g.failures, g.benched = old.failures, old.benched
            self.groups[node] = g
            self.dropped.discard(node)
            self.left_out.pop(node, None)
            self.members.append(node)  # after the established members: member 0 is the catch-up source
            joined.append(node)
        if joined:
            log(INFO, "round %d: group(s) on node(s) %s rejoin; the round starts with a catch-up", server_round,
                joined)
        return joined

    def hold_at_fault(self, server_round: int, members: list[int], reports: dict[int, dict[str, Any]],
                      dropped: dict[int, str]) -> dict[int, str]:
        """Who was at fault in a round (node -> why): the dropped members, and those named in more than half of the
        other members' reports (`sync_blame`: absent at the rendezvous or failed their part of a sync;
        `sync_left_out`: left out of an adopted sync), member indices as in `members`. A lone report cannot strike
        an honest group. Counts consecutive strikes; `max-strikes` in a row leave a group out for `bench-rounds`
        rounds (doubling each time), never below `min-groups` members. Returns the faults of the round (node ->
        why; `fault_verdicts` gives them as `Verdict`s)."""
        return reasons(self.strike(server_round, members, self.fault_verdicts(members, reports, dropped)))

    def fault_verdicts(self, members: list[int], reports: dict[int, dict[str, Any]],
                       dropped: dict[int, str]) -> list[Verdict]:
        """The round's members at fault (`Verdict.member`: the node): dropped, or named by most other members."""
        faults = [Verdict(node, why, DROPPED) for node, why in dropped.items()]
        for index, node in enumerate(members):
            if node in dropped:
                continue
            others = [m for n, m in reports.items() if n != node]
            named = [m for m in others if index in m.get("sync_blame", []) or index in m.get("sync_left_out", [])]
            if others and 2 * len(named) > len(others):
                faults.append(Verdict(node, f"named at fault by {len(named)} of {len(others)} other member(s) "
                                            f"(absent at the rendezvous, failed its part of a sync, or left out of "
                                            f"one)", NAMED))
        return faults

    def strike(self, server_round: int, members: list[int], verdicts: list[Verdict]) -> list[Verdict]:
        """Count a strike for each member with a verdict, reset the others' count; bench those at `max-strikes`
        (`hold_at_fault`). Returns `verdicts`."""
        faults = reasons(verdicts)
        limit, bench = self.run.federation.max_strikes, self.run.federation.bench_rounds
        for node in members:
            g = self.groups[node]
            g.strikes = g.strikes + 1 if node in faults else 0
            if not limit or g.strikes < limit:
                continue
            staying = [n for n in self.members if n != node]
            if len(staying) < max(1, self.deadlines.min_groups):
                log(WARNING, "round %d: group on node %d was at fault in %d rounds in a row, but leaving it out "
                    "would leave %d group(s), fewer than min-groups %d: it stays", server_round, node, g.strikes,
                    len(staying), self.deadlines.min_groups)
                continue
            g.benched += 1
            rounds = bench * 2 ** (g.benched - 1)
            g.benched_until, g.strikes = server_round + rounds + 1, 0
            self.members = staying
            self.dropped.add(node)
            self.left_out[node] = (f"left out after round {server_round} for {rounds} round(s): at fault in "
                                   f"{limit} rounds in a row ({faults[node][:160]})")
            log(WARNING, "round %d: group on node %d %s; it may rejoin in round %d", server_round, node,
                self.left_out[node], g.benched_until)
        return verdicts

    def catch_up_source(self, group: GroupInfo) -> int | None:
        """The member a rejoining group must match (fingerprint) and catches up from: member 0."""
        return self.members[0] if self.members else None

    def facility_of(self, partition_id: int, hello_info: dict[str, Any]) -> str:
        """The decentralised path has no facilities (the server path overrides this)."""
        return ""

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
