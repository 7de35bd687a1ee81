"""A bfloat16 wire for the shard sync: the weighted delta from the global model is all-reduced, not the shards."""

from __future__ import annotations

import io

import pytest
import torch

from flwr_sharded.parallel.admission import VOTE_BYTES
from flwr_sharded.parallel.wire import WIRES, wire_of
from tests.multiproc import run_ranks
from tests.parallel.test_sync import _sharded_tiny_model, central_mean

WEIGHTS = {0: 1.0, 1: 3.0, 2: 2.0}  # unequal FedAvg weights per federation group
BF16_EPS = 2.0**-8  # relative rounding error of one bfloat16 rounding (8 significant bits, round to nearest)


def _perturb(model, seed: int, scale: float) -> None:
    from flwr_sharded.parallel.alignment import local_shard

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            shard = local_shard(p)
            shard.add_(scale * torch.randn(shard.shape, generator=gen))


def _fedavg_worker(rank: int, world: int, method: str, F: int, R: int, S: int):
    """Two bf16-wire FedAvg syncs, each against the weighted mean of the groups' shards computed centrally."""
    from flwr_sharded.parallel.alignment import local_shard
    from flwr_sharded.parallel.sync import ShardSync
    from flwr_sharded.parallel.traffic import TrafficMeter

    topo, model = _sharded_tiny_model(method, F, R, S)
    replica0 = topo.replica_index == 0
    sync = ShardSync(model.named_parameters(), fed_group=topo.fed_group if replica0 else None, bucket_bytes=4096,
                     wire=WIRES["bfloat16"])
    if replica0:
        sync.capture_global()
        sync.check_alignment()
    rounds = []
    # Round 2's deltas are 1000x smaller than the shards: rounding the shards (a naive bf16 all-reduce) or deltas
    # from a stale global model (round 1's) would miss its tolerance by far.
    for round_, scale in enumerate((1.0, 1e-3)):
        global_ = [local_shard(p).clone() for p in model.parameters()]  # the last sync's result (or the start)
        _perturb(model, seed=100 * round_ + rank, scale=scale)  # every rank differs, replicas included
        before = [local_shard(p).clone() for p in model.parameters()]
        expected, sources = central_mean(topo, before, WEIGHTS)
        global_is_mean = None
        with TrafficMeter() as meter:
            stats = sync.sync(weight=WEIGHTS[topo.fed_index]) if replica0 else None
            if topo.rep_group is not None:  # FL+HSDP: replica 0 sends the result to the other replicas
                sync.broadcast(topo.rep_group)
        after = [local_shard(p).clone() for p in model.parameters()]
        if replica0:  # the kept global model is the new mean, bit for bit
            global_is_mean = all(torch.equal(g, torch.cat([s.float() for s in segs]))
                           for g, (_, segs, _) in zip(sync.state.shards, sync.layout.views()))
        rounds.append({
            "max_err": max(float((a.double() - e).abs().max()) for a, e in zip(after, expected)),
            "max_delta": max(float((b[i] - g).abs().max()) for _, b in sources for i, g in enumerate(global_)),
            "after": after, "bytes": stats.bytes if stats else 0, "global_is_mean": global_is_mean,
            "all_reduce_bytes": sum(r.nbytes for r in meter.records if r.op == "all_reduce"),
            "shard_bytes": sum(t.numel() * t.element_size() for t in before)})
    return {"coords": (topo.fed_index, topo.replica_index, topo.shard_index), "rounds": rounds}


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", [("fl-fsdp", 3, 1, 1), ("fl-hsdp", 2, 2, 1)], ids=["fl-fsdp-F3", "fl-hsdp-R2"])
def test_bf16_wire_fedavg_equals_the_weighted_mean_within_bf16_rounding_of_the_deltas(layout):
    method, F, R, S = layout
    out = run_ranks(_fedavg_worker, F * R * S, method, F, R, S)
    for round_ in range(2):
        for res in out:
            r = res["rounds"][round_]
            # F weighted deltas each rounded once, F-1 bf16 additions: each error <= eps * max|delta| (weights sum 1)
            tolerance = (2 * F - 1) * BF16_EPS * r["max_delta"] + 1e-6
            assert r["max_err"] <= tolerance, (round_, res["coords"], r["max_err"], tolerance)
            if res["coords"][1] == 0:
                assert r["global_is_mean"]
                assert r["bytes"] * 2 == r["shard_bytes"]  # half of the fp32 sync's payload (= the shards' bytes)
                assert r["all_reduce_bytes"] == r["shard_bytes"] // 2 + VOTE_BYTES  # + the vote
            else:
                assert r["bytes"] == 0 and r["all_reduce_bytes"] == 0
        # every rank holding a shard index, in every group and replica, ends bit-identical
        by_shard: dict[int, list] = {}
        for res in out:
            by_shard.setdefault(res["coords"][2], []).append(res["rounds"][round_]["after"])
        for shards in by_shard.values():
            for other in shards[1:]:
                assert all(torch.equal(x, y) for x, y in zip(shards[0], other))


def _nesterov_worker(rank: int, world: int, F: int, S: int):
    """The same two Nesterov (DiLoCo) syncs over an fp32 wire and over a bf16 wire, on two copies of one model."""
    from flwr_sharded.parallel.rules import Nesterov
    from flwr_sharded.parallel.alignment import local_shard
    from flwr_sharded.parallel.sync import ShardSync

    runs = {}
    for wire in (None, torch.bfloat16):
        topo, model = _sharded_tiny_model("fl-fsdp", F, 1, S)
        sync = ShardSync(model.named_parameters(), fed_group=topo.fed_group, bucket_bytes=4096, rule=Nesterov(),
                         wire=None if wire is None else wire_of(wire))
        sync.capture_global()
        deltas, nbytes = [], []
        for round_ in range(2):
            _perturb(model, seed=100 * round_ + rank, scale=0.1)  # the same noise in both runs
            deltas.append(max(float((torch.cat([s.float() for s in segs]) - g).abs().max())
                              for g, (_, segs, _) in zip(sync.state.shards, sync.layout.views())))
            nbytes.append(sync.sync(weight=WEIGHTS[topo.fed_index]).bytes)
        runs[str(wire)] = {"after": [local_shard(p).clone() for p in model.parameters()], "bytes": nbytes,
                           "max_delta": max(deltas)}
    return {"shard": topo.shard_index, "runs": runs}


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_nesterov_with_a_bf16_wire_stays_close_to_the_fp32_wire_over_two_syncs():
    F, S = 2, 2
    out = run_ranks(_nesterov_worker, F * S, F, S)
    max_delta = max(res["runs"]["torch.bfloat16"]["max_delta"] for res in out)
    mean_error = (2 * F - 1) * BF16_EPS * max_delta  # one sync's error of the mean (see the FedAvg test)
    # Nesterov (lr 0.7, beta 0.9) turns mean errors e1, e2 of two syncs into at most
    # lr (1 + beta + beta^2) e1 + lr (1 + beta) e2 < 3.3 e of the global model
    bound = 3.3 * mean_error + 1e-6
    for res in out:
        fp32, bf16 = res["runs"]["None"], res["runs"]["torch.bfloat16"]
        err = max(float((a - b).abs().max()) for a, b in zip(fp32["after"], bf16["after"]))
        assert 0 < err <= bound, (err, bound)  # the wire was bf16 (not bit-identical to fp32), and close
        assert all(2 * b == f for b, f in zip(bf16["bytes"], fp32["bytes"]))
    for wire in ("None", "torch.bfloat16"):  # groups end bit-identical per shard index
        for s in range(S):
            same = [res["runs"][wire]["after"] for res in out if res["shard"] == s]
            assert all(torch.equal(x, y) for x, y in zip(same[0], same[1]))


def test_trimmed_mean_with_a_reduced_wire_is_refused():
    from flwr_sharded.parallel.rules import TrimmedMean
    from flwr_sharded.parallel.sync import ShardSync

    with pytest.raises(ValueError, match="TrimmedMean is not linear.*bfloat16"):
        ShardSync([("a", torch.zeros(4))], fed_group=None, rule=TrimmedMean(), wire=WIRES["bfloat16"])
    ShardSync([("a", torch.zeros(4))], fed_group=None, rule=TrimmedMean(), wire=WIRES["float32"])  # the shards'
    with pytest.raises(ValueError, match="needs fp32 shards"):
        ShardSync([("a", torch.zeros(4, dtype=torch.float64))], fed_group=None, wire=WIRES["bfloat16"])


def test_bf16_wire_keeps_the_global_model_for_fedavg_and_its_outer_state_round_trips():
    from flwr_sharded.parallel.rules import Nesterov
    from flwr_sharded.parallel.sync import ShardSync

    def params(seed: int) -> list[tuple[str, torch.Tensor]]:
        gen = torch.Generator().manual_seed(seed)
        return [("a", torch.randn(10, generator=gen)), ("b", torch.randn(7, 3, generator=gen))]

    assert not ShardSync(params(0), fed_group=None).keeps_global
    for rule in (None, Nesterov()):
        named = params(0)
        sync = ShardSync(named, fed_group=None, bucket_bytes=32, rule=rule, wire=WIRES["bfloat16"])
        assert sync.keeps_global and sync.delta
        sync.capture_global()
        assert sync.state.shards is not None and len(sync.layout.buckets) == 4
        buffer = io.BytesIO()
        torch.save(sync.state.state_dict(), buffer)  # as a checkpoint holds it
        buffer.seek(0)
        other = ShardSync(params(1), fed_group=None, bucket_bytes=32, rule=rule, wire=WIRES["bfloat16"])
        other.state.load_state_dict(torch.load(buffer))
        flat = torch.cat([t.reshape(-1) for _, t in named])
        assert torch.equal(torch.cat(other.state.shards), flat)
        assert [sorted(s) for s in other.state.rule_state] == [sorted(s) for s in sync.state.rule_state]
    # the server path's last step makes the mean (the current shards) the new global model, for FedAvg too
    named = params(0)
    sync = ShardSync(named, fed_group=None, bucket_bytes=32, wire=WIRES["bfloat16"])
    sync.capture_global()
    with torch.no_grad():
        for _, t in named:
            t.add_(1.0)
    sync.step_rule()
    assert torch.equal(torch.cat(sync.state.shards), torch.cat([t.reshape(-1) for _, t in named]))
