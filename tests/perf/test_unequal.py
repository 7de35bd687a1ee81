"""Unequal federations: the sync's bytes and time from the sync plan, the facilities' plan, its YAML and CLI."""

import argparse
import json
from math import prod
from pathlib import Path

import pytest

from flwr_sharded.errors import ConfigError
from flwr_sharded.parallel.wire import SYNC_DTYPE_BYTES, sync_wire_ratio
from flwr_sharded.parallel.sync_plan import shard_rows
from flwr_sharded_perf import plan_cli
from flwr_sharded_perf.cluster import FacilityFederation, federation_from_dict, load_cluster, load_description
from flwr_sharded_perf.costmodel import comm_terms
from flwr_sharded_perf.memory_model import StepOptions
from flwr_sharded_perf.model_shape import ModelShape
from flwr_sharded_perf.placement import Placement, rank_traffic
from flwr_sharded_perf.federation_planner import plan_federation
from flwr_sharded_perf.unequal_sync_cost import unequal_sync
from flwr_sharded.parallel.schedule import idle_times, local_steps
from tests.perf.paper_equations import even_units

CLUSTERS = Path(__file__).resolve().parents[2] / "examples" / "clusters"
SHAPES = ((10, 3), (7,), (), (33, 2, 2), (5, 8))  # uneven rows, a scalar, a 3-D tensor


def _brute_rank_bytes(layouts, shapes, bytes_per_param, wire):
    """Row by row: a rank sends 2 (F-1)/F x the bytes of every row it holds (every row is in one channel)."""
    F = len(layouts)
    out = [[0.0] * S for _, S in layouts]
    for shape in shapes:
        rows = shape[0] if shape else 1
        row = prod(shape[1:]) if shape else 1
        for x in range(rows):
            for g, (_, S) in enumerate(layouts):
                s = next(i for i in range(S) if shard_rows(rows, S, i)[0] <= x < shard_rows(rows, S, i)[1])
                out[g][s] += 2 * (F - 1) / F * row * bytes_per_param * wire
    return out


@pytest.mark.parametrize("layouts", [((1, 2), (1, 4)), ((2, 2), (1, 3)), ((1, 3), (2, 4), (1, 5)), ((1, 8), (1, 1))])
def test_rank_bytes_match_a_row_by_row_count(layouts):
    sync = unequal_sync(layouts, SHAPES, bytes_per_param=4, wire_ratio=0.5, B_F=1e9, B_R=[1e10] * len(layouts))
    brute = _brute_rank_bytes(layouts, SHAPES, 4, 0.5)
    assert [list(r) for r in sync.rank_bytes] == [pytest.approx(r) for r in brute]
    F, model = len(layouts), sum(prod(s) for s in SHAPES) * 4
    # every group sends 2 (F-1)/F x the model's wire bytes, whatever its S; its ranks split them by shard
    assert sync.group_bytes == pytest.approx([2 * (F - 1) / F * model * 0.5] * F)
    assert sync.max_rank_bytes == pytest.approx(max(max(r) for r in brute))


@pytest.mark.parametrize("F, R, S", [(2, 1, 4), (3, 2, 2), (4, 4, 8)])
def test_equal_layouts_reduce_to_the_equal_formulas(F, R, S):
    shapes = ((64, 16), (32,), (128, 4))  # rows divisible by S: shards of exactly P/S
    bpp, wire, A, B_F, B_R = 2.0, 0.5, 8, 25e9, 400e9
    sync = unequal_sync([(R, S)] * F, shapes, bytes_per_param=bpp, wire_ratio=wire, B_F=B_F, B_R=[B_R] * F)
    units = even_units(sum(prod(s) for s in shapes) * bpp, 4)
    placement = Placement(F=F, R=R, S=S, gpus_per_node=R * S, nodes_per_group=1)
    method = "fl-hsdp" if R > 1 else "fl-fsdp"
    for s in range(S):
        sent = rank_traffic(method, placement, units, rank=placement.rank(0, 0, s), A=A, wire_ratio=wire).sync
        assert sync.rank_bytes[0][s] == pytest.approx(sent["inter_group"])
    terms = comm_terms(method, units, S=S, R=R, F=F, A=A, B_S=1e12, B_R=B_R, B_F=B_F, wire_ratio=wire)
    assert sync.time == pytest.approx(terms.sync * A) and sync.busiest == pytest.approx(sync.time)
    assert sync.broadcast_bytes[0] == pytest.approx((R - 1) * units.total)
    tiers = {"inter_group": sync.group_bytes[0]}  # group 0's bytes per sync by tier
    if sync.broadcast_bytes[0]:
        tiers[placement.dim_tier("replica")] = sync.broadcast_bytes[0]
    assert tiers == ({"inter_group": pytest.approx(sync.group_bytes[0]), "intra_node": sync.broadcast_bytes[0]}
                     if R > 1 else {"inter_group": pytest.approx(sync.group_bytes[0])})


def test_sync_time_follows_the_channel_order():
    # nested cuts (2 | 4): no channel waits; the busiest ranks are site 0's, with two channels each
    nested = unequal_sync([(1, 2), (1, 4)], elements=8, bytes_per_param=1, B_F=8)
    assert nested.time == nested.busiest == 4.0  # two channels of 2 bytes, 2 s each at 1 byte/s
    # 2 and 3 shards of 6 rows: pieces of 2, 1, 1, 2 rows whose channels (0,0) (0,1) (1,1) (1,2) each share an owner
    # with the next; the plan runs them in rounds of channels that share none, (0,0) (1,1) then (0,1) (1,2), so the
    # sync takes the busiest rank's three rows (sorted alone, every channel would wait for the one before: 6 s)
    crossed = unequal_sync([(1, 2), (1, 3)], elements=6, bytes_per_param=1, B_F=8)
    assert list(crossed.channel_bytes) == [(0, 0), (1, 1), (0, 1), (1, 2)]
    assert list(crossed.channel_bytes.values()) == [2, 1, 1, 2]
    assert crossed.busiest == 3.0 and crossed.time == 3.0
    shared = unequal_sync([(1, 2), (1, 4)], elements=8, bytes_per_param=1, B_F=8, shared_uplink=True)
    assert shared.time == 8.0  # each group's 8 bytes through one 1 byte/s uplink


@pytest.mark.parametrize("layouts, kwargs, match", [
    ([(1, 2), (1, 0)], {"B_F": 1e9}, r"layouts\[1\] \(facility b\): S must be"),
    ([(0, 2), (1, 2)], {"B_F": 1e9}, r"layouts\[0\] \(facility a\): R must be"),
    ([(1, 2), (1, 4)], {}, "B_F"),
    ([(1, 2), (2, 4)], {"B_F": 1e9}, r"B_R\[1\] \(facility b\)"),
    ([], {"B_F": 1e9}, "at least one group"),
])
def test_bad_layouts_name_the_group(layouts, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        unequal_sync(layouts, elements=64, names=["a", "b"][:len(layouts)] or None, **kwargs)


def test_local_steps_and_idle_times():
    times = [1.0, 2.5, 0.5]
    steps = local_steps(8, times)
    assert steps == (4, 2, 8)  # 8 x 0.5 / 1 and round(8 x 0.5 / 2.5 = 1.6)
    assert idle_times(steps, times) == pytest.approx((1.0, 0.0, 1.0))  # arrivals 4, 5, 4 s
    assert idle_times([8] * 3, times) == pytest.approx((12.0, 0.0, 16.0))  # equal A: arrivals 8, 20, 4 s
    assert local_steps(1, [1.0, 9.0]) == (1, 1)  # at least one step
    with pytest.raises(ConfigError, match="aggregate-every"):
        plan_federation(federation_from_dict(FEDERATION), MODEL, aggregate_every=(0,))


FEDERATION = {"name": "tiny-fed", "bandwidth": {"inter_group": "1Gbit"}, "gpu_memory": "16GB",
              "facilities": [{"name": "slow", "gpus_per_node": 2, "nodes": 1, "flops_per_gpu": "10TFLOPS",
                              "bandwidth": {"intra_node": "100Gbit"}},
                             {"name": "fast", "gpus_per_node": 4, "nodes": 1, "flops_per_gpu": "40TFLOPS",
                              "bandwidth": {"intra_node": "400Gbit"}}]}
MODEL = ModelShape.from_counts(50_000_000, 4)


def test_plan_federation_on_a_tiny_federation():
    fed = federation_from_dict(FEDERATION)
    assert isinstance(fed, FacilityFederation) and fed.gpus == 6 and fed.inter_group == 1e9
    ranked = plan_federation(fed, MODEL, tokens_per_gpu_batch=1024, aggregate_every=(4, 16), bytes_per_param=4.0)
    assert len(ranked) == 2 * 3 * 2  # S in (1, 2) for slow, (1, 2, 4) for fast, two A
    assert [c.tokens_per_second for c in ranked] == sorted((c.tokens_per_second for c in ranked), reverse=True)
    for c in ranked:
        times = [f.local.step_time for f in c.facilities]
        assert tuple(f.A for f in c.facilities) == local_steps(c.A, times)
        assert [f.idle for f in c.facilities] == pytest.approx(idle_times([f.A for f in c.facilities], times))
        assert [f.idle_equal for f in c.facilities] == pytest.approx(idle_times([c.A] * 2, times))
        assert max(f.A for f in c.facilities) == c.A and min(f.idle for f in c.facilities) == 0.0
    best = ranked[0]
    slow, fast = best.facilities
    assert slow.local.step_time > fast.local.step_time and slow.A < fast.A == 16  # the slow site steps less
    assert fast.idle_equal > slow.idle  # equal A would leave the fast site waiting for the slow one
    assert best.period == pytest.approx(max(f.A * f.local.step_time for f in best.facilities) + best.sync.time)


def test_a_facility_too_small_for_any_shard_count_is_named():
    data = {**FEDERATION, "facilities": [FEDERATION["facilities"][0],
                                         {**FEDERATION["facilities"][1], "gpu_memory": "10MB"}]}
    with pytest.raises(ConfigError, match="facility fast: no sharding degree S of its 4 GPUs fits"):
        plan_federation(federation_from_dict(data), MODEL, tokens_per_gpu_batch=1024)


@pytest.mark.parametrize("change, match", [
    ({"bandwidth": {}}, "bandwidth.inter_group"),
    ({"facilities": FEDERATION["facilities"][:1]}, "at least two facilities"),
    ({"nodes": 4}, "unknown field.*nodes"),
    ({"facilities": [FEDERATION["facilities"][0], {**FEDERATION["facilities"][1], "nodes_per_group": 1}]},
     "facility fast: unknown field.*nodes_per_group"),
    ({"facilities": [FEDERATION["facilities"][0], {**FEDERATION["facilities"][1], "nodes": 0}]},
     "facility fast: field 'nodes'"),
    ({"facilities": [FEDERATION["facilities"][0]] * 2}, "facility slow: two facilities"),
    ({"facilities": [FEDERATION["facilities"][0], {**FEDERATION["facilities"][1], "bandwidth": "1Gbit"}]},
     "facility fast: field 'bandwidth'"),
    ({"facilities": [FEDERATION["facilities"][0], {**FEDERATION["facilities"][1], "flops_per_gpu": "fast"}]},
     "facility fast: flops_per_gpu"),
])
def test_bad_federation_names_the_facility_and_field(change, match):
    with pytest.raises(ConfigError, match=match):
        federation_from_dict({**FEDERATION, **change})


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="flwr-sharded")
    plan_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    return args.func(args)


def test_cli_plans_the_example_federation(capsys):
    path = CLUSTERS / "unequal.yaml"
    fed = load_description(path)
    assert [(f.name, f.gpus) for f in fed.facilities] == [("site-a", 8), ("site-b", 16)]
    with pytest.raises(ConfigError, match="federation of facilities"):
        load_cluster(path)
    assert _cli("--cluster", str(path), "--model", "llama-1b", "--aggregate-every", "8,32", "--top", "3") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Federation unequal: site-a 2 x 4 GPUs")
    rec = next(x for x in lines if x.startswith("Recommended: "))
    assert "site-a R=2 S=4" in rec and "site-b R=2 S=8 A=32" in rec  # unequal shards: each site's own node
    table = {x.split()[0]: x.split() for x in lines[lines.index(rec) + 2:]}
    assert set(table) == {"site-a", "site-b"} and int(table["site-a"][5]) < 32 == int(table["site-b"][5])
    assert float(table["site-b"][6]) == 0.0 < float(table["site-b"][7])  # idle with A_g, with equal A
    assert _cli("--cluster", str(path), "--model", "llama-1b", "--json", "--aggregate-every", "32") == 0
    data = json.loads(capsys.readouterr().out)
    sites = data["recommended"]["facilities"]
    assert [f["S"] for f in sites] == [4, 8] and data["recommended"]["A"] == 32
    assert sites[0]["group_bytes"] == pytest.approx(sites[1]["group_bytes"])  # 2 (F-1)/F x the model each
    assert max(sites[0]["rank_bytes"]) == pytest.approx(2 * max(sites[1]["rank_bytes"]))  # half the shards
    assert _cli("--cluster", str(path), "--layouts", "paper") == 2
    assert "federation of facilities" in capsys.readouterr().err


def test_the_worked_example_of_the_docs():
    # docs/cost-model.md, "Unequal federations": 8 rows of 1,000 fp32 values, S = 2 and S = 4, 10 Gbit/s
    def sync(*layouts):
        return unequal_sync(layouts, [(8, 1000)], bytes_per_param=4, B_F=10e9)

    mixed = sync((1, 2), (1, 4))
    assert mixed.rank_bytes == ((16e3, 16e3), (8e3,) * 4) and mixed.group_bytes == (32e3, 32e3)
    assert mixed.time == pytest.approx(12.8e-6) and mixed.busiest == pytest.approx(12.8e-6)
    assert sync((1, 4), (1, 4)).time == pytest.approx(6.4e-6) and sync((1, 2), (1, 2)).time == pytest.approx(12.8e-6)


def test_the_sync_wire_scales_as_the_planners():
    fed = federation_from_dict(FEDERATION)

    def group_bytes(**kwargs):
        best = plan_federation(fed, MODEL, tokens_per_gpu_batch=1024, aggregate_every=(8,), bytes_per_param=4.0,
                               **kwargs)[0]
        return best.sync.group_bytes[0]

    assert group_bytes() == pytest.approx(MODEL.num_params * 4.0)  # 2 (F-1)/F = 1 for F = 2
    int8 = SYNC_DTYPE_BYTES["int8"]
    assert group_bytes(sync_bytes_per_param=int8) == pytest.approx(MODEL.num_params * int8)
    topk = group_bytes(sync_bytes_per_param=int8, step=StepOptions(sync_dtype="int8", sync_topk=0.02))
    assert topk == pytest.approx(MODEL.num_params * 4.0 * sync_wire_ratio("int8", 0.02, 2))
