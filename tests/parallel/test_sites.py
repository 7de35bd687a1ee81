"""The two-level (site-aware) reduction: the same weighted mean as a central computation, bit-identical on every
member, and each member's share the only bytes that cross the sites."""

from __future__ import annotations

import re

import pytest
import torch

from flwr_sharded.parallel.sites import SiteLayout
from tests.multiproc import run_ranks


def test_a_site_layout_groups_members_by_site_in_order_of_appearance():
    layout = SiteLayout.parse("b, a,b,a")
    assert (layout.names, layout.G, layout.L, layout.two_level) == (["b", "a"], 2, 2, True)
    assert [layout.members_of(g) for g in range(2)] == [[0, 2], [1, 3]]
    assert [layout.position(m) for m in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [layout.across(j) for j in range(2)] == [[0, 1], [2, 3]]
    assert not SiteLayout.parse("a,b,c").two_level and not SiteLayout.parse("a,a,a").two_level


@pytest.mark.parametrize("text, why", [("a,a,b", "as many federation members"), ("a,,b", "empty site name")])
def test_a_bad_site_layout_is_refused(text, why):
    with pytest.raises(ValueError, match=why):
        SiteLayout.parse(text)


def _values(rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    gen = torch.Generator().manual_seed(rank)
    return torch.randn(n, generator=gen), torch.randn(n, generator=torch.Generator().manual_seed(99)), 1.0 + rank


def _reduce_worker(rank: int, world: int, sites: str, wire_name: str, n: int):
    import torch.distributed as dist

    from flwr_sharded.parallel.sites import site_groups
    from flwr_sharded.parallel.traffic import TrafficMeter
    from flwr_sharded.parallel.wire import WIRES
    from flwr_sharded.parallel.workspace import Workspace

    dist.init_process_group("gloo")
    from datetime import timedelta
    layout = SiteLayout.parse(sites)
    flat = dist.new_group(list(range(world)))
    groups = site_groups(layout, [list(range(world))], 0, rank, flat, timedelta(seconds=60))
    wire, out = WIRES[wire_name], {}
    total = sum(_values(r, n)[2] for r in range(world))
    for name, sites in (("flat", None), ("sites", groups)):
        x, global_k, weight = _values(rank, n)
        residual = torch.zeros(n) if wire.error_feedback else None
        with TrafficMeter() as meter:
            wire.reduce(x, global_k if wire.delta else None, weight / total, flat, Workspace(), residual, sites=sites)
        out[name] = x
        out[name + "_records"] = [(r.op, r.ranks, r.nbytes) for r in meter.records]
    return out


@pytest.mark.dist
@pytest.mark.parametrize("wire_name, tolerance", [("float32", 1e-6), ("bfloat16", 2e-2), ("int8", 2e-2)])
def test_the_two_level_reduction_is_the_weighted_mean_and_crosses_the_sites_with_one_share(wire_name, tolerance):
    n, world = 1001, 4  # not a multiple of the site's size: the last share is padded
    results = run_ranks(_reduce_worker, world, "a,a,b,b", wire_name, n, timeout=120)
    values = [_values(r, n) for r in range(world)]
    total = sum(w for _, _, w in values)
    if wire_name == "float32":
        central = sum(x * w for x, _, w in values) / total
    else:  # the delta wires: the global values plus the weighted mean of the deltas
        g = values[0][1]
        central = g + sum((x - g) * w for x, _, w in values) / total
    for res in results:
        assert torch.equal(res["sites"], results[0]["sites"]), "members differ after the two-level reduction"
        for name in ("flat", "sites"):
            err = (res[name] - central).abs().max().item()
            assert err <= tolerance * central.abs().max().item(), (name, err)
    # what crosses the sites (members 0, 1 at site a; 2, 3 at b): the two-level reduction's only exchanges between
    # sites are this member's share (ceil(n / L) values in the wire's format) with the same share of the other site
    def spans(ranks):
        return len({r // 2 for r in ranks}) > 1

    flat, sites = results[0]["flat_records"], results[0]["sites_records"]
    crossing = [(op, r, b) for op, r, b in sites if spans(r)]
    assert crossing and all(r == (0, 2) for _, r, _ in crossing), crossing
    # inside the site: a ring reduce-scatter of point-to-point sends (gloo's own would send an all-reduce's bytes),
    # (L - 1) shares of fp32 from this member, and an all-gather
    inside = [(op, b) for op, r, b in sites if not spans(r)]
    assert {op for op, _ in inside} in ({"send", "all_gather_single"}, {"send", "all_gather_into_tensor"})
    assert sum(b for op, b in inside if op == "send") == (2 - 1) * -(-n // 2) * 4
    if wire_name == "float32":  # one all-reduce each: the whole bucket against one share of it
        assert [b for op, r, b in flat if spans(r)] == [n * 4]
        assert [b for _, _, b in crossing] == [-(-n // 2) * 4]


@pytest.mark.dist
def test_three_members_per_site_reduce_around_the_site_ring():
    """Two sites of three: the in-site ring takes two steps; fp32 against the central weighted mean."""
    n, world = 1000, 6
    results = run_ranks(_reduce_worker, world, "a,a,a,b,b,b", "float32", n, timeout=120)
    values = [_values(r, n) for r in range(world)]
    central = sum(x * w for x, _, w in values) / sum(w for _, _, w in values)
    for res in results:
        assert torch.equal(res["sites"], results[0]["sites"])
        assert (res["sites"] - central).abs().max().item() <= 1e-6 * central.abs().max().item()


@pytest.mark.parametrize("options, message", [
    (dict(sync_sites="a,a,b,b,c,c"), "names 6 site"),
    (dict(sync_sites="a,b,b,b"), "as many federation members"),
    (dict(sync_sites="a,a,b,b", sync_topk=0.1, sync_error_feedback=True, sync_restart="residual"),
     "residual restart"),
    (dict(sync_sites="a,a,b,b", outer="median"), "not linear"),
])
def test_sync_sites_that_cannot_reduce_in_two_levels_are_refused_before_the_run(options, message):
    from flwr_sharded.config import ParallelConfig
    from flwr_sharded.errors import ConfigError
    from flwr_sharded.validation import validate_parallel

    validate_parallel(ParallelConfig(method="fl-fsdp", federations=4, shards=2, sync_sites="a,a,b,b"))
    with pytest.raises(ConfigError, match=message):
        validate_parallel(ParallelConfig(method="fl-fsdp", federations=4, shards=2, **options))


def test_a_top_k_sync_and_one_site_are_taken_with_sync_sites():
    """Top-k reduces in two levels (`parallel.sparse_sites`); one site, or one group per site, runs the flat ring."""
    from flwr_sharded.config import ParallelConfig
    from flwr_sharded.validation import validate_parallel

    for options in (dict(sync_sites="a,a,b,b", sync_topk=0.1, sync_error_feedback=True),
                    dict(sync_sites="a,a,b,b", sync_topk=0.1, sync_error_feedback=True, sync_topk_merge="sum"),
                    dict(sync_sites="a,a,a,a"), dict(sync_sites="a,b,c,d")):
        validate_parallel(ParallelConfig(method="fl-fsdp", federations=4, shards=2, **options))


@pytest.mark.parametrize("sites, members, options, why", [
    (["a", "a", "b"], 4, {}, "names 3 site"),
    (["a", "", "b", "b"], 4, {}, "names no site"),
    (["a", "a", "b", "b"], 4, dict(alike=False), "shard differently"),
    (["a", "a", "b", "b"], 4, dict(linear=False), "not linear"),
    (["a", "a", "b", "b"], 4, dict(restart_residual=True), "residual restart"),
    (["a", "b", "b", "b"], 4, {}, r"different numbers of members \(a=1, b=3\)"),
    (["a", "a", "a", "a"], 4, {}, "one site, or one member per site"),
    (["a", "b", "c", "d"], 4, {}, "one site, or one member per site"),
    (["x", "y"], 2, dict(term=("facility", "facilities")), "one member per facility"),
    (["x", "x", "y"], 3, dict(term=("facility", "facilities")), "facilities hold different numbers"),
])
def test_one_statement_says_why_a_sync_cannot_reduce_in_two_levels(sites, members, options, why):
    from flwr_sharded.parallel.sites import why_not_two_level

    assert re.search(why, why_not_two_level(sites, members, **options))


def test_two_levels_need_every_condition_and_one_level_may_be_allowed():
    from flwr_sharded.parallel.sites import why_not_two_level

    assert why_not_two_level(["a", "a", "b", "b"], 4) is None
    assert why_not_two_level(["a", "a", "a"], 3, flat_ok=True) is None
    assert why_not_two_level(["a", "a", "b"], 3, flat_ok=True) is not None  # unequal sites are not one level


@pytest.mark.parametrize("sites, shards, why", [
    (["a", "a", "b"], [], "names 3 site"),
    (["a", "b", "b", "b"], [], "different numbers of members"),
    (["a", "a", "a", "a"], [], "one site, or one member per site"),
    (["a", "a", "b", "b"], [1, 2, 1, 2], "shard differently"),
])
def test_a_train_message_whose_member_sites_make_no_two_levels_is_refused(sites, shards, why):
    from flwr_sharded.flower import messages as M

    args = M.TrainArgs(server_round=1, job="r/1/0", members=["0", "1", "2", "3"], member_index=0,
                       rendezvous_host="h", rendezvous_ports=[1], prefix="r/1", rendezvous_timeout=5.0,
                       sync_timeout=9.0, secret="s" * 64, member_sites=sites, member_shards=shards)
    with pytest.raises(M.ArgumentError, match=f"member-sites .*{why}"):
        M.TrainArgs.from_config(args.to_config())
    assert M.TrainArgs.from_config({**args.to_config(), "member-sites": ["a", "a", "b", "b"],
                                    "member-shards": []}).member_sites == ["a", "a", "b", "b"]
