"""Cost model: Table 1 collectives, Eqs. 1-5, bytes per tier, compute and memory, checked against hand arithmetic."""

import pytest

from flwr_sharded.errors import ConfigError
from flwr_sharded_perf.costmodel import (
    Units,
    all_gather_time,
    all_reduce_time,
    broadcast_time,
    comm_terms,
    reduce_scatter_time,
)
from flwr_sharded_perf.memory_model import memory_per_gpu
from flwr_sharded_perf.model_shape import ModelShape, compute_time
from flwr_sharded_perf.placement import Placement, rank_traffic, traffic
from tests.perf.paper_equations import comm_time, even_units, fl_comm_time, per_step, states

# ---------------------------------------------------------------------------------------------------------------------
# Table 1


def test_collectives_match_table1():
    # D = 8e9 bits among n = 4 processes at B = 1e9 bits/s
    assert all_gather_time(8e9, 4, 1e9) == pytest.approx(8e9 * 3 / (4 * 1e9))  # 6 s
    assert all_gather_time(8e9, 4, 1e9) == pytest.approx(6.0)
    assert reduce_scatter_time(8e9, 4, 1e9) == pytest.approx(6.0)
    assert all_reduce_time(8e9, 4, 1e9) == pytest.approx(12.0)  # 2 * 8e9 * 3 / 4e9
    assert broadcast_time(8e9, 4, 1e9) == pytest.approx(8.0)  # 8e9 / 1e9


@pytest.mark.parametrize("collective", [all_gather_time, reduce_scatter_time, all_reduce_time, broadcast_time])
def test_single_process_costs_nothing(collective):
    assert collective(8e9, 1, None) == 0.0


@pytest.mark.parametrize("args", [(8e9, 4, 0.0), (8e9, 4, None), (8e9, 0, 1e9), (-1.0, 4, 1e9)])
def test_collective_errors(args):
    with pytest.raises(ConfigError):
        all_reduce_time(*args)


# ---------------------------------------------------------------------------------------------------------------------
# Eqs. 1-5 with M = 1000 bits, L = 2 layers, S = 4, B_S = 100 bits/s, B_R = B_F = 10 bits/s.

M, L = 1000, 2
FSDP = 3 * M * L * 3 / (4 * 100)  # Eq. 1: 3 M L (S-1)/(S B_S) = 18000 / 400 = 45 s
HSDP_AR = 2 * M * L * 1 / (2 * 10)  # 2 M L (R-1)/(R B_R), R = 2: 4000 / 20 = 200 s
FL_AR = 2 * M * L * 4 / (5 * 10)  # 2 M L (F-1)/(F B_F), F = 5: 16000 / 50 = 320 s per sync
FL_BC = M * L / 10  # M L / B_R: 200 s per sync


def test_eq1_fsdp():
    assert FSDP == 45
    assert comm_time("fsdp", M=M, L=L, S=4, B_S=100) == pytest.approx(45)


def test_eq2_hsdp():
    assert comm_time("hsdp", M=M, L=L, S=4, R=2, B_S=100, B_R=10) == pytest.approx(45 + 200)


def test_eq3_fl():
    assert fl_comm_time(M=M, L=L, F=5, A=4, B_F=10) == pytest.approx(320 / 4)  # 80 s


def test_eq4_fl_fsdp():
    assert comm_time("fl-fsdp", M=M, L=L, S=4, F=5, A=4, B_S=100, B_F=10) == pytest.approx(45 + 320 / 4)  # 125 s


def test_eq5_fl_hsdp():
    t = comm_time("fl-hsdp", M=M, L=L, S=4, R=2, F=5, A=4, B_S=100, B_R=10, B_F=10)
    assert t == pytest.approx(45 + 200 + (320 + 200) / 4)  # 375 s
    assert t == pytest.approx(FSDP + HSDP_AR + (FL_AR + FL_BC) / 4)


def test_fl_hsdp_with_one_replica_is_fl_fsdp():
    kw = dict(M=M, L=L, S=4, F=5, A=4, B_S=100, B_F=10)
    assert comm_time("fl-hsdp", R=1, **kw) == pytest.approx(comm_time("fl-fsdp", **kw))


def test_sync_scales_with_one_over_a():
    kw = dict(M=M, L=L, S=4, F=5, B_S=100, B_F=10)
    sync = {A: comm_time("fl-fsdp", A=A, **kw) - FSDP for A in (1, 2, 8)}
    assert sync[1] == pytest.approx(320)
    assert sync[2] == pytest.approx(sync[1] / 2)
    assert sync[8] == pytest.approx(sync[1] / 8)


def test_one_federation_group_has_no_sync():
    assert comm_time("fl-fsdp", M=M, L=L, S=4, F=1, A=4, B_S=100) == pytest.approx(FSDP)


@pytest.mark.parametrize("method, kw, words", [
    ("hsdp", dict(S=4, R=2, B_S=100), "B_R"),
    ("fl-hsdp", dict(S=4, R=2, F=2, B_S=100, B_F=10), "B_R"),
    ("fl-fsdp", dict(S=4, F=2, B_S=100), "B_F"),
    ("fsdp", dict(S=4, B_S=None), "B_S"),
    ("fsdp", dict(S=4, B_S=0), "B_S"),
    ("hsdp", dict(S=4, R=2, B_S=100, B_R=-1), "B_R"),
    ("fsdp", dict(S=0, B_S=100), "S"),
    ("fl-fsdp", dict(S=4, F=2, A=0, B_S=100, B_F=10), "A"),
    ("fsdp", dict(S=4, R=2, B_S=100, B_R=10), "fsdp needs R=1"),
    ("fsdp", dict(S=4, F=2, B_S=100, B_F=10), "fsdp needs R=1 and F=1"),
    ("hsdp", dict(S=4, R=2, F=2, B_S=100, B_R=10, B_F=10), "hsdp needs F=1"),
    ("fl-fsdp", dict(S=4, R=2, F=2, B_S=100, B_R=10, B_F=10), "fl-fsdp needs R=1"),
    ("fsdp", dict(S=4, A=8, B_S=100), "FL methods only"),
    ("ddp", dict(S=4, B_S=100), "method must be one of"),
])
def test_comm_time_errors(method, kw, words):
    with pytest.raises(ConfigError, match=words):
        comm_time(method, M=M, L=L, **kw)


def test_comm_time_rejects_bad_sizes():
    with pytest.raises(ConfigError, match="M"):
        comm_time("fsdp", M=0, L=L, S=4, B_S=100)
    with pytest.raises(ConfigError, match="L"):
        comm_time("fsdp", M=M, L=0, S=4, B_S=100)


# ---------------------------------------------------------------------------------------------------------------------
# comm_terms


@pytest.mark.parametrize("method, kw", [
    ("fsdp", dict(S=8)),
    ("hsdp", dict(S=4, R=2)),
    ("fl-fsdp", dict(S=4, F=4, A=8)),
    ("fl-hsdp", dict(S=2, R=4, F=2, A=4)),
])
def test_paper_sizes_reproduce_eqs(method, kw):
    units = Units(blocks=(100.0, 100.0, 100.0), root=300.0)  # 600 bytes in L = 4 units: M = 600 * 8 / 4 = 1200 bits
    bw = dict(B_S=1e3, B_R=100.0, B_F=10.0)
    terms = comm_terms(method, units, sizes="paper", **kw, **bw)
    assert terms.total == pytest.approx(comm_time(method, M=1200, L=4, **kw, **bw))


def test_exact_sizes_by_hand():
    # blocks of 100 bytes (800 bits) x 2, root 50 bytes (400 bits); S = 2, R = 2, F = 2, A = 4, all bandwidths 100.
    units = Units(blocks=(100.0, 100.0), root=50.0)
    t = comm_terms("fl-hsdp", units, S=2, R=2, F=2, A=4, B_S=100, B_R=100, B_F=100)
    # all-gathers: blocks twice, root once: (2 * 800 * 2 + 400) * (1/2) / 100 = 3600 / 200 = 18 s
    # reduce-scatters: (800 * 2 + 400) * (1/2) / 100 = 10 s
    assert t.shard == pytest.approx(28)
    # all-reduce of shards (unit / S) over R = 2: 2 * (2000 / 2) * (1/2) / 100 = 10 s
    assert t.replicate == pytest.approx(10)
    # sync: all-reduce over F = 2 of 1000 bits: 10 s, broadcast over R = 2: 1000 / 100 = 10 s; every A = 4 steps: 5 s
    assert t.sync == pytest.approx(5)
    assert t.latency == 0 and t.total == pytest.approx(43)


def test_exact_sizes_gloo_and_latency():
    units = Units(blocks=(100.0, 100.0), root=50.0)
    nccl = comm_terms("fsdp", units, S=2, B_S=100)
    gloo = comm_terms("fsdp", units, S=2, B_S=100, backend="gloo")
    assert gloo.shard - nccl.shard == pytest.approx(10)  # gloo's reduce-scatter costs an all-reduce: twice 10 s
    lat = comm_terms("hsdp", units, S=2, R=3, B_S=100, B_R=100, alpha_S=1.0, alpha_R=0.5)
    # S: (2 + 2 + 1 all-gathers + 3 reduce-scatters) x 1 ring step x 1 s = 8 s; R: 3 all-reduces x 2 x 0.5 = 6 s
    assert lat.latency == pytest.approx(14)


# ---------------------------------------------------------------------------------------------------------------------
# Placement and bytes per tier


def test_placement_tiers():
    p = Placement(F=2, R=1, S=4, gpus_per_node=2, nodes_per_group=2)  # ranks 0-3: group 0, ranks 4-7: group 1
    assert p.coords(5) == (1, 0, 1) and p.rank(1, 0, 1) == 5
    assert [p.link_tier(0, x) for x in (1, 2, 4)] == ["intra_node", "inter_node", "inter_group"]
    assert p.dim_tier("shard") == "inter_node"
    assert p.dim_tier("replica") is None
    assert p.dim_tier("federation") == "inter_group"


def test_flows_sharing_uplinks():
    # R = 2 x S = 4 on 2 groups of 2 nodes of 2 GPUs: the 4 replication pairs (s, 4 + s) all cross the group uplinks
    p = Placement(F=1, R=2, S=4, gpus_per_node=2, nodes_per_group=2)
    assert p.flows("replica") == {"inter_node": 2, "inter_group": 4}
    # one ring over all 8 ranks (FSDP S = 8) leaves each node and each group once
    assert Placement(F=1, R=1, S=8, gpus_per_node=2, nodes_per_group=2).flows("shard") == {
        "inter_node": 1, "inter_group": 1}
    assert p.flows("shard") == {"inter_node": 1, "inter_group": 0}  # ring 0-1-2-3: leaves node 0 once (1 -> 2)


def test_fl_fsdp_two_by_two_bytes():
    # F = 2, R = 1, S = 2, 2 GPUs per node, each node its own group; model: two 1000-byte blocks (P = 2000 bytes)
    p = Placement(F=2, R=1, S=2, gpus_per_node=2, nodes_per_group=1)
    units = Units(blocks=(1000.0, 1000.0))
    for t in traffic("fl-fsdp", p, units, A=4):
        # step: 2 all-gathers + 1 reduce-scatter of P over S = 2: 3 * 2000 * (1/2) = 3000 bytes, all inside the node
        assert t.step == {"intra_node": 3000, "inter_node": 0, "inter_group": 0}
        # sync: all-reduce of the shard (P / S = 1000) over F = 2: 2 * 1000 * (1/2) = 1000 bytes, to the other group
        assert t.sync == {"intra_node": 0, "inter_node": 0, "inter_group": 1000}
        assert per_step(t) == {"intra_node": 3000, "inter_node": 0, "inter_group": 250}
    one_group = Placement(F=2, R=1, S=2, gpus_per_node=2)
    assert rank_traffic("fl-fsdp", one_group, units, rank=0, A=4).sync["inter_node"] == 1000


def test_gloo_reduce_scatter_sends_an_all_reduce():
    p = Placement(F=1, R=1, S=4, gpus_per_node=4)
    units = Units(blocks=(1000.0,))
    nccl = rank_traffic("fsdp", p, units, rank=0)
    gloo = rank_traffic("fsdp", p, units, rank=0, backend="gloo")
    # reduce-scatter of 1000 bytes over 4 ranks: 750 bytes with a ring, 2 * 750 = 1500 with gloo
    assert nccl.step["intra_node"] == 3 * 750
    assert gloo.step["intra_node"] == 2 * 750 + 1500
    assert rank_traffic("fsdp", p, units, rank=0, grad_ratio=2.0).step["intra_node"] == 2 * 750 + 1500


def test_ring_edges_classify_each_rank():
    # S = 4 over two nodes of 2 GPUs: ring 0 -> 1 (node), 1 -> 2 (network), 2 -> 3 (node), 3 -> 0 (network)
    p = Placement(F=1, R=1, S=4, gpus_per_node=2)
    units = Units(blocks=(400.0,))
    per_rank = [rank_traffic("fsdp", p, units, rank=x).step for x in range(4)]
    assert [max(s, key=s.get) for s in per_rank] == ["intra_node", "inter_node", "intra_node", "inter_node"]
    assert all(sum(s.values()) == 3 * 300 for s in per_rank)  # 3 collectives x 400 * 3/4


def test_fl_hsdp_only_replica_zero_crosses_groups():
    # F = 2, R = 2, S = 2 with 4 GPUs per node, one node per group: federation f sits on node f
    p = Placement(F=2, R=2, S=2, gpus_per_node=4, nodes_per_group=1)
    units = Units(blocks=(1000.0, 1000.0))  # P = 2000 bytes, shard 1000
    per_rank = traffic("fl-hsdp", p, units, A=8)
    for t in per_rank:
        f, r, s = p.coords(t.rank)
        # step: shard collectives 3 * 2000 / 2 = 3000, HSDP all-reduce of the shard over R = 2: 1000, both in the node
        assert t.step == {"intra_node": 4000, "inter_node": 0, "inter_group": 0}
        if r == 0:  # all-reduce of the shard over F = 2 (1000 bytes), then forwards the shard to r = 1 (1000 bytes)
            assert t.sync == {"intra_node": 1000, "inter_node": 0, "inter_group": 1000}
        else:  # last in the broadcast chain: sends nothing
            assert t.sync == {"intra_node": 0, "inter_node": 0, "inter_group": 0}


def test_a_bf16_sync_halves_the_cross_group_all_reduce_but_not_the_broadcast():
    # as above; a bfloat16 wire over fp32 shards (wire_ratio 0.5): the all-reduce over F halves, the broadcast stays
    p = Placement(F=2, R=2, S=2, gpus_per_node=4, nodes_per_group=1)
    units = Units(blocks=(1000.0, 1000.0))
    for t in traffic("fl-hsdp", p, units, A=8, wire_ratio=0.5):
        f, r, s = p.coords(t.rank)
        assert t.step == {"intra_node": 4000, "inter_node": 0, "inter_group": 0}
        expected = {"intra_node": 1000, "inter_node": 0, "inter_group": 500} if r == 0 else dict.fromkeys(t.sync, 0.0)
        assert t.sync == expected
    bw = dict(B_S=1e9, B_R=1e9, B_F=1e8)
    full = comm_terms("fl-hsdp", units, S=2, R=2, F=2, A=8, **bw)
    half = comm_terms("fl-hsdp", units, S=2, R=2, F=2, A=8, wire_ratio=0.5, **bw)
    broadcast = sum(broadcast_time(u * 8 / 2, 2, 1e9) for u in units.all()) / 8
    assert half.sync - broadcast == pytest.approx((full.sync - broadcast) / 2)
    assert half.shard == full.shard and half.replicate == full.replicate
    paper = comm_terms("fl-fsdp", units, S=2, F=2, A=8, sizes="paper", wire_ratio=0.5, B_S=1e9, B_F=1e8)
    literal = comm_time("fl-fsdp", M=units.total * 8 / units.count, L=units.count, S=2, F=2, A=8, B_S=1e9, B_F=1e8)
    assert paper.total == pytest.approx(literal - paper.sync)  # Eq. 4's term at half of M
    with pytest.raises(ConfigError, match="wire_ratio"):
        comm_terms("fl-fsdp", units, S=2, F=2, wire_ratio=0, **bw)


def test_traffic_matches_exact_time():
    # One tier per dimension: seconds = bytes * 8 / bandwidth for every term.
    p = Placement(F=2, R=2, S=4, gpus_per_node=4, nodes_per_group=2)  # S in a node, R across nodes, F across groups
    units = Units(blocks=(1e6,) * 3, root=5e5)
    bw = {"intra_node": 1e11, "inter_node": 1e10, "inter_group": 1e9}
    t = rank_traffic("fl-hsdp", p, units, rank=0, A=4)
    terms = comm_terms("fl-hsdp", units, S=4, R=2, F=2, A=4, B_S=bw["intra_node"], B_R=bw["inter_node"],
                       B_F=bw["inter_group"])
    assert terms.shard == pytest.approx(t.step["intra_node"] * 8 / bw["intra_node"])
    assert terms.replicate == pytest.approx(t.step["inter_node"] * 8 / bw["inter_node"])
    assert terms.sync == pytest.approx((t.sync["inter_group"] * 8 / bw["inter_group"]
                                        + t.sync["inter_node"] * 8 / bw["inter_node"]) / 4)


def test_traffic_rejects_inconsistent_layout():
    with pytest.raises(ConfigError, match="fl-fsdp needs R=1"):
        rank_traffic("fl-fsdp", Placement(F=2, R=2, S=1, gpus_per_node=1), Units(blocks=(1.0,)), rank=0)
    with pytest.raises(ConfigError, match="rank"):
        rank_traffic("fsdp", Placement(F=1, R=1, S=2, gpus_per_node=1), Units(blocks=(1.0,)), rank=2)


def test_even_units():
    u = even_units(1000.0, 4, root=200.0)
    assert u.blocks == (250.0,) * 4 and u.total == 1200 and u.count == 5


# ---------------------------------------------------------------------------------------------------------------------
# Compute and memory


def test_compute_time():
    assert compute_time(1e9, 1000, 6e12) == pytest.approx(1.0)  # 6 * 1e9 * 1000 / 6e12
    assert compute_time(1e9, 1000, 8e12, flops_per_param_token=8) == pytest.approx(1.0)
    with pytest.raises(ConfigError):
        compute_time(1e9, 1000, 0)


def test_memory_by_hand():
    """The planner's memory is the trainer's (tests/perf/test_memory_model.py checks every term); here its summaries."""
    shape = ModelShape(num_params=1100, num_layers=2, root_params=100, hidden_size=10, intermediate_size=20,
                       vocab_size=50)
    m = memory_per_gpu(shape, S=4, tokens=3, bytes_per_param=2)
    # Was 8 bytes per parameter (4 x the 2-byte compute dtype). The trainer keeps fp32 master weights (FSDP2 shards
    # keep the model's dtype; bf16 is the all-gather's compute copy), fp32 gradients and AdamW's two fp32 moments.
    assert states(m) == pytest.approx(16 * 1100 / 4)
    # root + 2 blocks gathered in bf16; unsharded gradients: the root's (bf16) and one block's in bf16 + its fp32
    # reduce-scatter input (was "one unit of full gradients" in the compute dtype)
    assert m.gathered_params == pytest.approx(2 * (100 + 2 * 500))
    assert m.gathered_grads == pytest.approx(2 * 100 + (2 + 4) * 500)
    # per token: 2 blocks x (2 bytes x (8h + 2kv + 4i) + 2 RMSNorm fp32 upcasts x 2 bytes x h) + outside
    # (2 bytes x 3h + 2 bytes x h); the logits are their own term now: 3 fp32 copies of the vocabulary per token
    assert m.activations == pytest.approx(3 * (2 * (2 * 180 + 2 * 2 * 10) + (2 * 30 + 2 * 10)))
    assert m.logits == pytest.approx(3 * 3 * 4 * 50)
    ckpt = memory_per_gpu(shape, S=1, tokens=3, bytes_per_param=2, activation_checkpointing=True)
    # FSDP2 copies a unit into its compute buffer even with S = 1 (was 0): the root and the block computing
    assert ckpt.gathered_params == pytest.approx(2 * (100 + 500)) and states(ckpt) == pytest.approx(16 * 1100)
    assert ckpt.activations == pytest.approx(3 * (2 * 2 * 10 + 80))  # each block keeps only its input
    assert states(memory_per_gpu(shape, S=4, tokens=3, state_bytes_per_param=8)) == pytest.approx(8 * 1100 / 4)


def test_model_shape_units():
    shape = ModelShape(num_params=1100, num_layers=2, root_params=100, hidden_size=10, intermediate_size=20,
                       vocab_size=50)
    assert shape.units(2) == Units(blocks=(1000.0, 1000.0), root=200.0)
    guessed = ModelShape.from_counts(12 * 64 * 64 * 4, 4)
    assert guessed.hidden_size == 64 and guessed.root_params == 0


def test_an_overlapped_sync_exposes_only_what_its_steps_do_not_hide():
    from flwr_sharded_perf.costmodel import CommTerms, overlapped

    blocking = CommTerms(shard=0.2, sync=0.5)  # 0.5 s per step = a 4 s sync every A = 8 steps
    assert overlapped(blocking, A=8, fragments=2, delay=0, local_step=1.0) == blocking
    half = overlapped(blocking, A=8, fragments=2, delay=1, local_step=1.0)  # 2 s per fragment, 1 s hidden of each
    assert half.sync == pytest.approx(2 * 1.0 / 8) and half.hidden == pytest.approx(0.5 - 0.25)
    assert half.total == pytest.approx(0.2 + 0.25)
    hidden = overlapped(blocking, A=8, fragments=2, delay=3, local_step=1.0)  # 3 s of steps cover a 2 s fragment
    assert hidden.sync == 0 and hidden.hidden == pytest.approx(0.5)
    with pytest.raises(ConfigError):
        overlapped(blocking, A=8, fragments=0, delay=1, local_step=1.0)
