"""Who takes part in a run: the sampled nodes, the groups that passed the hello, the members, the groups left out and
why, and the strikes that bench a group (`GroupMembership`, which the strategy owns)."""

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
from flwr_sharded.flower.messages import MSG_HELLO, GroupLayout
from flwr_sharded.flower.run_config import FlowerRun
from flwr_sharded.flower.server.grid import Polling, message, reply_info, reply_payload, run_id, send_and_receive
from flwr_sharded.parallel.sync_plan import shard_rows
from flwr_sharded.parallel.verdict import DROPPED, NAMED, Verdict, reasons


@dataclass
class GroupInfo:
    """What the strategy knows of one group (one Flower node)."""

    node_id: int
    partition_id: int
    layout: GroupLayout
    fingerprint: str
    tokens: int = 0
    resumed_round: int = 0
    """The round its checkpoint holds (resume)."""
    facility: str = ""
    """Its facility (the node config's `facility`, else the run config's `facilities`; '' where neither names one):
    on the server path the groups it syncs with, on the decentralised path its site (two-level rounds)."""
    log_file: str = ""
    """Where a group launched in simulation logs."""
    model_digest: str = ""
    """Digest of the model's parameter names, global shapes and dtypes (the same for groups of any S)."""
    param_rows: list[int] = field(default_factory=list)
    """Each parameter's rows (the dimension FSDP2 shards)."""
    step_s: float = 0.0
    """Seconds per inner step in its last round (0: unmeasured); `group-steps speed` sets its local steps from it."""
    strikes: int = 0
    """Consecutive rounds it was held at fault."""
    benched: int = 0
    """How many times `max-strikes` left it out."""
    benched_until: int = 0
    """The first round it may rejoin in after `max-strikes` left it out."""


class GroupMembership:
    """The run's groups (`groups`, by node), its members in order (`members`: member 0 hosts the rendezvous), the
    groups left out (`left_out`, node -> why) and those that may rejoin (`dropped`; `rejoin` offers it each round).
    `save_dir`, where member 0 writes the final model, travels in every hello: a group whose node config does not
    allow it refuses before training."""

    def __init__(self, run: FlowerRun, polling: Polling, *, rejoin: bool = True, save_dir: str = "") -> None:
        self.run, self.deadlines, self.polling = run, run.deadlines, polling
        self.rejoin, self.save_dir = rejoin, save_dir
        self.sampled: list[int] = []
        self.groups: dict[int, GroupInfo] = {}
        self.members: list[int] = []
        self.left_out: dict[int, str] = {}
        self.dropped: set[int] = set()
        self.resumed_round = 0
        """The round most groups' checkpoints hold (resume); training goes on with the next one."""

    def sample(self, grid: Grid) -> list[int]:
        """The connected nodes, once `num-groups` are there or at `sample-timeout` (then at least min-groups)."""
        d = self.deadlines
        deadline = time.monotonic() + d.sample_timeout
        told = time.monotonic() - 30.0 + min(5.0, d.sample_timeout / 4)  # first said after 5 s, then every 30 s
        while not (d.num_groups and len(nodes := sorted(grid.get_node_ids())) >= d.num_groups):
            if d.num_groups and told + 30.0 <= time.monotonic() < deadline:
                told = time.monotonic()
                log(INFO, "waiting for nodes: %d of num-groups %d connected; in %.0f s (sample-timeout) the run goes "
                    "on with those connected, if at least min-groups %d (a simulation has as many nodes as SuperNodes: "
                    "--federation-config num-supernodes=N)", len(nodes), d.num_groups, deadline - told, d.min_groups)
            if time.monotonic() >= deadline:
                if len(nodes) < max(1, d.min_groups):
                    text = (f"only {len(nodes)} node(s) connected within {d.sample_timeout:.0f} s, fewer than "
                            f"min-groups {d.min_groups}")
                    log(ERROR, "%s", text)
                    raise RuntimeError(text)
                if d.num_groups:
                    log(WARNING, "only %d of %d expected nodes connected within %.0f s; going on with them",
                        len(nodes), d.num_groups, d.sample_timeout)
                break
            time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))
        self.sampled = nodes[:d.num_groups] if d.num_groups else nodes
        return self.sampled

    def hello(self, grid: Grid) -> None:
        """Set up every sampled group; keep those that match the run and each other (ConfigError below min-groups)."""
        nodes = self.sampled
        log(INFO, "hello to %d node(s): %s", len(nodes), nodes)
        candidates = self._hello_round(grid, {node: i for i, node in enumerate(nodes)}, len(nodes))
        if candidates:
            by_shards: dict[int, dict[int, GroupInfo]] = {}  # groups of one S must shard alike
            for node, g in candidates.items():
                by_shards.setdefault(g.layout.shards, {})[node] = g
            for same_s in by_shards.values():
                self._keep_majority(same_s, lambda g: g.fingerprint, lambda g, common: (
                    f"model/sharding fingerprint {g.fingerprint[:12]} differs from the majority's {common[:12]} "
                    f"(another model or dtype)"))
            candidates = {n: g for same_s in by_shards.values() for n, g in same_s.items()}
            if len(by_shards) > 1:
                check_layouts(self, candidates)
            if self.run.train.checkpoint.resume:  # the run goes on after the round most groups' checkpoints hold
                self.resumed_round = self._keep_majority(candidates, lambda g: g.resumed_round, lambda g, common: (
                    f"its checkpoint holds round {g.resumed_round}, the majority's round {common} (a group that "
                    f"missed a checkpoint would train from another model)"))
            for pid, count in Counter(g.partition_id for g in candidates.values()).items():
                if count > 1:
                    log(WARNING, "%d groups train on the same data partition %d", count, pid)
        self.groups = candidates
        self.members = sorted(candidates, key=lambda n: (candidates[n].partition_id, n))
        if len(self.members) < max(1, self.deadlines.min_groups):
            by_reason: dict[str, list[str]] = {}  # the same error of several groups said once
            for n, r in self.left_out.items():
                by_reason.setdefault(r, []).append(str(n))
            why = "; ".join(f"node{'s' * (len(ns) > 1)} {', '.join(ns)}: {r}" for r, ns in by_reason.items())
            text = (f"{len(self.members)} group(s) passed the hello, fewer than min-groups "
                    f"{self.deadlines.min_groups}: {why or 'no replies'}")
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
        config = {"run": self.run.to_json(), "num-partitions": num_partitions, "run-key": str(run_id(grid)),
                  "group-idle-timeout": d.group_idle_timeout, "save-dir": self.save_dir, "rejoin": rejoin,
                  "timeout": max(1.0, d.hello_timeout - 5.0)}
        messages = [message(node, MSG_HELLO, {**config, "partition-id": pid}, "hello", d.hello_timeout)
                    for node, pid in partitions.items()]
        replies = {m.metadata.src_node_id: m for m in send_and_receive(grid, messages, d.hello_timeout, self.polling)}
        candidates: dict[int, GroupInfo] = {}
        for node in partitions:
            metrics, error = reply_payload(replies.get(node))
            info = reply_info(replies.get(node))
            layout = GroupLayout(method=str(info.get("method", "?")), replicas=int(metrics.get("replicas", 0)),
                                 shards=int(metrics.get("shards", 0)), world=int(metrics.get("world", 0)),
                                 rendezvous_host=str(info.get("rendezvous_host", "")),
                                 rendezvous_ports=[int(p) for p in metrics.get("rendezvous_ports", [])])
            partition = int(metrics.get("partition_id", 0))
            expected = self.run.for_group(partition, str(info.get("facility", "")), own_shards=layout.shards)
            error = error or layout.mismatch(expected)
            if not error and len(layout.rendezvous_ports) != expected.train.parallel.shards:
                error = (f"offers {len(layout.rendezvous_ports)} rendezvous ports for "
                         f"{expected.train.parallel.shards} shard indices")
            if error:
                self.leave_out(node, error)
                continue
            candidates[node] = GroupInfo(node, partition, layout, str(info.get("fingerprint", "")),
                                         int(metrics.get("tokens", 0)), int(metrics.get("resumed_round", 0)),
                                         self.facility_of(partition, info), str(info.get("log_file", "")),
                                         str(info.get("model_digest", "")),
                                         [int(r) for r in metrics.get("param_rows", [])])
        return candidates

    def readmit(self, grid: Grid, server_round: int) -> list[int]:
        """Hello to the dropped groups whose node is online; those that pass it and match `catch_up_source` rejoin
        after the members (the round starts with a catch-up). Returns the rejoined nodes."""
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
        candidates = self._hello_round(grid, {n: self.groups[n].partition_id for n in nodes}, len(self.sampled),
                                       rejoin=True)
        joined = []
        for node, g in candidates.items():
            source = self.catch_up_source(g)
            refused = "no member to catch up from" if source is None else rejoin_refusal(self, g, self.groups[source])
            if refused:
                self.left_out[node] = f"rejoin refused: {refused}"
                log(ERROR, "group on node %d: %s", node, self.left_out[node])
                continue
            g.benched = self.groups[node].benched
            self.groups[node] = g
            self.dropped.discard(node)
            self.left_out.pop(node, None)
            self.members.append(node)
            joined.append(node)
        if joined:
            log(INFO, "round %d: group(s) on node(s) %s rejoin; the round starts with a catch-up", server_round,
                joined)
        return joined

    def leave_out(self, node: int, why: str) -> None:
        """Leave the group on `node` out of the run, logged."""
        self.left_out[node] = why
        log(ERROR, "group on node %d left out: %s", node, why)

    def catch_up_source(self, group: GroupInfo) -> int | None:
        """The member a rejoining group must match and catches up from: member 0."""
        return self.members[0] if self.members else None

    def facility_of(self, partition_id: int, hello_info: dict[str, Any]) -> str:
        """A group's facility: the node config's `facility`, else the run config's `facilities[partition_id]`."""
        return str(hello_info.get("facility", "")) or self.run.facility_of(partition_id)

    def drop(self, server_round: int, dropped: dict[int, str], *, rejoin: bool = True) -> None:
        """Take the groups of `dropped` (node -> why) out of the members, logged; `rejoin`: they may rejoin later."""
        for node, reason in dropped.items():
            if rejoin:
                self.dropped.add(node)
            self.left_out[node] = f"dropped in round {server_round}: {reason}"
            log(WARNING, "round %d: group on node %d dropped: %s", server_round, node, reason)
        self.members = [n for n in self.members if n not in dropped]

    def hold_at_fault(self, server_round: int, members: list[int], reports: dict[int, dict[str, Any]],
                      dropped: dict[int, str]) -> dict[int, str]:
        """The round's faults (node -> why, `fault_verdicts`), each a strike (`strike`)."""
        return reasons(self.strike(server_round, members, self.fault_verdicts(members, reports, dropped)))

    def fault_verdicts(self, members: list[int], reports: dict[int, dict[str, Any]],
                       dropped: dict[int, str]) -> list[Verdict]:
        """The members at fault (`Verdict.member`: the node): dropped, or named by more than half of the others'
        reports (`sync_blame`: absent at the rendezvous or failed its part of a sync; `sync_left_out`: left out of an
        adopted sync; member indices as in `members`), so a lone report cannot strike an honest group."""
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
        """Count a strike for each member with a verdict, reset the others'; `max-strikes` in a row leave a group out
        for `bench-rounds` rounds (twice as long each time), never below min-groups members. Returns `verdicts`."""
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

    def layouts(self) -> dict[str, str]:
        """Every known group's layout, "R x S" by node (groups may shard differently)."""
        return {str(n): f"{g.layout.replicas}x{g.layout.shards}" for n, g in sorted(self.groups.items())}

    def _keep_majority(self, candidates: dict[int, GroupInfo], key: Callable[[GroupInfo], Any],
                       reason: Callable[[GroupInfo, Any], str]) -> Any:
        """Leave out the candidates whose `key` differs from the most common value (logged); return that value."""
        common, _ = Counter(key(g) for g in candidates.values()).most_common(1)[0]
        for node, g in list(candidates.items()):
            if key(g) != common:
                self.leave_out(node, reason(g, common))
                del candidates[node]
        return common


def empty_shards(param_rows: list[int], shards: int) -> list[int]:
    """The shard indices of a group of S = `shards` that hold no row of any parameter."""
    return [s for s in range(shards) if all(shard_rows(rows, shards, s)[0] == shard_rows(rows, shards, s)[1]
                                            for rows in param_rows)]


def seat_refusal(group: Any, layouts: set[int]) -> str:
    """'' when every shard of `group` holds rows to sync with groups of S in `layouts`; else why not."""
    empty = empty_shards(group.param_rows, group.layout.shards)
    if not empty:
        return ""
    return (f"its S={group.layout.shards} leaves shard(s) {empty} without a row of any parameter: no sync plan of "
            f"groups of S={sorted(layouts)} can serve it; relaunch it with a smaller S")


def check_layouts(membership: Any, candidates: dict[int, Any]) -> None:
    """Leave out (logged) the candidates, which shard differently, whose model differs from the majority's and, on
    the decentralised path, those whose S no sync plan can serve."""
    membership._keep_majority(candidates, lambda g: g.model_digest, lambda g, common: (
        f"its model (parameter names, shapes and dtypes: digest {g.model_digest[:12]}) differs from the "
        f"majority's {common[:12]}: another model or dtype"))
    if membership.run.federation.aggregation == "server":
        return  # the server combines rows: any shard may be empty
    layouts = {g.layout.shards for g in candidates.values()}
    if len(layouts) < 2:
        return
    for node, g in list(candidates.items()):
        refused = seat_refusal(g, layouts)
        if refused:
            membership.left_out[node] = refused
            log(ERROR, "group on node %d left out: %s", node, refused)
            del candidates[node]


def rejoin_refusal(membership: Any, group: Any, source: Any) -> str:
    """'' when `group` may rejoin and catch up from member `source` (its fingerprint, or with another S its model
    and a sync plan with the members); else why not."""
    if group.layout.shards == source.layout.shards:
        if group.fingerprint != source.fingerprint:
            return f"fingerprint {group.fingerprint[:12]} != the members' {source.fingerprint[:12]}"
        return ""
    if group.model_digest != source.model_digest:
        return (f"its model (digest {group.model_digest[:12]}) differs from the members' ({source.model_digest[:12]}):"
                f" another model or dtype")
    if membership.run.federation.aggregation == "server":
        return ""
    layouts = {membership.groups[n].layout.shards for n in membership.members} | {group.layout.shards}
    return seat_refusal(group, layouts)
