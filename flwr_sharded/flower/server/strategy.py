"""DecentralizedFedAvg: Flower orchestrates rounds, the groups average their shards among themselves.

Every message carries a ConfigRecord only: the run's schema in the hellos, and per round each member's train message
(the members, member 0's rendezvous offer, a fresh prefix and secret, the round options), after which the member runs
K periods of A local steps with a shard sync after each. A strategy of one's own overrides `configure_train` (round
options: `flwr_sharded.flower.run_config.ROUND_KEYS`), `aggregate_train` or `select_members`, as in Flower.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable
from logging import ERROR, INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.supercore import log

from flwr_sharded.errors import ConfigError
from flwr_sharded.flower.messages import MSG_EVALUATE, MSG_FINISH, MSG_TRAIN, START_TIMEOUT_S, GroupLayout, TrainArgs
from flwr_sharded.flower.run_config import FlowerRun, RoundOptions
from flwr_sharded.flower.server import records
from flwr_sharded.flower.server.grid import (Polling, message, reply_payload, run_id, send_and_receive,
                                             train_and_collect)
from flwr_sharded.flower.server.membership import GroupInfo, GroupMembership
from flwr_sharded.run_dir import perplexity
from flwr_sharded.parallel.schedule import local_steps


def member_shards(groups: dict[int, Any], members: list[int]) -> list[int]:
    """Every member's S, in member order, when they shard differently; [] when they shard alike."""
    shards = [groups[n].layout.shards for n in members]
    return shards if len(set(shards)) > 1 else []


def member_sites(groups: dict[int, Any], members: list[int], parallel: Any) -> tuple[list[str], str]:
    """Every member's site (its facility), in member order, where the round reduces in two levels
    (`flwr_sharded.parallel.sites`); else [] and why not ('' where no facility is named)."""
    from flwr_sharded.parallel.sites import why_not_two_level
    from flwr_sharded.validation import outer_rule

    sites = [groups[n].facility for n in members]
    if not any(sites):
        return [], ""
    why = why_not_two_level(sites, len(members), alike=not member_shards(groups, members),
                            linear=outer_rule(parallel).linear, restart_residual=parallel.sync_restart == "residual",
                            term=("facility", "facilities"))
    return ([], why) if why else (sites, "")


def member_steps(groups: dict[int, Any], members: list[int], round_steps: int, group_steps: str) -> list[int]:
    """Every member's local steps per sync of a round of A = `round_steps` with `group-steps speed`, from its last
    round's step time (`pace.local_steps`); [] (every member A) with `equal`, before every member has a step time,
    or when all come out alike."""
    times = [groups[n].step_s for n in members]
    if group_steps != "speed" or len(members) < 2 or min(times) <= 0:
        return []
    steps = list(local_steps(round_steps, times))
    return steps if len(set(steps)) > 1 else []


class DecentralizedFedAvg(Strategy):
    """Decentralised FedAvg of sharded models: config-only messages, shard syncs between the groups.

    Args:
        run: the run's schema (validated before anything is sent; it travels in the hellos).
        run_dir: where round records, the summary and the final model go (`flwr_sharded.run_dir.RunDir`).
        rejoin: at the start of each round, offer groups dropped earlier to rejoin (with a catch-up).
        polling: how often the Grid is pulled and the nodes' liveness checked.
    """

    membership_class: type[GroupMembership] = GroupMembership

    def __init__(self, run: FlowerRun, *, run_dir: Any = None, rejoin: bool = True,
                 polling: Polling | None = None) -> None:
        self.run = run
        self.deadlines = run.deadlines
        self.run_dir = run_dir
        self.polling = polling or Polling()
        self.membership = self.membership_class(run, self.polling, rejoin=rejoin, save_dir=self.save_dir())
        self.history: list[dict[str, Any]] = []
        self.round_members: list[int] = []
        """This round's members (`select_members`)."""
        self.saved_model = ""
        """Where member 0 wrote the final model ('' if it did not)."""
        self._rejoined: list[int] = []
        self._repair = ""
        """Why the next round starts with a catch-up although nobody rejoined: the last one left groups diverged."""
        self._round_started = self._started = 0.0
        self._tokens_seen = 0

    # ----- Strategy interface ---------------------------------------------------------------------------------
    def summary(self) -> None:
        r, d, p, f = self.run, self.deadlines, self.run.train.parallel, self.run.federation
        log(INFO, "\t├── Groups: %s R=%d x S=%d (%d ranks each)%s; wait for %d, go on with >= %d", p.method,
            p.replicas, p.shards, r.group_world, f", facility-shards {f.facility_shards}" if f.facility_shards else "",
            d.num_groups, d.min_groups)
        log(INFO, "\t├── Per round: K=%d syncs x A=%d steps%s; %d rounds = %d steps; model %s, seq %d, batch %d",
            f.syncs_per_round, p.aggregate_every, " (the fastest group's: group-steps speed)" if
            p.group_steps == "speed" else "", f.rounds, r.total_steps, r.train.model.name, r.train.data.seq_len,
            r.train.batch_size)
        log(INFO, "\t├── Shard sync: %s; aggregation %s", p.describe_sync(), f.aggregation)
        log(INFO, "\t└── Deadlines: sample %.0f s, hello %.0f s, round %.0f s, rendezvous %.0f s, sync %.0f s",
            d.sample_timeout, d.hello_timeout, d.round_timeout, d.rendezvous_timeout, d.sync_timeout)

    def select_members(self, server_round: int) -> list[int]:
        """The members that train in `server_round` (default: every member); override to let some groups sit a
        round out. Member 0 of the result hosts the round's rendezvous."""
        return list(self.membership.members)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """One train message per member, with the round options in `config` (`RoundOptions`; other keys refused)."""
        members = self.round_members
        if self._repair:
            log(WARNING, "round %d starts with a catch-up from member 0: %s", server_round, self._repair)
        catch_up, self._repair = bool(self._rejoined or self._repair), ""
        return self.train_messages(server_round, members, self.membership.groups[members[0]].layout,
                                   f"run{run_id(grid)}/round{server_round}", RoundOptions.from_config(dict(config)),
                                   catch_up=catch_up, evaluate=self.run.federation.evaluate_in_train,
                                   checkpoint=self.run.checkpoint_due(server_round))

    def train_messages(self, server_round: int, members: list[int], offer: GroupLayout, prefix: str,
                       round_options: RoundOptions, *, catch_up: bool, evaluate: bool, checkpoint: bool,
                       export_first: bool = False) -> list[Message]:
        """The train messages of one set of members that sync among themselves (a round, or a facility)."""
        d, groups = self.deadlines, self.membership.groups
        secret = secrets.token_hex(32)  # the members' proof at the rendezvous; travels over Flower's TLS channel
        shards = member_shards(groups, members)
        sites, flat = member_sites(groups, members, self.run.train.parallel)
        if flat:
            log(INFO, "round %d: the flat ring (%s): %s", server_round, flat,
                ", ".join(f"{n}@{groups[n].facility or '-'}" for n in members))
        steps = member_steps(groups, members, round_options.for_run(self.run).aggregate_every,
                             self.run.train.parallel.group_steps)
        out = []
        for i, node in enumerate(members):
            args = TrainArgs(server_round=server_round, job=f"{prefix}/{node}", members=[str(m) for m in members],
                             member_index=i, rendezvous_host=offer.rendezvous_host,
                             rendezvous_ports=list(offer.rendezvous_ports), prefix=prefix,
                             rendezvous_timeout=d.rendezvous_timeout, sync_timeout=d.sync_timeout, secret=secret,
                             evaluate=evaluate, checkpoint=checkpoint, export=export_first and i == 0,
                             catch_up=catch_up, member_shards=shards, member_steps=steps, member_sites=sites,
                             round=round_options)
            out.append(message(node, MSG_TRAIN, {**args.to_config(), "timeout": START_TIMEOUT_S}, str(server_round),
                               d.round_timeout))
        return out

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Token-weighted metrics of the groups that trained (the collect replies); decide who stays."""
        by_node = {m.metadata.src_node_id: m for m in replies}
        ok: dict[int, dict[str, Any]] = {}
        rolled_back: dict[int, dict[str, Any]] = {}
        dropped: dict[int, str] = {}
        for node in self.round_members:
            metrics, error = reply_payload(by_node.get(node))
            if error:
                dropped[node] = error
            elif metrics.get("sync_failed"):
                rolled_back[node] = metrics
            else:
                ok[node] = metrics
        alive = {**ok, **rolled_back}
        membership = self.membership
        record = records.round_record(server_round, self.round_members, ok, rolled_back, dropped,
                                      time.monotonic() - self._round_started, self.run.group_world, self._rejoined,
                                      layouts=membership.layouts())
        records.note_checkpoint_errors(server_round, alive, record)
        membership.drop(server_round, dropped)
        if rolled_back:
            log(WARNING, "round %d: sync failed; %d surviving group(s) restored their last synced shards; the next "
                "round re-forms with %d member(s)", server_round, len(rolled_back), len(alive))
        elif dropped:
            log(WARNING, "round %d: %d group(s) dropped; the next round goes on with %d member(s)", server_round,
                len(dropped), len(alive))
        record["at_fault"] = {str(n): why for n, why in
                              membership.hold_at_fault(server_round, self.round_members, alive, dropped).items()}
        if ok and rolled_back or (record["syncs"] and not record["checksums_equal"]):
            self._repair = (f"round {server_round} left the groups with different shards (the sync was adopted by "
                            f"{sorted(ok)}, rolled back by {sorted(rolled_back)})")
        for node, metrics in alive.items():
            membership.groups[node].tokens = int(metrics.get("total_tokens", 0))
            if metrics.get("steps"):
                membership.groups[node].step_s = float(metrics.get("train_s", 0.0)) / int(metrics["steps"])
        self.history.append(record)  # written and logged by run_round once the round is complete
        return None, MetricRecord({k: v for k, v in record.items() if isinstance(v, (int, float))
                                   and not isinstance(v, bool)} | {"losses": record["losses"] or [0.0]})

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        if self.run.federation.evaluate_in_train:
            return []
        timeout = self.deadlines.round_timeout
        return [message(n, MSG_EVALUATE, {"timeout": max(1.0, timeout - 5.0)}, f"eval{server_round}", timeout)
                for n in self.membership.members]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        losses = []
        for reply in replies:
            metrics, error = reply_payload(reply)
            if not error and "eval_loss" in metrics:
                losses.append(float(metrics["eval_loss"]))
        if not losses:
            return None
        loss = sum(losses) / len(losses)
        if self.history and self.history[-1]["round"] == server_round:
            self.history[-1].update(eval_loss=loss, eval_ppl=perplexity(loss))
        log(INFO, "round %d: eval loss %.4f ppl %.2f (%d groups)", server_round, loss, perplexity(loss), len(losses))
        return MetricRecord({"eval_loss": loss, "eval_ppl": perplexity(loss)})

    # ----- the run ----------------------------------------------------------------------------------------------
    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int | None = None,
              timeout: float | None = None, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Run hello, `num_rounds` (default: the run's) rounds and finish; returns Flower's Result. `timeout`
        replaces the round deadline, `train_config` holds round options for every round; the model never reaches the
        server, so `initial_arrays`, `evaluate_fn` and `evaluate_config` are refused."""
        refused = [name for name, value in (("initial_arrays", initial_arrays), ("evaluate_fn", evaluate_fn))
                   if value is not None] + (["evaluate_config"] if evaluate_config else [])
        try:
            if refused:
                raise ConfigError(f"{type(self).__name__}.start: {', '.join(refused)} not supported: the model "
                                  f"never reaches the server (groups start from the run's model and evaluate "
                                  f"themselves)")
            if timeout is not None:
                self.deadlines.round_timeout = float(timeout)
            self.run.validate()
            rounds = int(num_rounds or self.run.federation.rounds)
            if rounds > self.run.federation.rounds:
                raise ConfigError(f"num_rounds {rounds} exceeds the run's 'num-server-rounds' "
                                  f"{self.run.federation.rounds} (the learning-rate schedule spans rounds x K x A "
                                  f"steps)")
            RoundOptions.from_config(dict(train_config or {}))
        except ConfigError as exc:
            log(ERROR, "%s", exc)
            raise
        log(INFO, "Starting %s:", type(self).__name__)
        self.summary()
        result = Result()
        self._started = time.monotonic()
        membership = self.membership
        try:
            membership.sample(grid)
            membership.hello(grid)
            if membership.resumed_round:
                log(INFO, "resuming after round %d of %d", membership.resumed_round, rounds)
            for server_round in range(membership.resumed_round + 1, rounds + 1):
                self._rejoined = membership.readmit(grid, server_round)
                if len(membership.members) < self.deadlines.min_groups:
                    raise RuntimeError(f"only {len(membership.members)} group(s) left, fewer than min-groups "
                                       f"{self.deadlines.min_groups}: stopping before round {server_round}")
                self.round_members = self.select_members(server_round)
                log(INFO, "")
                log(INFO, "[ROUND %d/%d] %d group(s): nodes %s", server_round, rounds, len(self.round_members),
                    self.round_members)
                self.run_round(grid, server_round, result, train_config)
            summary = records.summary(self.history, time.monotonic() - self._started, membership.members,
                                      membership.left_out, layouts=membership.layouts())
            if summary is not None:
                self.history.append(summary)
                records.log_summary(summary, self.history)
        finally:
            self.finish(grid)
        return result

    def run_round(self, grid: Grid, server_round: int, result: Result, train_config: ConfigRecord | None) -> None:
        """Train (K syncs among the groups), aggregate the metrics, evaluate; results go into `result`."""
        self._round_started = time.monotonic()
        config = ConfigRecord(dict(train_config or {}))
        messages = list(self.configure_train(server_round, ArrayRecord(), config, grid))
        d = self.deadlines
        replies = train_and_collect(grid, messages, round_timeout=d.round_timeout,
                                    collect_interval=d.collect_interval, polling=self.polling)
        _, metrics = self.aggregate_train(server_round, replies)
        if metrics is not None:
            result.train_metrics_clientapp[server_round] = metrics
        self.after_train(grid, server_round, replies, RoundOptions.from_config(dict(config)))
        self.evaluate_round(grid, server_round, result)
        self.publish_round()

    def after_train(self, grid: Grid, server_round: int, replies: list[Message], round_options: RoundOptions) -> None:
        """The server's part of a round once its results are aggregated: none, the groups synced among themselves."""

    def evaluate_round(self, grid: Grid, server_round: int, result: Result) -> None:
        """Separate evaluate messages, or the evaluation that came with the round's replies."""
        evaluate = list(self.configure_evaluate(server_round, ArrayRecord(), ConfigRecord(), grid))
        if evaluate:
            eval_metrics = self.aggregate_evaluate(
                server_round, send_and_receive(grid, evaluate, self.deadlines.round_timeout, self.polling))
            if eval_metrics is not None:
                result.evaluate_metrics_clientapp[server_round] = eval_metrics
        elif self.history and "eval_loss" in self.history[-1]:
            h = self.history[-1]
            result.evaluate_metrics_clientapp[server_round] = MetricRecord(
                {"eval_loss": h["eval_loss"], "eval_ppl": h["eval_ppl"]})

    def publish_round(self) -> None:
        """Stamp, write and log the round's record (the last in `history`)."""
        if self.history and self.history[-1].get("kind") == "round":
            record = self.history[-1]
            self._tokens_seen += int(record["tokens"])
            record.update(elapsed_s=time.monotonic() - self._started, tokens_seen=self._tokens_seen)
            if self.run_dir is not None:
                self.run_dir.log(record)
            records.log_round(record)

    def finish(self, grid: Grid) -> None:
        """Tell every sampled node the run is over (bounded); a launched group is shut down, member 0 saves."""
        nodes, members = self.membership.sampled, self.membership.members
        if not nodes:
            return
        try:
            online = set(grid.get_node_ids())
        except Exception:  # noqa: BLE001 - best effort at the end of the run
            online = set(nodes)
        d = self.deadlines
        messages = [message(n, MSG_FINISH, {
            "save-dir": self.save_dir() if members and n == members[0] else "",
            "stop-group": self.run.federation.stop_groups, "timeout": max(1.0, d.finish_timeout - 5.0)}, "finish",
            d.finish_timeout) for n in nodes if n in online]
        if not messages:
            return
        replies = [reply_payload(r)[0] for r in send_and_receive(grid, messages, d.finish_timeout, self.polling)]
        saved = [str(r["saved"]) for r in replies if r.get("saved")]
        self.saved_model = saved[0] if saved else ""
        log(INFO, "finish: %d of %d node(s) answered (%d group(s) shut down)%s", len(replies), len(messages),
            sum(1 for r in replies if r.get("stopped")), f"; model saved to {saved[0]}" if saved else "")

    def save_dir(self) -> str:
        """Where member 0 writes the final model ('' for nowhere)."""
        return str(self.run_dir.model_dir) if self.run_dir is not None and self.run.train.output.save_model else ""


__all__ = ["DecentralizedFedAvg", "GroupInfo"]
