"""The two-level (site-aware) sync and the sync protocol's latency in the cost model, against central computations:
a step-by-step simulation of the rings' chunks over the links, and the exchanges counted by hand."""

from __future__ import annotations

import inspect
import math
from collections import defaultdict
from dataclasses import replace

import pytest

from flwr_sharded.errors import ConfigError
from flwr_sharded.parallel.sites import SiteLayout
from flwr_sharded_perf.cluster import load_cluster
from flwr_sharded_perf.costmodel import (PROTOCOL, CommTerms, FragmentSync, Units, all_reduce_time, comm_terms,
                                         overlapped, protocol_steps, reduction_steps, site_sync_bytes, site_sync_time,
                                         two_level_time)
from flwr_sharded_perf.memory_model import StepOptions
from flwr_sharded_perf.model_shape import model_from_preset
from flwr_sharded_perf.placement import Placement, traffic
from flwr_sharded_perf.planner import evaluate, layout_sites

INT8 = 1 + 4 / 256


# ----- the central computation: rings' chunks over the links, step by step ------------------------------------------
def simulate(rings: list[list[int]], site_of: list[int], nbytes: float, phases: str, B_fast: float,
             uplink: float) -> tuple[float, dict]:
    """Run ring collectives (`phases`: "rs", "ag" or "ar" of `nbytes` each) on all `rings` at once, one chunk of
    nbytes / n per member and step; a hop between sites crosses the sender's site uplink (capacity `uplink`, shared by
    everything on it in that step), any other the sender's own link (`B_fast`). Seconds (each step waits for its
    busiest link) and bytes per link."""
    seconds, carried = 0.0, defaultdict(float)
    n = len(rings[0])
    steps = {"rs": n - 1, "ag": n - 1, "ar": 2 * (n - 1)}[phases]
    for _ in range(steps):
        load = defaultdict(float)
        for ring in rings:
            for i, member in enumerate(ring):
                nxt = ring[(i + 1) % n]
                link = ("uplink", site_of[member]) if site_of[member] != site_of[nxt] else ("member", member)
                load[link] += nbytes / n
        for link, b in load.items():
            carried[link] += b
        seconds += max(8 * b / (uplink if link[0] == "uplink" else B_fast) for link, b in load.items())
    return seconds, carried


def simulate_sync(site_of: list[int], shard: float, wire_bytes: float, B_fast: float, uplink: float,
                  two_level: bool) -> tuple[float, dict]:
    """The flat ring (members in index order, through the wire) or the two-level scheme (fp32 reduce-scatter in the
    site, the wire across sites on each member's 1/L share, fp32 all-gather in the site)."""
    wire = shard * wire_bytes / 4
    members = list(range(len(site_of)))
    if not two_level:
        return simulate([members], site_of, wire, "ar", B_fast, uplink)
    sites = sorted(set(site_of))
    in_site = [[m for m in members if site_of[m] == s] for s in sites]
    L = len(in_site[0])
    cross = [[ring[place] for ring in in_site] for place in range(L)]
    total, carried = 0.0, defaultdict(float)
    for rings, nbytes, phase in ((in_site, shard, "rs"), (cross, wire / L, "ar"), (in_site, shard, "ag")):
        seconds, links = simulate(rings, site_of, nbytes, phase, B_fast, uplink)
        total += seconds
        for link, b in links.items():
            carried[link] += b
    return total, carried


@pytest.mark.parametrize("G,L", [(2, 2), (2, 4), (3, 2), (4, 3)])
@pytest.mark.parametrize("wire_bytes", [4.0, 2.0, INT8])
def test_two_level_time_is_the_simulated_rings(G, L, wire_bytes):
    shard, B_fast, uplink = 3e6, 1e9, 1e8
    site_of = [m // L for m in range(G * L)]
    simulated, links = simulate_sync(site_of, shard, wire_bytes, B_fast, uplink, two_level=True)
    # L cross-site flows leave each site at once: each gets a share of its uplink
    model = site_sync_time(shard, G, L, wire_bytes=wire_bytes, B_site=B_fast, B_cross=uplink / L)
    assert model == pytest.approx(simulated, rel=1e-12)
    sent = site_sync_bytes(shard, G, L, wire_bytes=wire_bytes)
    for site in range(G):  # each uplink carries what its L members send across
        assert links["uplink", site] == pytest.approx(L * sent.cross, rel=1e-12)
    for m in range(G * L):
        assert links["member", m] == pytest.approx(sent.in_site, rel=1e-12)


@pytest.mark.parametrize("G,L", [(2, 2), (2, 4), (3, 2)])
def test_the_flat_ring_is_the_simulated_ring(G, L):
    shard, B_fast, uplink = 3e6, 1e9, 1e8
    site_of = [m // L for m in range(G * L)]
    simulated, links = simulate_sync(site_of, shard, 4.0, B_fast, uplink, two_level=False)
    # members in site order: one ring edge leaves each site, at the whole uplink
    assert all_reduce_time(8 * shard, G * L, uplink) == pytest.approx(simulated, rel=1e-12)
    P = G * L
    assert links["uplink", 0] == pytest.approx(2 * (P - 1) / P * shard)
    assert site_sync_bytes(shard, G * L, 1).cross == pytest.approx(links["uplink", 0])


def test_the_emulated_cluster_crosses_1_5_then_1_0_shards_per_uplink():
    """2 sites x 2 groups: a flat ring's uplink carries 1.5 S, the two-level scheme's 1.0 S."""
    site_of = [0, 0, 1, 1]
    _, flat = simulate_sync(site_of, 1.0, 4.0, 1e9, 1e8, two_level=False)
    _, two = simulate_sync(site_of, 1.0, 4.0, 1e9, 1e8, two_level=True)
    assert flat["uplink", 0] == pytest.approx(1.5) and two["uplink", 0] == pytest.approx(1.0)
    assert site_sync_bytes(1.0, 2, 2).cross * 2 == pytest.approx(1.0)
    assert site_sync_bytes(1.0, 4, 1).cross == pytest.approx(1.5)


@pytest.mark.parametrize("G,L", [(1, 4), (4, 1), (1, 1)])
def test_one_site_or_one_member_per_site_is_the_flat_ring(G, L):
    D, B_site, B_cross = 8e7, 1e9, 1e8
    flat = all_reduce_time(D, G * L, B_cross if G > 1 else B_site)
    assert two_level_time(D, G, L, stage=4.0, B_site=B_site, B_cross=B_cross) == flat
    units = Units(blocks=(1e6, 2e6), root=5e5)
    base = comm_terms("fl-fsdp", units, S=2, F=G * L, A=4, B_S=1e10, B_F=B_cross, alpha_F=1e-3, wire_ratio=0.5)
    sited = comm_terms("fl-fsdp", units, S=2, F=G * L, A=4, B_S=1e10, B_F=B_cross, alpha_F=1e-3, wire_ratio=0.5,
                       sites=SiteLayout.even(G, L), B_site=B_site, alpha_site=1e-6, stage_ratio=2.0)
    assert sited == base
    assert reduction_steps(G * L, 3, SiteLayout.even(G, L)) == reduction_steps(G * L, 3)


def test_comm_terms_prices_the_two_level_sync_per_unit():
    units = Units(blocks=(1e6, 2e6), root=5e5)
    S, A, wire, stage = 2, 4, 0.25 + 4 / 256, 2.0  # bf16 units: an fp32 staging is 2x, the wire's int2 1/8x
    kw = dict(S=S, F=8, A=A, B_S=1e10, B_F=5e7, wire_ratio=wire, alpha_F=1e-3)
    flat = comm_terms("fl-fsdp", units, **kw)
    sited = comm_terms("fl-fsdp", units, **kw, sites=SiteLayout.even(2, 4), B_site=1e9, alpha_site=2e-5,
                       stage_ratio=stage)
    expected = sum(site_sync_time(u / S * stage, 2, 4, wire_bytes=4 * wire / stage, B_site=1e9, B_cross=5e7)
                   for u in units.all()) / A
    assert sited.sync == pytest.approx(expected, rel=1e-12)
    assert sited.shard == flat.shard
    # latency: 2 (G-1) steps across, 2 (L-1) inside, one reduction per unit
    assert sited.sync_latency == pytest.approx(3 * (2 * 1e-3 + 6 * 2e-5) / A)
    assert flat.sync_latency == pytest.approx(3 * 14 * 1e-3 / A)
    with pytest.raises(ConfigError, match="sites place 6 members"):
        comm_terms("fl-fsdp", units, **kw, sites=SiteLayout.even(2, 3), B_site=1e9)
    with pytest.raises(ConfigError, match="B_site"):
        comm_terms("fl-fsdp", units, **kw, sites=SiteLayout.even(2, 4))


def test_sites_from_a_list_and_their_rings():
    sites = SiteLayout([1, 0, 1, 0, 2, 2])
    assert (sites.G, sites.L, sites.members) == (3, 2, 6)
    assert sites.site_rings() == [[0, 2], [1, 3], [4, 5]]
    assert sites.cross_rings() == [[0, 1, 4], [2, 3, 5]]
    with pytest.raises(ConfigError, match="as many federation members"):
        SiteLayout([0, 0, 1])


def test_rank_traffic_of_a_two_level_sync_matches_the_simulation():
    """Emulated cluster: 8 members of one rank, 2 nodes of 2 ranks per group: the groups are the sites."""
    placement = Placement(F=8, R=1, S=1, gpus_per_node=2, nodes_per_group=2)
    units = Units(blocks=(4e6,))
    sites = layout_sites(placement, "groups")
    assert sites == SiteLayout.even(2, 4)
    per_rank = traffic("fl-fsdp", placement, units, A=1, backend="nccl", wire_ratio=INT8 / 4, stage_ratio=1.0,
                       sites=sites)
    _, links = simulate_sync(list(sites.sites), 4e6, INT8, 1e9, 1e8, two_level=True)
    assert sum(t.sync["inter_group"] for t in per_rank) == pytest.approx(links["uplink", 0] + links["uplink", 1])
    in_site = sum(b for link, b in links.items() if link[0] == "member")
    assert sum(t.sync["intra_node"] + t.sync["inter_node"] for t in per_rank) == pytest.approx(in_site)
    # the sync runs its own ring reduce-scatter on gloo too (gloo's own would send an all-reduce's bytes)
    assert traffic("fl-fsdp", placement, units, A=1, backend="gloo", wire_ratio=INT8 / 4, stage_ratio=1.0,
                   sites=sites) == per_rank
    flat = traffic("fl-fsdp", placement, units, A=1, backend="gloo", wire_ratio=INT8 / 4)
    assert traffic("fl-fsdp", placement, units, A=1, backend="gloo", wire_ratio=INT8 / 4,
                   sites=SiteLayout.even(8, 1)) == flat


def test_the_planner_prices_sites_and_keeps_the_flat_ring_without():
    cluster, model = load_cluster("examples/clusters/emulated.yaml"), model_from_preset("small", 32000)
    kw = dict(F=8, S=1, A=32, tokens_per_gpu_batch=512, bytes_per_param=4.0)
    flat = evaluate(cluster, model, "fl-fsdp", **kw)
    assert evaluate(cluster, model, "fl-fsdp", **kw, sites=[m for m in range(8)]) == flat  # L = 1: the flat ring
    two = evaluate(cluster, model, "fl-fsdp", **kw, sites="groups")
    assert two.fragment_sync.sites == SiteLayout.even(2, 4)
    # the cross-site part: 4 flows share each 100 Mbit/s uplink; 1.75 S -> 1 S over it, plus the in-site stage
    assert two.bandwidth["federation"] == pytest.approx(25e6)
    assert two.comm.sync < flat.comm.sync
    assert two.comm.shard == flat.comm.shard and two.compute == flat.compute
    # a member spanning groups keeps the flat ring
    assert layout_sites(cluster.placement(2, 1, 4), "groups") == SiteLayout.even(2, 1)
    assert layout_sites(cluster.placement(1, 1, 8), "groups") is None


def test_the_planner_prices_a_two_level_top_k_sync_by_one_share_row_across_the_sites():
    """Top-k in two levels (`parallel.sparse_sites`): the same fp32 stage in the site as the dense sync's, then an
    all-gather of one row of each member's 1/L share among the G sites: (G - 1) rows of f (1.5 + 4) / 4 of a share's
    fp32 bytes per member, against the dense all-reduce's 2 (G - 1) / G shares."""
    cluster, model = load_cluster("examples/clusters/emulated.yaml"), model_from_preset("small", 32000)
    kw = dict(F=8, S=1, A=32, tokens_per_gpu_batch=512, bytes_per_param=4.0, sites="groups")
    f, G, L = 0.02, 2, 4
    dense = evaluate(cluster, model, "fl-fsdp", **kw)
    topk = evaluate(cluster, model, "fl-fsdp", **kw, step=StepOptions(sync_topk=f, sync_error_feedback=True))
    assert topk.fragment_sync.sites == SiteLayout.even(G, L)
    B, bits = topk.bandwidth["federation"], sum(model.units(4.0).all()) * 8
    cross_topk = (G - 1) * bits / L * f * (1.5 + 4) / 4 / B
    cross_dense = 2 * (G - 1) / G * bits / L / B
    assert topk.comm.sync - dense.comm.sync == pytest.approx((cross_topk - cross_dense) / 32, rel=1e-9)
    flat = evaluate(cluster, model, "fl-fsdp", **{**kw, "sites": None},
                    step=StepOptions(sync_topk=f, sync_error_feedback=True))
    assert topk.comm.sync < flat.comm.sync


# ----- latency: the protocol's exchanges, counted by hand ---------------------------------------------------------
HAND = {"overlapped": {"admission": lambda n: n - 1, "result vote": lambda n: 2 * (n - 1)},
        "blocking": {"admission": lambda n: n - 1, "result vote": lambda n: 2 * (n - 1),
                     "commit vote": lambda n: n - 1}}
"""Steps of each exchange among n members, by hand: an all-gather's ring n - 1, an all-reduce's 2 (n - 1)."""


@pytest.mark.parametrize("n", [1, 2, 4, 8, 128])
def test_protocol_steps_are_the_hand_count(n):
    for kind, exchanges in HAND.items():
        assert [e.name for e in PROTOCOL[kind]] == list(exchanges)
        assert protocol_steps(kind, n) == sum(f(n) for f in exchanges.values())
    assert protocol_steps("overlapped", n) == 3 * (n - 1) and protocol_steps("blocking", n) == 4 * (n - 1)
    assert reduction_steps(n, 5) == (5 * 2 * (n - 1), 0)


def test_the_declared_exchanges_are_the_codes():
    """Each exchange of `PROTOCOL` is issued where it says; an overlapped sync's merge issues no commit vote."""
    from flwr_sharded.parallel import admission
    from flwr_sharded.parallel.sync import ShardSync
    from flwr_sharded.parallel.sync_verdict import admit_channels, conclude
    from flwr_sharded.training.commit import Commits
    from flwr_sharded.training.sync_loop import SyncLoop

    assert "admit_channels(" in inspect.getsource(ShardSync._reduce)
    assert "conclude(" in inspect.getsource(ShardSync._reduce)
    issued = {"admission": (admit_channels, "admit"), "result vote": (conclude, "vote"),
              "commit vote": (Commits.agree, "commit_vote")}
    calls = {"all_gather": "all_gather_single", "all_reduce": "dist.all_reduce"}
    for exchange in PROTOCOL["blocking"]:
        where, function = issued[exchange.name]
        assert f"{function}(" in inspect.getsource(where)
        assert exchange.code.startswith(f"parallel.admission.{function} ")
        assert calls[exchange.collective] in inspect.getsource(getattr(admission, function))
    assert "commit_vote" not in inspect.getsource(SyncLoop._merge_overlapped)
    assert "commit_vote" not in inspect.getsource(Commits.agree_overlapped)
    assert "self.commits.agree(" in inspect.getsource(SyncLoop._merge)


def test_comm_terms_counts_the_protocol_and_an_overlapped_sync_hides_it():
    units = Units(blocks=(1e6, 2e6))
    kw = dict(S=1, F=4, A=8, B_S=None, B_F=1e9, alpha_F=0.05)
    plain = comm_terms("fl-fsdp", units, **kw)
    blocking = comm_terms("fl-fsdp", units, **kw, protocol="blocking", fragments=2)
    assert plain.protocol == 0.0
    assert blocking.protocol == pytest.approx(2 * 4 * 3 * 0.05 / 8)  # 2 fragment syncs of 4 (n-1) steps, over A
    assert blocking.total == pytest.approx(plain.total + blocking.protocol)
    assert replace(blocking, protocol=0.0) == plain
    ovl = comm_terms("fl-fsdp", units, **kw, protocol="overlapped", fragments=2)
    hidden = overlapped(ovl, A=8, fragments=2, delay=2, local_step=10.0)
    assert hidden.protocol == 0.0 and hidden.sync == 0.0
    assert hidden.hidden == pytest.approx(ovl.sync + ovl.protocol)
    exposed = overlapped(ovl, A=8, fragments=2, delay=1, local_step=0.0)
    assert exposed.sync == pytest.approx(ovl.sync + ovl.protocol)
    assert overlapped(CommTerms(shard=0.1, sync=0.5), A=8, fragments=2, delay=1, local_step=0.1).protocol == 0.0


def test_fragment_sync_share_by_hand():
    fs = FragmentSync(kind="blocking", members=4, data=2.0, collectives=3)
    alpha = 0.05
    reduction, exchanges = 3 * 6 * alpha, 12 * alpha
    assert fs.reduction(alpha) == pytest.approx(reduction)
    assert fs.protocol_share(alpha) == pytest.approx(exchanges / (2.0 + reduction + exchanges))
    assert replace(fs, steps=4).reduction(alpha) == pytest.approx(3 * 4 * alpha)  # NCCL's tree: fewer steps
    two = FragmentSync(kind="overlapped", members=4, data=2.0, collectives=3, sites=SiteLayout.even(2, 2),
                       alpha_site=1e-4)
    assert two.reduction(alpha) == pytest.approx(3 * 2 * alpha + 3 * 2 * 1e-4)
    assert two.protocol(alpha) == pytest.approx(9 * alpha)


def test_the_planner_counts_the_protocol_at_the_clusters_latency():
    cluster, model = load_cluster("examples/clusters/emulated.yaml"), model_from_preset("small", 32000)
    kw = dict(F=4, R=2, S=1, A=16, tokens_per_gpu_batch=512, bytes_per_param=4.0)
    base = evaluate(cluster, model, "fl-hsdp", **kw)
    priced = evaluate(cluster, model, "fl-hsdp", **kw, protocol=True)
    alpha = cluster.latency["inter_group"]
    assert priced.comm.protocol == pytest.approx(4 * 3 * alpha / 16)
    assert priced.step_time == pytest.approx(base.step_time + priced.comm.protocol)
    assert priced.phases.aggregation == pytest.approx(base.phases.aggregation + priced.comm.protocol)
    step = StepOptions(sync_fragments=2, sync_delay=1)
    ovl = evaluate(cluster, model, "fl-hsdp", **kw, step=step, protocol=True)
    assert ovl.fragment_sync.kind == "overlapped" and ovl.fragment_sync.collectives == pytest.approx(
        model.units(4.0).count / 2)
    assert ovl.comm.protocol == 0.0  # hidden behind the local steps with the reduction
    assert math.isclose(ovl.comm.hidden, evaluate(cluster, model, "fl-hsdp", **kw, step=step).comm.hidden
                        + 2 * 3 * 3 * alpha / 16)


def test_plan_shows_the_protocols_share(capsys):
    from flwr_sharded.cli import main

    assert main(["plan", "--cluster", "examples/clusters/emulated.yaml", "--model", "small", "--top", "3",
                 "--bytes-per-param", "4", "--tokens-per-gpu", "512", "--sites", "groups", "--protocol"]) in (0, None)
    out = capsys.readouterr().out
    assert "Sync protocol of fl-" in out and "two-level over 2 sites" in out
    for latency in ("0.1 ms (inter_group)", "10 ms", "50 ms", "100 ms"):
        assert latency in out
