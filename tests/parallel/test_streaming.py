"""Fragmented and overlapped shard syncs (Streaming DiLoCo) on real FSDP2 shards over gloo."""

from __future__ import annotations

import pytest
import torch

from tests.multiproc import run_ranks
from tests.parallel.test_sync import WEIGHTS, _sharded_tiny_model, central_mean


def test_schedule_staggers_fragments_and_bounds_the_delay():
    from flwr_sharded.parallel.schedule import Schedule

    s = Schedule(steps=8, fragments=3, delay=1)
    assert [s.boundary(i) for i in range(3)] == [3, 5, 8]
    assert s.shortest_share() == 2 and Schedule.shortest_share_of(8, 3) == 2  # shares of 3, 2 and 3 steps
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        Schedule(steps=8, fragments=3, delay=2)
    starts = {step: s.starts(step) for step in range(1, 9) if s.starts(step)}
    merges = {step: s.merges(step) for step in range(1, 9) if s.merges(step)}
    assert starts == {2: [0], 4: [1], 7: [2]} and merges == {3: [0], 5: [1], 8: [2]}
    blocking = Schedule(steps=8)
    assert blocking.merges(8) == [0] and not any(blocking.starts(k) for k in range(1, 9))


def _step(model, fed: int, step: int, scale: float = 0.05) -> None:
    """Stand-in for a local optimizer step: a group- and step-specific change of every shard (replicas alike)."""
    from flwr_sharded.parallel.alignment import local_shard

    gen = torch.Generator().manual_seed(1000 * step + fed)
    with torch.no_grad():
        for p in model.parameters():
            shard = local_shard(p)
            shard.add_(scale * torch.randn(shard.shape, generator=gen))


def _fragmented(topo, model, *, fragments: int, delay: int, wire: str | None, feedback: bool = False,
                period: int = 4, rule: str = "fedavg", carry: bool = False):
    """One shard sync per fragment, sharing their snapshot buffers as a sync loop's do, and their schedule."""
    from flwr_sharded.parallel.rules import make_rule
    from flwr_sharded.parallel.schedule import Schedule, fragment_parameters
    from flwr_sharded.parallel.flight import Snapshot
    from flwr_sharded.parallel.sync import ShardSync
    from flwr_sharded.parallel.wire import WIRES
    from flwr_sharded.training.models import transformer_blocks

    parts = fragment_parameters(model, transformer_blocks(model), fragments)
    fed = topo.fed_group if topo.replica_index == 0 else None
    snapshot, origin = Snapshot(), Snapshot()
    syncs = [ShardSync(part, fed_group=fed, bucket_bytes=4096, rule=make_rule(rule),
                       wire=WIRES[wire] if wire else None, error_feedback=feedback,
                       snapshot=snapshot, origin=origin, carry=carry) for part in parts]
    if topo.replica_index == 0:
        for s in syncs:
            s.capture_global()
    return syncs, Schedule(period, fragments, delay)


def _overlap_matches_central(rank: int, world: int, wire: str | None, alpha: float, carry: bool) -> list[float]:
    """Two periods of a 2-fragment schedule with tau = 1: each merge must equal alpha * local + (1 - alpha) * the
    weighted mean of the groups' snapshots taken tau steps earlier (fp64, computed from every rank's copies); with
    `carry`, local + (1 - alpha) * (that mean - this rank's snapshot)."""
    from flwr_sharded.parallel.alignment import local_shard

    topo, model = _sharded_tiny_model("fl-fsdp", 2, 1, 2)
    syncs, schedule = _fragmented(topo, model, fragments=2, delay=1, wire=wire, carry=carry)
    weight = WEIGHTS[topo.fed_index]
    snapshots: dict[int, list[torch.Tensor]] = {}
    errors = []
    for step in range(1, 9):
        _step(model, topo.fed_index, step)
        period_step = (step - 1) % 4 + 1
        for i in schedule.merges(period_step):
            local = [local_shard(p).double().clone() for p in syncs[i].params]
            syncs[i].finish(alpha=alpha, timeout=60)
            mine = snapshots.pop(i)
            mean, sources = central_mean(topo, mine, WEIGHTS)
            for got, loc, ref, snap in zip(syncs[i].params, local, mean, mine):
                expected = loc + (1 - alpha) * (ref - snap.double()) if carry else alpha * loc + (1 - alpha) * ref
                errors.append(float((local_shard(got).double() - expected).abs().max()))
        for i in schedule.starts(period_step):
            snapshots[i] = [local_shard(p).detach().clone() for p in syncs[i].params]
            syncs[i].start(weight, overlap=True)
    return errors


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("wire,alpha,carry,tolerance", [(None, 0.5, False, 1e-6), ("int8", 0.25, True, 2e-3)],
                         ids=["fp32-alpha0.5", "int8-alpha0.25-carry"])
def test_overlapped_sync_equals_the_delayed_alpha_mixed_central_update(wire, alpha, carry, tolerance):
    errors = [e for rank_errors in run_ranks(_overlap_matches_central, 4, wire, alpha, carry, timeout=240)
              for e in rank_errors]
    assert errors and max(errors) <= tolerance, max(errors)


def _replicas_after_every_merge(rank: int, world: int, wire: str | None, delay: int) -> list[bool]:
    """FL+HSDP (F=2, R=2, S=1): replica 0 merges, then the replicas receive its shards, as the sync loop has them:
    after every merge every replica of a group holds bit-identical shards."""
    import torch.distributed as dist

    from flwr_sharded.parallel.alignment import local_shard

    topo, model = _sharded_tiny_model("fl-hsdp", 2, 2, 1)
    syncs, schedule = _fragmented(topo, model, fragments=2, delay=delay, wire=wire, feedback=wire is not None)
    replica0 = topo.replica_index == 0
    identical = []
    for step in range(1, 9):
        _step(model, topo.fed_index, step)  # replicas of a group take the same steps, as HSDP's do
        period_step = (step - 1) % 4 + 1
        for i in schedule.merges(period_step):
            if replica0 and delay == 0:
                syncs[i].sync(WEIGHTS[topo.fed_index], alpha=0.5)
            elif replica0:
                syncs[i].finish(alpha=0.5, timeout=60)
            syncs[i].broadcast(topo.rep_group)
            flat = torch.cat([local_shard(p).reshape(-1) for p in model.parameters()])
            gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(topo.rep_group))]
            dist.all_gather(gathered, flat, group=topo.rep_group)
            identical.append(all(torch.equal(g, gathered[0]) for g in gathered))
        for i in schedule.starts(period_step):
            if replica0:
                syncs[i].start(WEIGHTS[topo.fed_index], overlap=True)
    return identical


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("wire,delay", [("int8", 1), ("int4", 1), (None, 0)],
                         ids=["int8-overlapped", "int4-overlapped", "fp32-blocking"])
def test_fl_hsdp_replicas_bit_identical_after_every_merge(wire, delay):
    results = run_ranks(_replicas_after_every_merge, 4, wire, delay, timeout=240)
    assert all(len(r) == 4 for r in results) and all(all(r) for r in results), results


def _trainer_equals_todays_loop(rank: int, world: int, data_dir: str) -> tuple[bool, set[int]]:
    """`SyncLoop.run` with N = 1 and tau = 0 against the loop written out: A steps, then one blocking
    `ShardSync.sync` weighted by the group's tokens. Same seed, same data: bit-identical shards. Also returns the
    frames from `SyncLoop.run` to each bucket's all-reduce, both counted."""
    import inspect

    import torch.distributed as dist

    from flwr_sharded.config import TrainConfig
    from flwr_sharded.parallel.rules import make_rule
    from flwr_sharded.parallel.alignment import local_shard
    from flwr_sharded.parallel.sync import ShardSync
    from flwr_sharded.parallel.topology import init_topology
    from flwr_sharded.training.static_run import StaticFederation
    from flwr_sharded.training.sync_loop import SyncLoop
    from flwr_sharded.training.trainer import Trainer

    cfg = TrainConfig()
    cfg.parallel.method, cfg.parallel.federations, cfg.parallel.shards = "fl-fsdp", 2, 1
    cfg.parallel.aggregate_every, cfg.parallel.outer = 2, "nesterov"
    cfg.model.name, cfg.data.data_dir, cfg.data.seq_len, cfg.batch_size, cfg.steps = "tiny", data_dir, 32, 2, 6
    topo = init_topology(cfg.parallel)
    ours, ref = SyncLoop(Trainer(cfg, topo)), Trainer(cfg, topo)
    todays = ShardSync(ref.model.named_parameters(), fed_group=topo.fed_group, rule=make_rule("nesterov"))
    todays.capture_global()
    model = ours.trainer.model
    depths, all_reduce = set(), dist.all_reduce

    def counted(*args, **kwargs):
        frames = [f.function for f in inspect.stack()]
        if "run" in frames and frames[1:3] == ["bounded", "sum"]:  # a bucket's, issued by its wire below run
            depths.add(frames.index("run"))  # the frames from run to the all-reduce, its bounded wait not counted
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counted
    report = ours.run(StaticFederation(topo, [tuple(p.shape) for p in model.parameters()], 60.0), until=cfg.steps)
    dist.all_reduce = all_reduce
    assert (report.syncs, report.periods, report.error) == (3, 3, "")
    for step in range(1, cfg.steps + 1):
        ref.step()
        if step % 2 == 0:
            todays.sync(float(2 * 32 * 2 * topo.group_world))
    return all(torch.equal(local_shard(a), local_shard(b)) for a, b in zip(model.parameters(),
                                                                           ref.model.parameters())), depths


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_one_fragment_without_delay_is_the_blocking_sync_nine_frames_below_the_loop(data_dir):
    for equal, depths in run_ranks(_trainer_equals_todays_loop, 2, str(data_dir), timeout=240):
        assert equal
        # run -> _periods -> _syncs_after -> _merge -> receive -> _reduce -> Wire.reduce (weights) -> Wire.sum (the
        # wire's collective, over the federation or, two-level, across sites) -> all_reduce
        assert depths and max(depths) <= 9, depths


@pytest.mark.parametrize("options,message", [
    ({"sync_delay": 4, "sync_fragments": 2}, r"--sync-delay 4 is not smaller .* allowed: 0\.\.3"),
    ({"sync_fragments": 9}, r"--sync-fragments 9 .* allowed: 1\.\.8"),
    ({"sync_dtype": "int8", "outer": "trimmed-mean"}, r"--sync-dtype int8 .* --outer trimmed-mean"),
    ({"sync_delay": 1, "outer": "trimmed-mean"}, r"--sync-delay 1 .* linear rule"),
    ({"sync_error_feedback": True}, r"--sync-error-feedback .* int8 or float8_e4m3fn"),
    ({"sync_delay": 1, "method": "fsdp", "federations": 1}, r"--sync-delay .* fl-fsdp or fl-hsdp"),
    ({"sync_carry": True}, r"--sync-carry .* --sync-delay 0 there are none"),
])
def test_bad_sync_options_are_refused_naming_the_option(options, message):
    from flwr_sharded.config import TrainConfig
    from flwr_sharded.validation import validate
    from flwr_sharded.errors import ConfigError

    cfg = TrainConfig()
    for key, value in options.items():
        setattr(cfg.parallel, key, value)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_more_fragments_than_blocks_and_fp8_without_support_are_refused(monkeypatch, data_dir):
    from flwr_sharded.config import TrainConfig
    from flwr_sharded.errors import ConfigError
    from flwr_sharded.parallel.codecs import floats
    from flwr_sharded.training.preflight import check_sync

    cfg = TrainConfig()
    cfg.model.name, cfg.parallel.sync_fragments = "tiny", 3  # tiny has 2 blocks
    with pytest.raises(ConfigError, match=r"--sync-fragments 3: model tiny has 2 transformer blocks.*1\.\.2"):
        check_sync(cfg)
    cfg.parallel.sync_fragments, cfg.parallel.sync_dtype = 2, "float8_e4m3fn"
    monkeypatch.setattr(floats, "fp8_supported", lambda device, dtype, probe: False)
    with pytest.raises(ConfigError, match=r"--sync-dtype float8_e4m3fn needs .*quantized wire dtypes on cpu: int8"):
        check_sync(cfg)


def test_flower_run_refuses_overlap_on_the_server_path():
    from flwr_sharded.errors import ConfigError
    from flwr_sharded.flower.run_config import FlowerRun

    run = FlowerRun()
    run.federation.aggregation = "server"
    run.train.parallel.sync_delay = 1
    with pytest.raises(ConfigError, match=r"'sync-delay' applies to the decentralized all-reduce; 'aggregation' \"server\""):
        run.validate()


def test_an_overlapped_sync_carries_unless_told_not_to(tmp_path):
    """`sync-carry` unset: on with `sync-delay` > 0, off without it; false turns it off on every surface; true with
    `sync-delay` 0 is refused, naming the option as the surface spells it."""
    from flwr_sharded.config import ParallelConfig, TrainConfig, load_config
    from flwr_sharded.validation import validate
    from flwr_sharded.errors import ConfigError
    from flwr_sharded.flower.run_config import FlowerRun
    from flwr_sharded.train import resolve_config, train_parser

    assert ParallelConfig(sync_delay=1).carries and not ParallelConfig().carries
    assert not ParallelConfig(sync_delay=1, sync_carry=False).carries
    overlap = ["--sync-fragments", "2", "--sync-delay", "2"]
    cli = {flags: resolve_config(train_parser().parse_args([*overlap, *flags])).parallel
           for flags in ((), ("--no-sync-carry",), ("--sync-carry",))}
    assert [p.carries for p in cli.values()] == [True, False, True]
    assert cli[()].sync_carry is None
    (tmp_path / "off.yaml").write_text("parallel: {sync_delay: 2, sync_fragments: 2, sync_carry: false}\n")
    assert not load_config(tmp_path / "off.yaml").parallel.carries
    flower = {"sync-fragments": 2, "sync-delay": 2}
    for value, carries in (("", True), (False, False), ("false", False), (True, True)):
        run = FlowerRun.from_run_config({**flower, "sync-carry": value})
        assert FlowerRun.from_json(run.to_json()).train.parallel.carries is carries, value
    cfg = TrainConfig()
    cfg.parallel.sync_carry = True
    with pytest.raises(ConfigError, match=r"^--sync-carry keeps .* --sync-delay 0 there are none"):
        validate(cfg)
    with pytest.raises(ConfigError, match=r"sync-carry.* keeps .*sync-delay.* 0 there are none"):
        FlowerRun.from_run_config({"sync-carry": True}).validate()
    cfg.parallel.sync_carry, cfg.parallel.method, cfg.parallel.federations = False, "fsdp", 1
    validate(cfg)  # off shapes nothing: accepted without an FL method


def _exchanges_of_an_overlapped_run(rank: int, world: int, data_dir: str, delay: int) -> dict[str, list[str]]:
    """Two groups of two shards, two fragments, A = 4, 8 steps (4 fragment syncs, int8 wire): every collective issued
    on the training thread and on the sync's thread, named, whether its group spans both groups ("across") or stays
    inside one, and whether the caller waits for it at once ("bounded") or later ("started")."""
    import sys
    import threading

    import torch.distributed as dist

    from flwr_sharded.config import TrainConfig
    from flwr_sharded.parallel.topology import init_topology
    from flwr_sharded.training.static_run import StaticFederation
    from flwr_sharded.training.sync_loop import SyncLoop
    from flwr_sharded.training.trainer import Trainer

    cfg = TrainConfig()
    p = cfg.parallel
    p.method, p.federations, p.shards, p.aggregate_every, p.sync_fragments, p.sync_delay = "fl-fsdp", 2, 2, 4, 2, delay
    p.sync_dtype, p.sync_error_feedback = "int8", True
    cfg.model.name, cfg.data.data_dir, cfg.data.seq_len, cfg.batch_size, cfg.steps = "tiny", data_dir, 32, 2, 8
    topo = init_topology(p)
    loop = SyncLoop(Trainer(cfg, topo))
    member = [set(topo.group_ranks(f)) for f in range(2)]
    seen: dict[str, list[str]] = {"training": [], "sync": []}

    def recorded(name, collective):
        def call(*args, **kwargs):
            group = kwargs.get("group") or next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            if name == "batch_isend_irecv":  # a ring step: its ops name the group
                group = args[0][0].group
            ranks = set(dist.get_process_group_ranks(group)) if group is not None else set(range(world))
            where = "across" if all(ranks & m for m in member) else "inside"
            caller = sys._getframe(1 if sys._getframe(1).f_code.co_name != "all_gather_single" else 2)
            waited = "bounded" if caller.f_code.co_name == "bounded" or not kwargs.get("async_op") else "started"
            thread = "training" if threading.current_thread() is threading.main_thread() else "sync"
            seen[thread].append(f"{name} {where} {waited}")
            return collective(*args, **kwargs)
        return call

    names = ["all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "broadcast", "barrier",
             "all_gather_object", "batch_isend_irecv", "reduce_scatter_tensor", "broadcast_object_list"]
    originals = {n: getattr(dist, n) for n in names}
    federation = StaticFederation(topo, [tuple(q.shape) for q in loop.trainer.model.parameters()], 60.0)
    for n in names:
        setattr(dist, n, recorded(n, originals[n]))
    try:
        report = loop.run(federation, until=cfg.steps)
    finally:
        for n in names:
            setattr(dist, n, originals[n])
    assert (report.syncs, report.error) == (4, ""), report
    return seen


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_an_overlapped_merge_waits_for_no_other_member_on_the_training_thread(data_dir):
    """What the training thread waits on with the other members in an overlapped run of 4 fragment syncs: the
    fragments' alignment check (once each) and the run's end confirmation (group rank 0), never anything per sync or
    per period: each sync's admission (which carries the commit of the merges before it), its reduction and its
    result vote run on the sync's thread, and the members' times of a period are started and collected a period
    later. Inside the group, one small all-reduce per merge and one at the end. A blocking run waits on the
    members for every sync, its commit vote included."""
    overlapped, blocking = (run_ranks(_exchanges_of_an_overlapped_run, 4, str(data_dir), delay, timeout=240)
                            for delay in (1, 0))
    for rank, seen in enumerate(overlapped):
        lead = rank % 2 == 0  # rank 0 of its group
        waited = [c for c in seen["training"] if c.endswith("across bounded")]
        assert waited == ["all_gather across bounded"] * 2 + ["all_gather_single across bounded"] * lead, waited
        started = [c for c in seen["training"] if c.endswith("across started")]
        assert started == ["all_gather_single across started"] * 2 * lead, started  # the members' times, per period
        assert seen["training"].count("all_reduce inside bounded") == 4 + 1, seen["training"]
        assert seen["sync"].count("all_reduce across bounded") == 4  # each sync's result vote
        assert not [c for c in seen["sync"] if "inside" in c]
    for seen in blocking:
        assert not seen["sync"]
        assert seen["training"].count("all_reduce across bounded") == 4  # the result votes
        assert len([c for c in seen["training"] if c.endswith("across bounded")]) >= 2 + 4 * 3  # + admission, commit
