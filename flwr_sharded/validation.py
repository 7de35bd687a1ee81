"""The checks that span several options of a run configuration (`flwr_sharded.config`), run by `validate` before any
process group, model or file is touched; each message names the options as the surface spells them."""

from __future__ import annotations

import re
from typing import Any

from flwr_sharded import schema
from flwr_sharded.config import ParallelConfig, TrainConfig, label_of, labeler
from flwr_sharded.errors import ConfigError
from flwr_sharded.parallel.rules import LINEAR_RULES, RULES, make_rule, rule_options
from flwr_sharded.parallel.wire import QUANTIZED
from flwr_sharded.schema import CLI, Surface


def outer_rule(p: ParallelConfig, surface: Surface = CLI):
    """The shard rule the sync applies (`flwr_sharded.parallel.rules`); ConfigError for a bad name, or an option a
    built-in rule does not take (custom rules check their own keyword arguments)."""
    options = {k: v for k, v in (("lr", p.outer_lr), ("momentum", p.outer_momentum)) if v is not None}
    outer = label_of(surface, "outer")
    if p.outer in RULES:
        takes = {name: set(rule_options(cls)) for name, cls in RULES.items()}
        for key in options:
            if key not in takes[p.outer]:
                users = [name for name, fields in takes.items() if key in fields]
                raise surface.error(f"{label_of(surface, f'outer-{key}')} does not apply to {outer} {p.outer}; only "
                                    f"{', '.join(users)} take it")
    try:
        return make_rule(p.outer, **options)
    except ConfigError as exc:
        raise surface.error(f"{outer} {exc}") from None


def validate_parallel(p: ParallelConfig, world_size: int | None = None, surface: Surface = CLI) -> None:
    """Check the layout against the method and (when known) the launched world size."""
    L = labeler(surface)
    for o in schema.options(ParallelConfig):
        o.check(getattr(p, o.path[-1]), surface)
    if not p.federated and p.federations != 1:
        raise surface.error(f"{L('method')} {p.method} trains one model: {L('federations')} must be 1 (got "
                            f"{p.federations}); use fl-{p.method} to federate {p.federations} groups")
    if p.method in ("fsdp", "fl-fsdp") and p.replicas != 1:
        hybrid = "hsdp" if p.method == "fsdp" else "fl-hsdp"
        raise surface.error(f"{L('method')} {p.method} has no replication: {L('replicas')} must be 1 (got "
                            f"{p.replicas}); use {hybrid} for R > 1")
    if p.group_shards:
        validate_group_shards(p, surface)
    if p.group_steps != "equal":
        validate_group_steps(p, surface)
    rule = outer_rule(p, surface)
    if p.sync_dtype != "float32" and not rule.linear:
        raise surface.error(f"{L('sync-dtype')} {p.sync_dtype} sends one delta per group through an all-reduce, "
                            f"but {L('outer')} {p.outer} needs every member's shards; use {L('sync-dtype')} float32 "
                            f"or a linear rule")
    validate_sync(p, rule, surface)
    if p.sync_sites:
        validate_sites(p, rule, surface)
    if world_size is not None and world_size != p.world_size:
        raise surface.error(f"world size {world_size} != {p.describe_layout()}; launch {p.world_size} processes or "
                            f"change {L('federations')}/{L('replicas')}/{L('shards')}/{L('group-shards')}")


def validate_group_shards(p: ParallelConfig, surface: Surface = CLI) -> None:
    """`group-shards`: a list of at least two positive integers, for an FL method, with F unset or equal to its
    length and S unset; F is then set to its length."""
    L = labeler(surface)
    entries = p.group_shards.split(",")
    if not all(re.fullmatch(r"\d+", e.strip()) and int(e) >= 1 for e in entries) or len(entries) < 2:
        raise surface.error(f"{L('group-shards')} is a comma-separated list of at least two sharding degrees >= 1, "
                            f"one per federation group (e.g. 2,4), got {p.group_shards!r}")
    if not p.federated:
        raise surface.error(f"{L('group-shards')} federates groups: it needs an FL method (fl-fsdp, fl-hsdp), not "
                            f"{L('method')} {p.method}")
    if p.federations not in (1, len(entries)):
        raise surface.error(f"{L('group-shards')} {p.group_shards} makes {len(entries)} federation groups, but "
                            f"{L('federations')} is {p.federations}; leave {L('federations')} out")
    if p.shards != 1:
        raise surface.error(f"{L('group-shards')} gives each group its S: leave {L('shards')} out (got "
                            f"{p.shards})")
    p.group_shards = ",".join(str(int(e)) for e in entries)
    p.federations = len(entries)


def validate_group_steps(p: ParallelConfig, surface: Surface = CLI) -> None:
    """`group-steps speed`: an FL method with one blocking fragment and a rule that weighs members by their tokens."""
    L = labeler(surface)
    what = f"{L('group-steps')} {p.group_steps}"
    if not p.federated or not p.sync:
        raise surface.error(f"{what} sets each federation group's local steps per sync: it needs an FL method with "
                            f"its sync on (fl-fsdp, fl-hsdp)")
    if p.sync_fragments != 1 or p.sync_delay != 0:
        raise surface.error(f"{what} changes each group's period, which {L('sync-fragments')} and {L('sync-delay')} "
                            f"cut at fixed steps: use one fragment and no delay (got {p.sync_fragments} and "
                            f"{p.sync_delay})")
    if p.outer in ("trimmed-mean", "median"):
        raise surface.error(f"{what} gives groups different numbers of steps, but {L('outer')} {p.outer} ignores the "
                            f"weights (tokens) and counts every group alike, as if they trained the same steps; use a "
                            f"weighted rule ({', '.join(LINEAR_RULES)})")


def validate_sync(p: ParallelConfig, rule: Any, surface: Surface = CLI) -> None:
    """Check the shard sync's wire, fragments and overlap against each other and the outer rule."""
    from flwr_sharded.parallel.schedule import Schedule

    L = labeler(surface)
    defaults = ParallelConfig()  # an option off (even spelled out) shapes nothing
    sparse = ("sync-topk-merge", "sync-error-decay", "sync-dense-warmup", "sync-dense-flush", "sync-restart")
    streaming = [name for name in ("sync-fragments", "sync-delay", "sync-alpha", "sync-carry", "sync-error-feedback",
                                   "sync-topk", *sparse)
                 if getattr(p, name.replace("-", "_")) not in (getattr(defaults, name.replace("-", "_")), False)]
    if streaming and not p.federated:
        raise surface.error(f"{', '.join(L(n) for n in streaming)} shape the shard sync of FL methods; "
                            f"{L('method')} {p.method} has none (use fl-fsdp or fl-hsdp)")
    if p.sync_error_feedback and p.sync_dtype not in QUANTIZED and p.sync_topk is None:
        raise surface.error(f"{L('sync-error-feedback')} carries the rounding errors of a quantized wire or what "
                            f"{L('sync-topk')} did not send: it needs {L('sync-dtype')} {' or '.join(QUANTIZED)} "
                            f"or {L('sync-topk')}, got {L('sync-dtype')} {p.sync_dtype}")
    if p.sync_topk is not None:
        validate_topk(p, rule, surface)
    topk_only = [name for name in sparse if name in streaming]
    if topk_only and p.sync_topk is None:
        raise surface.error(f"{', '.join(L(n) for n in topk_only)} shape the top-k sync (its merge, residual and "
                            f"dense syncs); without {L('sync-topk')} there is none: set {L('sync-topk')} or leave "
                            f"them unset")
    if p.sync_fragments > p.aggregate_every:
        raise surface.error(f"{L('sync-fragments')} {p.sync_fragments} is more than the {p.aggregate_every} steps of "
                            f"a period ({L('aggregate-every')}): each fragment syncs after its own step; allowed: "
                            f"1..{p.aggregate_every}")
    share = Schedule.shortest_share_of(p.aggregate_every, p.sync_fragments)
    if p.sync_delay >= share:
        raise surface.error(f"{L('sync-delay')} {p.sync_delay} is not smaller than a fragment's share of the period "
                            f"({L('aggregate-every')} {p.aggregate_every} / {L('sync-fragments')} "
                            f"{p.sync_fragments}: {share} step(s) between two syncs); allowed: 0..{share - 1}")
    if p.sync_carry and not p.sync_delay:
        raise surface.error(f"{L('sync-carry')} keeps the local steps taken while an overlapped sync travels; with "
                            f"{L('sync-delay')} 0 there are none: set {L('sync-delay')} >= 1 or leave it unset")
    if p.sync_delay and not rule.linear:
        raise surface.error(f"{L('sync-delay')} {p.sync_delay} reduces a weighted mean in the background, but "
                            f"{L('outer')} {p.outer} needs every member's shards; use a linear rule "
                            f"({', '.join(LINEAR_RULES)}) or {L('sync-delay')} 0")


def validate_sites(p: ParallelConfig, rule: Any, surface: Surface = CLI) -> None:
    """`sync-sites`: a site per federation group for a sync that can reduce in two levels
    (`flwr_sharded.parallel.sites.why_not_two_level`; one site, or one group per site, runs the flat ring)."""
    from flwr_sharded.parallel.sites import SiteLayout, why_not_two_level

    L = labeler(surface)
    try:
        layout = SiteLayout.parse(p.sync_sites)
    except ValueError as exc:
        raise surface.error(f"{L('sync-sites')}: {exc}") from None
    why = why_not_two_level(layout.sites, p.federations if p.federated else 1, alike=not p.unequal,
                            linear=rule.linear, restart_residual=p.sync_restart == "residual", flat_ok=True)
    if why:
        raise surface.error(f"{L('sync-sites')} {p.sync_sites} cannot reduce in two levels: {why} "
                            f"({L('federations')} {p.federations}, {L('method')} {p.method}, {L('outer')} "
                            f"{p.outer}); leave {L('sync-sites')} unset")


def validate_topk(p: ParallelConfig, rule: Any, surface: Surface = CLI) -> None:
    """`sync-topk` against the outer rule and error feedback (its bounds are the option's own)."""
    L = labeler(surface)
    if not rule.linear:
        raise surface.error(f"{L('sync-topk')} {p.sync_topk:g} sums every group's sparse delta, but {L('outer')} "
                            f"{p.outer} needs every member's shards; use a linear rule ({', '.join(LINEAR_RULES)})")
    if p.sync_restart == "residual" and p.sync_topk_merge == "sum":
        raise surface.error(f"{L('sync-restart')} residual puts each member's residual back into its shards, but "
                            f"{L('sync-topk-merge')} sum weighs it by the member's share; use {L('sync-topk-merge')} "
                            f"scatter-mean")
    if not p.sync_error_feedback:
        raise surface.error(f"{L('sync-topk')} {p.sync_topk:g} sends a fraction of each delta and keeps the rest "
                            f"for later syncs in an error-feedback residual: add {L('sync-error-feedback')}")


def check_fragments(p: ParallelConfig, blocks: int, model: str, surface: Surface = CLI) -> None:
    """`sync-fragments` against the model's number of transformer blocks (contiguous groups of blocks)."""
    if p.sync_fragments > blocks:
        raise surface.error(f"{label_of(surface, 'sync-fragments')} {p.sync_fragments}: model {model} has "
                            f"{blocks} transformer blocks, and a fragment is a group of whole blocks; allowed: "
                            f"1..{blocks}")


def validate_static(cfg: TrainConfig, surface: Surface = CLI) -> None:
    """The static engine's own checks, beyond `validate` (a Flower run trains rounds, and checkpoints at their end)."""
    L, c, p = labeler(surface), cfg.checkpoint, cfg.parallel
    if p.group_steps != "equal" and (c.every or c.resume or cfg.steps % p.aggregate_every):
        raise surface.error(f"{L('group-steps')} {p.group_steps} runs whole periods of the fastest group's "
                            f"{L('aggregate-every')} steps and keeps each group's steps in memory only: {L('steps')} "
                            f"must be a multiple of {L('aggregate-every')} (got {cfg.steps} and {p.aggregate_every}), "
                            f"without {L('checkpoint-every')} or {L('resume')} (a checkpoint is written at the end)")


def validate(cfg: TrainConfig, world_size: int | None = None, surface: Surface = CLI) -> None:
    """Validate a whole run configuration; raises ConfigError on the first problem, naming the option."""
    for o in schema.options(TrainConfig):
        o.check(schema.get(cfg, o.path), surface)
    validate_parallel(cfg.parallel, world_size, surface)
    L = labeler(surface)
    c = cfg.checkpoint
    if (c.resume or c.every or c.async_save) and not c.dir:
        raise surface.error(f"{L('resume')}, {L('checkpoint-every')} and {L('async-checkpoint')} need "
                            f"{L('checkpoint-dir')}")
    p = cfg.parallel
    if p.sync_delay and c.every % p.aggregate_every:
        raise surface.error(f"{L('checkpoint-every')} {c.every} with {L('sync-delay')} {p.sync_delay}: checkpoints "
                            f"are taken at the end of a period, when no sync is in flight; use a multiple of "
                            f"{L('aggregate-every')} ({p.aggregate_every})")
    if cfg.data.streaming and cfg.data.max_train_blocks is None:
        raise surface.error(f"{L('streaming')} reads a dataset until {L('max-train-blocks')} blocks are full: set "
                            f"{L('max-train-blocks')} (e.g. 65536, the paper's), or turn {L('streaming')} off")
    if cfg.optim.proximal_mu > 0 and not cfg.parallel.federated:
        raise surface.error(f"{L('proximal-mu')} pulls each group towards the shards of its last sync: it needs "
                            f"an FL method (fl-fsdp or fl-hsdp), got {L('method')} {cfg.parallel.method}")
