"""The schema of a Flower run (`FlowerRun`): one group's training, how the groups federate and every wait, validated
by the ServerApp and sent once, in each group's hello. Its flat option names are the app's run-config keys, from
which `[tool.flwr.app.config]` of `apps/llama_fl_hsdp/pyproject.toml` is generated (`python -m
flwr_sharded.flower.run_config --write PYPROJECT`); what a strategy may change per round is `RoundOptions`.
Torch-free.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
import textwrap
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

from flwr_sharded import schema
from flwr_sharded.config import METHODS, QUANTIZED, OptimConfig, ParallelConfig, TrainConfig
from flwr_sharded.validation import outer_rule, validate
from flwr_sharded.errors import ConfigError
from flwr_sharded.parallel.rules import LINEAR_RULES
from flwr_sharded.schema import Surface, option, same_as

Aggregation = Literal["decentralized", "server"]
AGGREGATIONS: tuple[str, ...] = typing.get_args(Aggregation)
ServerRule = Literal["mean", "median", "trimmed-mean"]
RUN_CONFIG = Surface(lambda o: f"'{o.name}'", "run config ")
"""Errors name run-config keys as typed in `flwr run --run-config 'key=value'`."""


@dataclass
class FederationConfig:
    """How a Flower run federates its groups (each Flower client is one FSDP/HSDP group)."""

    rounds: int = option(3, ge=1, name="num-server-rounds")
    """N: Flower rounds; the learning-rate schedule spans N x K x A steps."""
    syncs_per_round: int = option(4, ge=1)
    """K: shard syncs per Flower round; one round is K x A local steps."""
    aggregation: Aggregation = "decentralized"
    """decentralized (groups all-reduce shards among themselves; no arrays through the server) or server (through
    the Flower server, for groups that share no network; groups of one facility still all-reduce)."""
    facilities: str | None = None
    """Server path: the facility of each group by partition id, comma-separated (e.g. "a,a,b,b"); a SuperNode's node
    config `facility` overrides it; unset: every group is a facility of its own. Decentralised path: names the groups
    `facility-shards` gives their own S, and the sites of a round's sync: where every facility holds as many of the
    round's members (two or more each, at two or more facilities) and they shard alike, the sync reduces inside each
    facility first and crosses between facilities once, each member carrying its share (`--sync-sites` of the static
    engine); otherwise (a round that lost a member, one facility) the flat ring over every member, said in the log."""
    facility_shards: str | None = None
    """S of the groups of some facilities, e.g. "b=1" (the others use `shards`); the server combines their rows
    (server path), or the groups average their overlapping pieces (decentralised path). Needs partition iid-groups
    or document."""
    server_buffer_mb: float = option(128.0, gt=0)
    """Server path: the largest chunk of global rows, in MiB of fp32 (chunks are also at most the larger of a
    sixteenth of the model and 8 MiB); each chunk costs one message per group."""
    server_rule: ServerRule = "mean"
    """Server path: how the server combines the facilities' models: mean (token-weighted), or the coordinate-wise
    median or trimmed-mean (unweighted, robust to a minority of outliers; chunks F times smaller)."""
    server_trim: int = option(1, ge=1)
    """Server path, trimmed-mean: facilities dropped from each side of every coordinate (a count, as the outer rule
    trimmed-mean's); a round needs more than twice this many facilities."""
    server_outlier_ratio: float = option(100.0, ge=0)
    """Server path: a facility whose largest |value| in a chunk is above this many times max(1, the median of the
    facilities' largest |values| there) is left out of the round; 0: off (an overflow is refused anyway)."""
    max_strikes: int = option(3, ge=0)
    """Decentralised path: a group at fault in this many consecutive rounds (dropped, or named by more than half of
    the others as absent at the rendezvous, failing its part of a sync or left out of one) sits out `bench-rounds`
    rounds, then may rejoin with a catch-up (each later bench twice as long); never below min-groups; 0: never."""
    bench_rounds: int = option(4, ge=1)
    """Decentralised path: rounds a group left out by `max-strikes` sits out the first time."""
    checkpoint_rounds: int = option(1, ge=1)
    """With checkpoint-dir: each group checkpoints after every N-th round (and after the last one)."""
    evaluate_in_train: bool = True
    """Evaluate held-out perplexity at the end of each train message (no extra message round trip); off sends
    separate evaluate messages."""
    stop_groups: bool = False
    """Deployment: also shut the (externally started) groups down at the end of the run."""
    strategy: str | None = None
    """The ServerApp's strategy, `package.module:Class`, a DecentralizedFedAvg subclass in the app's package (e.g.
    llama_fl_hsdp.strategies.fedprox:FedProxShards; elsewhere: FLWR_SHARDED_ALLOWED_IMPORTS where the SuperLink
    runs); unset: DecentralizedFedAvg, or ServerShardFedAvg with aggregation server."""


@dataclass(frozen=True)
class RoundOptions:
    """What a strategy may set for one round in its train config (`configure_train`; any other key is refused), each
    the run option of the same name (unset: the run's value); they travel in that round's train messages."""

    aggregate_every: int | None = same_as(ParallelConfig, "aggregate_every", default=None)
    """A of this round."""
    syncs_per_round: int | None = same_as(FederationConfig, "syncs_per_round", default=None)
    """K of this round."""
    lr: float | None = same_as(OptimConfig, "lr", default=None)
    """The inner optimizer's peak learning rate from this round on (the schedule's shape is kept)."""
    proximal_mu: float | None = same_as(OptimConfig, "proximal_mu", default=None)
    """FedProx's mu of this round."""

    @classmethod
    def from_config(cls, config: Mapping[str, Any], surface: Surface = RUN_CONFIG) -> RoundOptions:
        """The round options in a train config (keys with '-'), each checked as the run option it is; ConfigError
        naming any other key."""
        options = schema.by_name(cls)
        values = {}
        for key, value in config.items():
            if key not in ROUND_KEYS:
                raise surface.error(f"train config key '{key}' is not a round option; a strategy may set "
                                    f"{', '.join(ROUND_KEYS)}")
            values[options[key].path[-1]] = options[key].check(value, surface)
        return cls(**values)

    def to_config(self) -> dict[str, Any]:
        """The options set, as train-config keys."""
        return {o.name: getattr(self, o.path[-1]) for o in schema.options(type(self))
                if getattr(self, o.path[-1]) is not None}

    def for_run(self, run: FlowerRun) -> RoundOptions:
        """Every option of this round: those set, else the run's own."""
        t, own = run.train, {"aggregate_every": run.train.parallel.aggregate_every,
                             "syncs_per_round": run.federation.syncs_per_round}
        own.update(lr=t.optim.lr, proximal_mu=t.optim.proximal_mu)
        return RoundOptions(**{k: v if getattr(self, k) is None else getattr(self, k) for k, v in own.items()})


ROUND_KEYS: tuple[str, ...] = tuple(o.name for o in schema.options(RoundOptions))
"""The train-config keys of `RoundOptions`."""


@dataclass
class Deadlines:
    """How long the ServerApp waits for each step, and how many groups it needs; every wait is bounded."""

    num_groups: int = option(2, ge=0)
    """Groups to wait for before starting (simulation: the number of SuperNodes); 0: whatever is connected when
    sample-timeout expires."""
    min_groups: int = option(1, ge=1)
    """Fewest groups the run goes on with; below it the run stops with an error."""
    sample_timeout: float = option(120.0, gt=0)
    """Seconds to wait for num-groups nodes to connect."""
    hello_timeout: float = option(300.0, gt=0)
    """Seconds for the hello round (in simulation it includes launching the groups and building the models)."""
    round_timeout: float = option(900.0, gt=0)
    """Seconds one training round may take, all K syncs included."""
    rendezvous_timeout: float = option(60.0, gt=0)
    """Seconds a group waits at a sync's rendezvous for the other members (covers their speed differences)."""
    sync_timeout: float = option(120.0, gt=0)
    """Timeout of each cross-group collective, in seconds."""
    collect_interval: float = option(20.0, gt=0)
    """Seconds a collect message waits for a round's result before the ServerApp sends another; it bounds how long
    the news that a member is gone waits behind it (a SuperNode handles one message at a time)."""
    finish_timeout: float = option(60.0, gt=0)
    """Seconds for the finish messages at the end."""
    group_idle_timeout: float = option(1800.0, ge=0)
    """A group drops the run (freeing its memory; a simulation's exits) after this many seconds without an
    instruction (its ServerApp is gone); 0: never. Must exceed round-timeout + hello-timeout."""


def _train_defaults() -> TrainConfig:
    """A Flower run's training defaults: each group 2 ranks of the tiny model, sized for a CPU laptop."""
    cfg = TrainConfig()
    cfg.parallel.shards = 2
    cfg.parallel.aggregate_every = 25
    cfg.model.name = "tiny"
    cfg.data.seq_len = 64
    cfg.data.eval_blocks = 16
    cfg.optim.lr = 3e-3
    cfg.batch_size = 4
    return cfg


@dataclass
class FlowerRun:
    """A whole Flower run: one group's training, the federation and the deadlines."""

    train: TrainConfig = field(default_factory=_train_defaults)
    """The training settings of each group (one federation group: `federations` is 1)."""
    federation: FederationConfig = field(default_factory=FederationConfig)
    """Rounds, syncs per round, the aggregation path and its facilities."""
    deadlines: Deadlines = field(default_factory=Deadlines)
    """Every wait of the ServerApp and the groups."""

    # ----- sources --------------------------------------------------------------------------------------------
    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> FlowerRun:
        """The run described by a Flower run config (flat keys; "" leaves an optional key unset); ConfigError for
        an unknown key or a value of the wrong type."""
        if isinstance(run_config.get("method"), str):
            _check_method(run_config["method"])
        return schema.from_flat(cls(), run_config, RUN_CONFIG)

    def to_json(self) -> str:
        return json.dumps(schema.to_nested(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> FlowerRun:
        return schema.from_nested(cls, json.loads(text), Surface(RUN_CONFIG.label, "run "))

    # ----- derived values -------------------------------------------------------------------------------------
    @property
    def group_world(self) -> int:
        p = self.train.parallel
        return p.replicas * p.shards

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole run: rounds x K x A (the span of the learning-rate schedule)."""
        f = self.federation
        return f.rounds * f.syncs_per_round * self.train.parallel.aggregate_every

    def checkpoint_due(self, server_round: int) -> bool:
        """Whether the groups checkpoint at the end of this round."""
        return bool(self.train.checkpoint.dir) and (server_round % self.federation.checkpoint_rounds == 0
                                                    or server_round == self.federation.rounds)

    def known_facilities(self) -> int | None:
        """How many facilities the run config makes of `num-groups` groups (None when num-groups is 0); a node
        config's `facility` may regroup them."""
        n = self.deadlines.num_groups
        if not n:
            return None
        return len({self.facility_or_own(i) for i in range(n)})

    def shards_by_facility(self) -> dict[str, int]:
        """`facility_shards` as a dict; ValueError if malformed."""
        out: dict[str, int] = {}
        for item in filter(None, (x.strip() for x in (self.federation.facility_shards or "").split(","))):
            name, sep, value = item.partition("=")
            if not sep or not name.strip() or not re.fullmatch(r"\s*\d+\s*", value) or int(value) < 1:
                raise ValueError(item)
            out[name.strip()] = int(value)
        return out

    def facility_of(self, partition_id: int) -> str:
        """The facility named for a partition id by `facilities` ('' when not named there)."""
        text = self.federation.facilities
        names = [f.strip() for f in text.split(",")] if text else []
        return names[partition_id] if 0 <= partition_id < len(names) else ""

    def facility_or_own(self, partition_id: int) -> str:
        """`facility_of`, else a facility of the group alone."""
        return self.facility_of(partition_id) or f"partition-{partition_id}"

    @property
    def takes_own_shards(self) -> bool:
        """Whether a group may run its own S, whatever `shards` and `facility-shards` give it: on the decentralised
        path, with a partition that keeps groups of different sizes disjoint (iid-groups, document); its shards
        are then averaged piece by piece with the others' (`flwr_sharded.flower.group.channels`)."""
        return self.federation.aggregation == "decentralized" and self.train.data.partition != "iid"

    def for_group(self, partition_id: int, node_facility: str = "", own_shards: int | None = None) -> FlowerRun:
        """This run with S set for the group of `partition_id` (its facility: the node config's, else the run
        config's `facilities`); `own_shards`: the S the group runs, which stands where `takes_own_shards`."""
        facility = node_facility or self.facility_of(partition_id)
        shards = self.shards_by_facility().get(facility, self.train.parallel.shards)
        if own_shards is not None and self.takes_own_shards:
            shards = own_shards
        if shards == self.train.parallel.shards:
            return self
        out = copy.deepcopy(self)
        out.train.parallel.shards = shards
        return out

    def group_config(self) -> TrainConfig:
        """The TrainConfig of one federation group of this run (call on `for_group`'s result)."""
        cfg = copy.deepcopy(self.train)
        cfg.parallel.federations = 1
        cfg.steps = self.total_steps
        cfg.eval_every = 0
        out = cfg.output  # the run directory is the ServerApp's; groups log to their own logs
        out.run_dir, out.tensorboard, out.wandb_project, out.save_model, out.progress = None, False, None, False, False
        return cfg

    # ----- checks ---------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Check the whole run without touching files; raises ConfigError naming the run-config key."""
        S = RUN_CONFIG
        L = lambda name: S.label(schema.by_name(FlowerRun)[name])  # noqa: E731
        for o in schema.options(FlowerRun):
            o.check(schema.get(self, o.path), S)
        p, f, d = self.train.parallel, self.federation, self.deadlines
        _check_method(p.method)
        if f.facilities is not None and any(not x.strip() for x in f.facilities.split(",")):
            raise S.error(f"{L('facilities')} must be comma-separated non-empty names, one per partition id (e.g. "
                          f"\"a,a,b,b\"); got {f.facilities!r}")
        try:
            by_facility = self.shards_by_facility()
        except ValueError:
            raise S.error(f"{L('facility-shards')} must be comma-separated facility=S pairs with S >= 1 (e.g. "
                          f"\"b=1\"); got {f.facility_shards!r}") from None
        if by_facility and self.train.data.partition == "iid":
            raise S.error(f"{L('facility-shards')}: with groups of different sizes, {L('partition')} \"iid\" would "
                          f"give some blocks to two groups; use \"iid-groups\" or \"document\"")
        if f.server_rule != "mean" and f.aggregation != "server":
            raise S.error(f"{L('server-rule')} {f.server_rule!r} combines facilities at the server; set "
                          f"{L('aggregation')} = \"server\" or leave it at \"mean\"")
        known = self.known_facilities()
        if f.server_rule == "trimmed-mean" and known is not None and known <= 2 * f.server_trim:
            raise S.error(f"{L('server-rule')} \"trimmed-mean\" with {L('server-trim')} {f.server_trim} needs more "
                          f"than {2 * f.server_trim} facilities; this run has {known} ({L('num-groups')} "
                          f"{d.num_groups}{', ' + L('facilities') if f.facilities else ''}); use \"median\" or a "
                          f"smaller trim")
        if d.num_groups and d.min_groups > d.num_groups:
            raise S.error(f"{L('min-groups')} ({d.min_groups}) must not exceed {L('num-groups')} ({d.num_groups})")
        if d.group_idle_timeout and d.group_idle_timeout <= d.round_timeout + d.hello_timeout:
            raise S.error(f"{L('group-idle-timeout')} ({d.group_idle_timeout:g} s) must exceed {L('round-timeout')} + "
                          f"{L('hello-timeout')} ({d.round_timeout + d.hello_timeout:g} s): a group waits that long "
                          f"between two instructions of a live run (0: never drop the run)")
        for key in ("rendezvous-timeout", "sync-timeout"):
            if getattr(d, key.replace("-", "_")) >= d.round_timeout:
                raise S.error(f"{L(key)} must be below {L('round-timeout')} ({d.round_timeout:g} s): a round's K "
                              f"syncs must fit in it")
        validate(self.group_config(), surface=S)
        decentralized_only = [k for k, on in (("group-steps", p.group_steps != "equal"), ("sync-delay", p.sync_delay),
                                              ("sync-fragments", p.sync_fragments > 1),
                                              ("sync-dtype", p.sync_dtype in QUANTIZED),
                                              ("sync-topk", p.sync_topk is not None)) if on]
        if f.aggregation == "server" and decentralized_only:
            raise S.error(f"{', '.join(L(k) for k in decentralized_only)} applies to the decentralized all-reduce; "
                          f"{L('aggregation')} \"server\" sends whole shards through the Flower server once per "
                          f"round (use aggregation \"decentralized\", or the defaults)")
        if f.aggregation == "server" and not outer_rule(p, S).linear:
            raise S.error(f"{L('outer')} {p.outer!r} needs every member's shards at once, but {L('aggregation')} "
                          f"\"server\" streams a weighted mean; use a linear rule "
                          f"({', '.join(LINEAR_RULES)}) or aggregation \"decentralized\"; the server's own "
                          f"robust rules are {L('server-rule')} "
                          f"{' or '.join(repr(r) for r in typing.get_args(ServerRule) if r != 'mean')}")

    def check_sources(self, *, local: bool) -> None:
        """The model and data checks each group makes at hello, as far as they can run here, before any group is
        launched. `local` (a simulation: the groups run on this machine, with its files and caches): all of them
        (`flwr_sharded.training.preflight.check_model_and_data`); else (deployment: the nodes hold the data and
        the model's files) only that a model name without '/' is a preset. ConfigError naming the run-config key."""
        from flwr_sharded.config import respelled
        from flwr_sharded.training.models import check_model_name

        cfg = self.group_config()
        try:
            if local:
                from flwr_sharded.training.preflight import check_model_and_data

                check_model_and_data(cfg)
            elif "/" not in cfg.model.name:
                check_model_name(cfg.model.name)
        except ConfigError as exc:
            raise respelled(exc, RUN_CONFIG) from None


def _check_method(method: str) -> None:
    """ConfigError unless `method` is a federated one (each Flower client is one federation group)."""
    methods = [m for m in METHODS if m.startswith("fl-")]
    if method not in methods:
        raise RUN_CONFIG.error(f"'method' must be one of {', '.join(methods)} (each Flower client is one federation "
                               f"group); got {method!r}")


# -------------------------------------------------------------------------------------------- the app's config

def app_config_toml(run: FlowerRun | None = None) -> str:
    """The `[tool.flwr.app.config]` table of the app: every run-config key with its default, under its summary."""
    run = run or FlowerRun()
    lines = ["[tool.flwr.app.config]"]
    section = None
    for o in schema.options(run):
        if not o.flat:
            continue
        if o.path[:-1] != section:
            section = o.path[:-1]
            lines += ["", f"# ----- {'.'.join(section)}"]
        unset = " (empty: unset)" if o.optional and "unset" not in o.summary else ""
        lines += textwrap.wrap(f"{o.summary}{unset}", width=118, initial_indent="# ", subsequent_indent="# ",
                               break_on_hyphens=False)
        value = schema.get(run, o.path)
        lines.append(f"{o.name} = " + ('""' if value is None else json.dumps(value)))  # JSON values are TOML
    return "\n".join(lines) + "\n"


BEGIN = "# >>> generated by `python -m flwr_sharded.flower.run_config --write`: edit flwr_sharded/flower/run_config.py"
END = "# <<<"


def write_app_config(pyproject: str | Path) -> bool:
    """Replace the generated block of an app's pyproject.toml; returns whether it changed."""
    path = Path(pyproject)
    text = path.read_text()
    start, stop = text.index(BEGIN), text.index(END)
    new = text[:start] + BEGIN + "\n" + app_config_toml() + text[stop:]
    if new != text:
        path.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flwr_sharded.flower.run_config",
                                     description="Print or write the app's [tool.flwr.app.config], generated from "
                                                 "the FlowerRun schema.")
    parser.add_argument("--write", metavar="PYPROJECT", help="rewrite the generated block of this pyproject.toml")
    args = parser.parse_args(argv)
    if args.write:
        print(f"{args.write}: {'updated' if write_app_config(args.write) else 'up to date'}")
    else:
        sys.stdout.write(app_config_toml())
    return 0


if __name__ == "__main__":
    sys.exit(main())
