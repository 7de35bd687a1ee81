"""The shard sync on real FSDP2 shards over gloo: weighted FedAvg, FL+HSDP broadcast, alignment checks, buckets."""

from __future__ import annotations

import pytest
import torch

from flwr_sharded.parallel.admission import ADMISSION_BYTES, VOTE_BYTES
from tests.multiproc import run_ranks

WEIGHTS = {0: 1.0, 1: 3.0}  # unequal FedAvg weights per federation group


def _sharded_tiny_model(method: str, F: int, R: int, S: int, intermediate_size: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    from flwr_sharded.config import ParallelConfig
    from flwr_sharded.parallel.sharding import apply_fsdp, mixed_precision_policy
    from flwr_sharded.training.models import transformer_blocks
    from flwr_sharded.parallel.topology import init_topology

    topo = init_topology(ParallelConfig(method=method, federations=F, replicas=R, shards=S))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=intermediate_size, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    model = apply_fsdp(model, transformer_blocks(model), topo.fsdp_mesh,
                       mp_policy=mixed_precision_policy("fp32", "cpu"))
    return topo, model


def _perturb(model, seed: int) -> None:
    from flwr_sharded.parallel.alignment import local_shard

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            shard = local_shard(p)
            shard.add_(torch.randn(shard.shape, generator=gen))


def central_mean(topo, before: list[torch.Tensor], weights: dict[int, float]
                 ) -> tuple[list[torch.Tensor], list[tuple[int, list[torch.Tensor]]]]:
    """The reference result of a sync (fp64): the weights-weighted mean of the pre-sync shards `before` of every
    group's replica 0 holding this rank's shard index, gathered from all ranks (collective); and those
    (federation index, shards)."""
    import torch.distributed as dist

    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (topo.fed_index, topo.replica_index, topo.shard_index, before))
    sources = [(f, b) for f, r, s, b in everyone if r == 0 and s == topo.shard_index]
    total = sum(weights[f] for f, _ in sources)
    return [sum(weights[f] * b[i].double() for f, b in sources) / total for i in range(len(before))], sources


def _make_sync(topo, model, bucket_bytes: int):
    from flwr_sharded.parallel.sync import ShardSync

    fed = topo.fed_group if topo.replica_index == 0 else None
    return ShardSync(model.named_parameters(), fed_group=fed, bucket_bytes=bucket_bytes)


def _weighted_average_worker(rank: int, world: int, method: str, F: int, R: int, S: int, bucket_bytes: int):
    from flwr_sharded.parallel.alignment import local_shard
    from flwr_sharded.parallel.traffic import TrafficMeter

    topo, model = _sharded_tiny_model(method, F, R, S)
    _perturb(model, seed=100 + rank)  # every rank differs, replicas included (the broadcast must overwrite them)
    before = [local_shard(p).clone() for p in model.parameters()]
    expected, _ = central_mean(topo, before, WEIGHTS)

    sync = _make_sync(topo, model, bucket_bytes)
    if topo.replica_index == 0:
        sync.check_alignment()  # once, before the first sync; excluded from the traffic of one sync
    with TrafficMeter() as meter:
        stats = sync.sync(weight=WEIGHTS[topo.fed_index]) if topo.replica_index == 0 else None
        if topo.rep_group is not None:  # FL+HSDP: replica 0 sends its result to the others
            sync.broadcast(topo.rep_group)
    after = [local_shard(p).clone() for p in model.parameters()]
    max_err = max(float((a.double() - e).abs().max()) for a, e in zip(after, expected))
    group_of = {r: r // (R * S) for r in range(world)}
    cross_group = sum(rec.nbytes for rec in meter.records if len({group_of[x] for x in rec.ranks}) > 1)
    return {"max_err": max_err, "after": after, "coords": (topo.fed_index, topo.replica_index, topo.shard_index),
            "cross_group_bytes": cross_group, "shard_bytes": sum(t.numel() * t.element_size() for t in before),
            "buckets": stats.buckets if stats else 0, "planned_buckets": len(sync.layout.buckets),
            "all_reduces": meter.count("all_reduce"), "broadcasts": meter.count("broadcast")}


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize("bucket_bytes", [64 << 20, 1000])
def test_fl_fsdp_sync_is_token_weighted_average(bucket_bytes):
    out = run_ranks(_weighted_average_worker, 4, "fl-fsdp", 2, 1, 2, bucket_bytes)
    for res in out:
        assert res["max_err"] < 1e-6, res["max_err"]
        # one collective per bucket (plus one scalar for the weights), never one per parameter
        assert res["all_reduces"] == res["planned_buckets"] + 1
    if bucket_bytes == 1000:
        assert out[0]["planned_buckets"] > 10  # small buckets split shards across many collectives
    else:
        assert out[0]["planned_buckets"] == 1
    # groups 0 and 1 hold the same shards after the sync
    for s in range(2):
        a, b = out[s]["after"], out[2 + s]["after"]
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_fl_hsdp_replica0_syncs_then_broadcasts():
    F, R, S = 2, 2, 2
    out = run_ranks(_weighted_average_worker, 8, "fl-hsdp", F, R, S, 64 << 20)
    for res in out:
        f, r, s = res["coords"]
        assert res["max_err"] < 1e-6
        if r == 0:
            # replica 0 sends its whole shard across groups (+ its weight and verdict, and its vote)
            assert res["cross_group_bytes"] == res["shard_bytes"] + F * ADMISSION_BYTES + VOTE_BYTES
            assert res["broadcasts"] >= 1
        else:
            assert res["cross_group_bytes"] == 0, "a replica other than 0 sent cross-group traffic"
            assert res["all_reduces"] == 0
    # all replicas of all groups are bit-identical, per shard index
    by_shard: dict[int, list] = {}
    for res in out:
        by_shard.setdefault(res["coords"][2], []).append(res["after"])
    for shards in by_shard.values():
        for other in shards[1:]:
            assert all(torch.equal(x, y) for x, y in zip(shards[0], other))


def _hostile_median_worker(rank: int, world: int, F: int):
    """FL+FSDP F x 1 x 1 with the `median` rule; the last group sends 1e30 in every value."""
    from flwr_sharded.parallel.rules import make_rule
    from flwr_sharded.parallel.alignment import local_shard
    from flwr_sharded.parallel.sync import ShardSync
    from flwr_sharded.parallel.traffic import TrafficMeter

    topo, model = _sharded_tiny_model("fl-fsdp", F, 1, 1)
    _perturb(model, seed=100 + rank)
    if topo.fed_index == F - 1:
        with torch.no_grad():
            for p in model.parameters():
                local_shard(p).fill_(1e30)
    before = [local_shard(p).clone() for p in model.parameters()]
    _, sources = central_mean(topo, before, dict.fromkeys(range(F), 1.0))
    expected = [torch.stack([b[i] for _, b in sources]).median(dim=0).values for i in range(len(before))]
    sync = ShardSync(model.named_parameters(), fed_group=topo.fed_group, rule=make_rule("median"), bucket_bytes=4096)
    sync.check_alignment()
    with TrafficMeter() as meter:
        sync.sync(weight=float(topo.fed_index + 1))
    after = [local_shard(p) for p in model.parameters()]
    return {"equal": all(torch.equal(a, e) for a, e in zip(after, expected)),
            "largest": max(float(a.abs().max()) for a in after), "buckets": len(sync.layout.buckets),
            "all_gathers": meter.count("all_gather"), "all_reduces": meter.count("all_reduce")}


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_the_median_rule_keeps_a_hostile_member_out():
    """Three groups, one sending 1e30: every member ends at the central median of the three groups' shards (the
    honest ones' values), through one all-gather per bucket and no all-reduce of the shards."""
    for res in run_ranks(_hostile_median_worker, 3, 3):
        assert res["equal"] and res["largest"] < 100, res
        assert res["all_gathers"] == res["buckets"] > 1
        assert res["all_reduces"] == 1  # the vote on a finite result, never a bucket


def _misaligned_worker(rank: int, world: int, method: str, F: int, R: int, S: int):
    """Replica 0 syncs; the group's ranks then learn each other's outcome, as the sync loop's commit has them."""
    import torch.distributed as dist

    from flwr_sharded.parallel.alignment import ShardAlignmentError, local_shard

    group = rank // (R * S)
    topo, model = _sharded_tiny_model(method, F, R, S, intermediate_size=64 if group == 0 else 96)
    before = [local_shard(p).clone() for p in model.parameters()]
    sync = _make_sync(topo, model, 64 << 20)
    error = None
    if topo.replica_index == 0:
        try:
            sync.sync(weight=1.0)
        except ShardAlignmentError as exc:
            error = str(exc)
    everyone: list = [None] * topo.group_world
    dist.all_gather_object(everyone, error, group=topo.group_pg)
    error = error or next((e for e in everyone if e), None)
    unchanged = all(torch.equal(b, local_shard(p)) for b, p in zip(before, model.parameters()))
    return {"error": error, "unchanged": unchanged}


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", [("fl-fsdp", 2, 1, 2), ("fl-hsdp", 2, 2, 1)])
def test_misaligned_sharding_is_refused_before_any_change(layout):
    method, F, R, S = layout
    out = run_ranks(_misaligned_worker, F * R * S, method, F, R, S)
    for res in out:
        assert res["error"] is not None, "misaligned groups were averaged"
        assert res["unchanged"]
    replica0 = [res for rank, res in enumerate(out) if (rank // S) % R == 0]
    assert all("mlp" in res["error"] and "shape" in res["error"] for res in replica0)


def test_bucket_plan_splits_and_covers_every_element():
    from flwr_sharded.parallel.sync import ShardSync

    params = [("a", torch.zeros(10)), ("b", torch.zeros(7, 3)), ("c", torch.zeros(5, dtype=torch.float64))]
    sync = ShardSync(params, fed_group=None, bucket_bytes=32)  # 8 fp32 or 4 fp64 elements per bucket
    covered: dict[int, int] = {}
    for bucket in sync.layout.buckets:
        dtype, segments = bucket.dtype, bucket.segments
        size = sum(s.end - s.start for s in segments)
        assert size * torch.empty((), dtype=dtype).element_size() <= 32
        for s in segments:
            covered[s.shard] = covered.get(s.shard, 0) + s.end - s.start
    assert covered == {0: 10, 1: 21, 2: 5}
    assert len(sync.layout.buckets) == 4 + 2  # 10+21 = 31 fp32 -> 4 buckets of <= 8; 5 fp64 -> 2 of <= 4
