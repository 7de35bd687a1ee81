"""The shard sync between groups that shard differently (`--group-shards`), on real FSDP2 shards over gloo: every
group ends with the central token-weighted mean of the groups' full models, piece by piece, never gathering one."""

from __future__ import annotations

import pytest
import torch

from flwr_sharded.parallel.sync_plan import SyncPlan, pieces_of, shard_rows
from tests.multiproc import run_ranks

WEIGHTS = [1.0, 3.0, 2.0]  # unequal FedAvg weights per federation group


def test_pieces_refine_every_groups_cut_and_have_one_owner_in_each():
    for rows in (1, 5, 8, 12, 13):
        for layouts in ((2, 4), (2, 3), (1, 2, 3, 4), (3, 3)):
            pieces = pieces_of(rows, layouts)
            assert [a for a, _, _ in pieces] == sorted({a for a, _, _ in pieces}) and pieces[0][0] == 0
            assert pieces[-1][1] == rows and all(a < b for a, b, _ in pieces)
            for a, b, owners in pieces:
                for S, s in zip(layouts, owners):
                    start, end = shard_rows(rows, S, s)
                    assert start <= a and b <= end  # inside one shard of every group


def test_channels_of_equal_groups_are_the_shard_indices_and_unequal_ones_run_in_rounds():
    assert SyncPlan((3, 3), ((12, 2), (7,))).channels() == [(0, 0), (1, 1), (2, 2)]
    channels = SyncPlan((2, 3), ((6,),)).channels()
    assert channels == [(0, 0), (1, 1), (0, 1), (1, 2)]  # (0,0) and (1,1) share no owner: they run at once
    plan = SyncPlan((2, 4), ((8, 3), (5,)))
    for g, S in enumerate(plan.layouts):  # every element of every shard is in exactly one of its channels
        for s in range(S):
            covered = sum(end - start for ranges in plan.local_ranges(g, s).values() for _, start, end in ranges)
            assert covered == plan.shard_elements(g, s)


def _tiny_model(layouts: tuple[int, ...], R: int, intermediate_size: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    from flwr_sharded.config import ParallelConfig
    from flwr_sharded.parallel.sharding import apply_fsdp, mixed_precision_policy
    from flwr_sharded.parallel.topology import init_topology
    from flwr_sharded.training.models import transformer_blocks

    method = "fl-hsdp" if R > 1 else "fl-fsdp"
    topo = init_topology(ParallelConfig(method=method, federations=len(layouts), replicas=R,
                                        group_shards=",".join(map(str, layouts))))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=130, hidden_size=40, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=intermediate_size, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    model = apply_fsdp(model, transformer_blocks(model), topo.fsdp_mesh, mp_policy=mixed_precision_policy("fp32", "cpu"))
    return topo, model


def _perturb(model, seed: int, scale: float = 1.0) -> None:
    from flwr_sharded.parallel.alignment import local_shard

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            local_shard(p).add_(torch.randn(local_shard(p).shape, generator=gen), alpha=scale)


def _full(model) -> list[torch.Tensor]:
    """Every parameter's full tensor (a collective over the group: the test's reference, not the sync's way)."""
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _everyone_full(topo, model) -> list[tuple[int, int, list[torch.Tensor]]]:
    import torch.distributed as dist

    full = _full(model)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (topo.fed_index, topo.group_rank, full))
    return [(f, r, t) for f, r, t in everyone if r == 0]  # one copy of each group's model


def _sync_worker(rank: int, world: int, layouts: tuple[int, ...], R: int, wire: str, overlapped: bool,
                 rule: str = "fedavg", poison: bool = False):
    from flwr_sharded.parallel.rules import make_rule
    from flwr_sharded.parallel.alignment import local_shard
    from flwr_sharded.parallel.sync import ShardSync
    from flwr_sharded.parallel.traffic import TrafficMeter
    from flwr_sharded.parallel.wire import WIRES

    topo, model = _tiny_model(layouts, R)
    groups = topo.sync_groups([tuple(p.shape) for p in model.parameters()])
    sync = ShardSync(model.named_parameters(), fed_group=groups if topo.replica_index == 0 else None,
                     bucket_bytes=4000, seat=topo.seat,
                     wire=WIRES[wire], max_move=0, rule=make_rule(rule))
    start = _full(model)
    sync.capture_global()  # the global model the reduced wires (and outer optimizers) step from
    _perturb(model, seed=100 + rank, scale=0.05)  # every rank differs, replicas included
    if poison and rank == layouts[0] * R:  # group 1's first rank: NaN in one value of one piece
        with torch.no_grad():
            local_shard(next(model.parameters())).view(-1)[0] = float("nan")
    before = _everyone_full(topo, model)
    weight = WEIGHTS[topo.fed_index]
    if overlapped and topo.replica_index == 0:
        sync.start(weight, overlap=True)
        sync.finish(alpha=0.0, timeout=60)
    elif topo.replica_index == 0:
        sync.check_alignment()  # once, before the first sync; not part of one sync's traffic
        with TrafficMeter() as meter:
            sync.sync(weight)
    if topo.rep_group is not None:  # FL+HSDP: replica 0 sends the result to the other replicas
        sync.broadcast(topo.rep_group)
    after = _everyone_full(topo, model)
    group_of = {r: f for f in range(len(layouts)) for r in topo.group_ranks(f)}
    cross = 0 if overlapped or topo.replica_index else sum(rec.nbytes for rec in meter.records if len({group_of[x] for x in rec.ranks}) > 1)
    total = sum(WEIGHTS[f] for f, _, _ in before)
    expected = [sum(WEIGHTS[f] * t[i].double() for f, _, t in before) / total for i in range(len(before[0][2]))]
    central = make_rule(rule)  # element-wise: the central rule on whole tensors is the reference
    if not central.linear:
        expected = [central.aggregate(g.double(), [(t[i].double(), WEIGHTS[f]) for f, _, t in before], {})[0]
                    for i, g in enumerate(start)]
    elif rule != "fedavg":
        expected = [central.apply_mean(g.double(), m, central.init_state(g.double()))[0] for g, m in zip(start, expected)]
    if poison:  # group 1 is left out of the channel that holds its NaN, nowhere else: each value is one of the two
        kept = [(f, t) for f, _, t in before if f != 1]
        without = [sum(WEIGHTS[f] * t[i].double() for f, t in kept) / sum(WEIGHTS[f] for f, _ in kept)
                   for i in range(len(expected))]
        _, _, mine = after[0]
        healed = sum(int((torch.isclose(a.double(), w, atol=1e-6) & ~torch.isclose(a.double(), e, atol=1e-6)).sum())
                     for a, w, e in zip(mine, without, expected))
        either = all(bool((torch.isclose(a.double(), w, atol=1e-6) | torch.isclose(a.double(), e, atol=1e-6)).all())
                     for a, w, e in zip(mine, without, expected))
        return {"healed": healed, "either": either, "finite": all(bool(torch.isfinite(a).all()) for a in mine),
                "left_out": sync.left_out, "same": [all(torch.equal(a, b) for a, b in zip(mine, full))
                                                    for _, _, full in after]}
    errors = [max(float((t.double() - e).abs().max()) for t, e in zip(full, expected)) for _, _, full in after]
    moved = max(float((b.double() - e).abs().max()) for _, _, full in before for b, e in zip(full, expected))
    shards = [local_shard(p).clone() for p in model.parameters()]
    return {"errors": errors, "moved": moved, "coords": (topo.fed_index, topo.replica_index, topo.shard_index),
            "cross_group_bytes": cross, "buffer_bytes": sync.layout.views()[0][0].untyped_storage().nbytes(),
            "shapes": [tuple(p.shape) for p in model.parameters()],
            "shards": shards, "channels": len(sync.layout.channels), "same": [all(torch.equal(a, b) for a, b in
                                                                          zip(after[0][2], full))
                                                                      for _, _, full in after]}


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layouts", [(1, 2), (2, 4), (2, 3, 4)], ids=["S=1,2", "S=2,4", "S=2,3,4"])
def test_unequal_groups_end_with_the_central_weighted_mean(layouts):
    """... and each rank sends across groups exactly the cost model's bytes (its channels' ring all-reduces, and per
    channel its weight, verdict and vote), holding no more than its shards and one bucket."""
    from flwr_sharded.parallel.admission import ADMISSION_BYTES, VOTE_BYTES
    from flwr_sharded_perf.traffic_report import ring_bytes_sent
    from flwr_sharded_perf.unequal_sync_cost import unequal_sync

    out = run_ranks(_sync_worker, sum(layouts), layouts, 1, "float32", False, timeout=240)
    model = unequal_sync([(1, S) for S in layouts], out[0]["shapes"], bytes_per_param=4, B_F=1e9)
    for res in out:
        assert max(res["errors"]) < 1e-6, res["errors"]
        assert all(res["same"])  # every group holds bit-identical full models
        f, _, s = res["coords"]
        control = res["channels"] * (len(layouts) * ADMISSION_BYTES + VOTE_BYTES)
        payload = model.rank_bytes[f][s] / ring_bytes_sent("all_reduce", 1.0, len(layouts))  # the meter counts payload
        assert res["cross_group_bytes"] == pytest.approx(payload + control, abs=1e-6)
        assert res["buffer_bytes"] <= 4000
    assert out[0]["moved"] > 1e-2  # the groups did differ: the check could fail
    assert max(r["channels"] for r in out) > 1  # a rank of the smaller S averages with several of the larger


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("wire,overlapped,tolerance", [("int8", False, 2e-3), ("float32", True, 1e-6)],
                         ids=["int8", "overlapped"])
def test_unequal_groups_int8_and_overlapped_syncs_equal_the_central_mean(wire, overlapped, tolerance):
    """int8: each delta is rounded to its block's step (max |delta| / 127, deltas of about 0.05 x 4 sigma), summed in
    fp32: the mean is within a step of the exact one; fp32 overlapped: exact."""
    out = run_ranks(_sync_worker, 6, (2, 4), 1, wire, overlapped, timeout=240)
    for res in out:
        assert max(res["errors"]) < tolerance, res["errors"]
        assert all(res["same"])
    assert out[0]["moved"] > 20 * tolerance


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_unequal_fl_hsdp_replicas_end_bit_identical():
    out = run_ranks(_sync_worker, 6, (1, 2), 2, "float32", False, timeout=240)
    for res in out:
        assert max(res["errors"]) < 1e-6
    by_seat: dict[tuple[int, int], list] = {}
    for res in out:
        f, _, s = res["coords"]
        by_seat.setdefault((f, s), []).append(res["shards"])
    for replicas in by_seat.values():
        assert len(replicas) == 2 and all(torch.equal(a, b) for a, b in zip(*replicas))


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_unequal_groups_step_an_outer_optimizer_as_the_central_rule_on_whole_tensors():
    out = run_ranks(_sync_worker, 3, (1, 2), 1, "float32", False, "nesterov", timeout=240)
    for res in out:
        assert max(res["errors"]) < 1e-6, res["errors"]
        assert all(res["same"])


def test_reseat_carries_the_outer_state_element_by_element():
    """A sync re-planned for another seat (a round whose members shard differently) keeps every element's global
    value and rule state, and the rule's per-bucket scalars."""
    from flwr_sharded.parallel.rules import make_rule
    from flwr_sharded.parallel.sync import ShardSync
    from flwr_sharded.parallel.sync_plan import Seat

    params = [(f"p{i}", torch.randn(rows, 3)) for i, rows in enumerate((8, 5, 1))]
    sync = ShardSync(params, fed_group=None, bucket_bytes=40, rule=make_rule("fedadam"),
                     seat=Seat((1, 2), group=0, shard=0))  # S = 1 next to S = 2: two channels, whole tensors here
    assert len(sync.layout.channels) == 2
    sync.capture_global()
    for state, g in zip(sync.state.rule_state, sync.state.shards):
        state["m"].copy_(2 * g)
        state["t"].fill_(7)
    old = [b.segments for b in sync.layout.buckets]
    sync.reseat(None, None)
    assert [b.segments for b in sync.layout.buckets] != old and len(sync.layout.channels) == 1
    for bucket, g, state in zip(sync.layout.buckets, sync.state.shards, sync.state.rule_state):
        for seg in bucket.segments:
            expected = params[seg.shard][1].view(-1)[seg.start:seg.end]
            assert torch.equal(g[seg.offset:seg.offset + seg.end - seg.start], expected)
        assert torch.equal(state["m"], 2 * g) and float(state["t"]) == 7


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_unequal_groups_median_and_bf16_equal_the_central_computation():
    """The median all-gathers each channel's pieces from every group (F = 3: a value of each); bf16 sends the deltas
    rounded to 8 bits of mantissa (deltas of about 0.05 x 4 sigma: within 1e-3)."""
    for res in run_ranks(_sync_worker, 6, (1, 2, 3), 1, "float32", False, "median", timeout=240):
        assert max(res["errors"]) < 1e-6 and all(res["same"]), res["errors"]
    for res in run_ranks(_sync_worker, 3, (1, 2), 1, "bfloat16", False, timeout=240):
        assert max(res["errors"]) < 1e-3 and all(res["same"]), res["errors"]


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_member_with_nan_in_one_piece_is_left_out_of_that_channel_only_and_healed():
    out = run_ranks(_sync_worker, 3, (1, 2), 1, "float32", False, "fedavg", True, timeout=240)
    for res in out:
        assert res["finite"] and res["either"] and all(res["same"])
        assert res["healed"] > 0  # the poisoned channel's values are the mean of the others
    assert [1] in [res["left_out"] for res in out] and [] in [res["left_out"] for res in out]


def _other_model_worker(rank: int, world: int):
    from flwr_sharded.parallel.alignment import ShardAlignmentError

    topo, model = _tiny_model((1, 2), 1, intermediate_size=64 if rank == 0 else 72)
    try:
        topo.sync_groups([tuple(p.shape) for p in model.parameters()])
    except ShardAlignmentError as exc:
        return str(exc)
    return ""


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_group_with_another_model_is_refused_before_any_channel():
    out = run_ranks(_other_model_worker, 3)
    assert all("build different models" in msg and ("groups 0 and 1" in msg or "groups 1 and 0" in msg) for msg in out)
