"""The server path: shard pieces keyed by global row offset, streamed into a validating aggregator at the server.

In-process tests of the wire format and the aggregator (heterogeneous S, bad input, outer rules), and one gloo test
on real FSDP2 shards: the server path gives the decentralised ShardSync's result for the same pre-sync shards.
"""

from __future__ import annotations

import logging

import pytest
import torch

from flwr_sharded.flower import shard_files
from flwr_sharded.flower.server.aggregation import ParamSpec, ShardReply, StreamingShardAggregator
from flwr_sharded.parallel.rules import FedAdam, FedAvg, Nesterov, TrimmedMean, weighted_mean
from flwr_sharded.parallel.shard_transport import (ShardPiece, ShardPieceError, check_pieces, decode_pieces,
                                                   encode_pieces, shard_pieces)
from tests.multiproc import run_ranks

SHAPES = {"embed.weight": (7, 3), "block.0.norm": (5,), "block.0.proj": (6, 2, 2), "head.bias": (1,)}


def _model(seed: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen).to(dtype) for n, s in SHAPES.items()}


def spec_of(model: dict[str, torch.Tensor]) -> dict[str, ParamSpec]:
    """The aggregator's spec of a whole model."""
    return {name: ParamSpec(tuple(t.shape), t.dtype) for name, t in model.items()}


@torch.no_grad()
def write_pieces(named_params, pieces) -> int:
    """Write pieces into the matching local shards, every piece checked (`check_pieces`) before any is written."""
    pairs = check_pieces(named_params, pieces)
    for piece, local in pairs:
        local.copy_(piece.data)
    return len(pairs)


def mean_of(agg: StreamingShardAggregator, pieces) -> list[ShardPiece]:
    """The aggregator's new values of exactly the pieces a rank sent (same keys and shapes, the model's dtype)."""
    return [ShardPiece(p.name, p.row_offset, tuple(p.global_shape),
                       agg.result(p.name, p.row_offset, p.rows).reshape(p.data.shape).to(agg.spec[p.name].dtype))
            for p in pieces]


def _chunks(model: dict[str, torch.Tensor], S: int) -> list[list[ShardPiece]]:
    """Each rank's pieces under FSDP2's rule (torch.chunk on dim 0; trailing ranks may hold nothing)."""
    ranks: list[list[ShardPiece]] = [[] for _ in range(S)]
    for name, t in model.items():
        offset = 0
        for r, chunk in enumerate(torch.chunk(t, S, dim=0)):
            ranks[r].append(ShardPiece(name, offset, tuple(t.shape), chunk.clone()))
            offset += chunk.shape[0]
    return ranks


def _group_reply(source: str, model, S: int, weight: float, round: int = 0) -> ShardReply:
    return ShardReply(source, round, weight, [p for rank in _chunks(model, S) for p in rank])


def _expected(models_weights) -> dict[str, torch.Tensor]:
    return {n: weighted_mean([(m[n], w) for m, w in models_weights]) for n in SHAPES}


# ----- wire format ------------------------------------------------------------------------------------------------
def test_bf16_round_trip_is_lossless():
    model = _model(0, torch.bfloat16)
    model["embed.weight"][0, 0] = float("-inf")  # odd bit patterns survive too (the aggregator rejects them)
    pieces = [p for rank in _chunks(model, 2) for p in rank]
    arrays, meta = encode_pieces(pieces)
    assert {a.dtype.name for a in arrays.values()} == {"int16"}
    records = shard_files.shard_records(arrays, meta, 0, 1.0)
    for decoded in (decode_pieces(arrays, meta), decode_pieces(*shard_files.from_records(records)[:2])):
        assert [p.key for p in decoded] == [p.key for p in pieces]
        for a, b in zip(decoded, pieces):
            assert a.data.dtype == torch.bfloat16 and a.global_shape == b.global_shape
            assert torch.equal(a.data.view(torch.int16), b.data.view(torch.int16))


def test_decode_rejects_malformed_wire_data():
    arrays, meta = encode_pieces(_chunks(_model(0, torch.bfloat16), 1)[0])
    with pytest.raises(ShardPieceError, match="must travel as"):
        decode_pieces({k: v.astype("float32") for k, v in arrays.items()}, meta)
    with pytest.raises(ShardPieceError, match="malformed shard key"):
        decode_pieces({"noat": next(iter(arrays.values()))}, {"noat": "bfloat16|7,3"})


def test_pieces_are_all_checked_before_any_is_written():
    params = [(n, torch.nn.Parameter(t.clone())) for n, t in _model(0).items()]
    before = [p.detach().clone() for _, p in params]
    good = [ShardPiece(n, 0, tuple(p.shape), torch.zeros(p.shape)) for n, p in params]
    bad = good[:-1] + [ShardPiece("head.bias", 0, (1,), torch.zeros(2))]
    with pytest.raises(ShardPieceError, match="shape"):
        write_pieces(params, bad)
    with pytest.raises(ShardPieceError, match="matches no local shard"):
        write_pieces(params, good[:-1] + [ShardPiece("nope", 0, (1,), torch.zeros(1))])
    assert all(torch.equal(p, b) for (_, p), b in zip(params, before))
    assert write_pieces(params, good) == len(good)
    assert all(torch.count_nonzero(p) == 0 for _, p in params)


# ----- aggregation ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("per_rank", [False, True], ids=["group-replies", "rank-replies"])
def test_heterogeneous_shard_counts_combine_by_row(per_rank):
    """Groups with S = 1, 2 and 3 federate: every rank gets back its own rows of the weighted mean."""
    groups = {"S1": (_model(1), 1, 1.0), "S2": (_model(2), 2, 3.0), "S3": (_model(3), 3, 0.5)}
    agg = StreamingShardAggregator(FedAvg(), 0, spec=spec_of(_model(0)), complete=not per_rank)
    for source, (model, S, w) in groups.items():
        if per_rank:
            for r, pieces in enumerate(_chunks(model, S)):
                if pieces:
                    assert agg.add(ShardReply(f"{source}/rank{r}", 0, w, pieces))
        else:
            assert agg.add(_group_reply(source, model, S, w))
    agg.finalize()
    expected = _expected([(m, w) for m, _, w in groups.values()])
    for source, (model, S, _) in groups.items():
        for rank_pieces in _chunks(model, S):
            for mine, back in zip(rank_pieces, mean_of(agg, rank_pieces)):
                assert back.key == mine.key and back.data.shape == mine.data.shape
                rows = slice(mine.row_offset, mine.row_offset + mine.rows)
                torch.testing.assert_close(back.data, expected[mine.name][rows], rtol=0, atol=1e-6)


def _bad_replies():
    good = _model(9)
    reply = lambda **kw: ShardReply(kw.pop("source", "bad"), kw.pop("round", 0), kw.pop("weight", 1.0),  # noqa: E731
                                    kw.pop("pieces"))
    pieces = lambda: [p for rank in _chunks(good, 2) for p in rank]  # noqa: E731

    def replace(which, at, **changes):
        out = pieces()
        for i, p in enumerate(out):
            if p.name == which and p.row_offset == at:
                out[i] = ShardPiece(changes.get("name", p.name), changes.get("row_offset", p.row_offset),
                                    changes.get("global_shape", p.global_shape), changes.get("data", p.data))
        return out

    nan = _chunks(good, 2)[0][0].data.clone()
    nan[1, 1] = float("nan")
    inf = nan.clone()
    inf[1, 1] = float("inf")
    return {
        "unknown key": (reply(pieces=replace("embed.weight", 0, name="embed.wieght")), "unknown parameter"),
        "global shape": (reply(pieces=replace("embed.weight", 0, global_shape=(8, 3))), "global shape"),
        "trailing dims": (reply(pieces=replace("embed.weight", 0, data=torch.zeros(4, 2))), "does not fit"),
        "offset out of range": (reply(pieces=replace("embed.weight", 4, row_offset=5)), "does not fit"),
        "dtype": (reply(pieces=replace("block.0.norm", 0, data=torch.zeros(3, dtype=torch.float64))), "dtype"),
        "nan": (reply(pieces=replace("embed.weight", 0, data=nan)), "NaN or Inf"),
        "inf": (reply(pieces=replace("embed.weight", 0, data=inf)), "NaN or Inf"),
        "stale round": (reply(round=-1, pieces=pieces()), "stale"),
        "incomplete": (reply(pieces=pieces()[1:]), "incomplete"),
        "overlap": (reply(pieces=replace("embed.weight", 4, row_offset=3)), "overlap"),
        "weight": (reply(weight=float("nan"), pieces=pieces()), "weight"),
        "duplicate source": (reply(source="g0", pieces=pieces()), "already replied"),
    }


@pytest.mark.parametrize("case", list(_bad_replies()))
def test_bad_reply_is_rejected_and_the_rest_aggregated(case, caplog):
    bad, reason = _bad_replies()[case]
    spec = spec_of(_model(0))
    agg = StreamingShardAggregator(FedAvg(), 0, spec=spec)
    reference = StreamingShardAggregator(FedAvg(), 0, spec=spec)
    good = [_group_reply("g0", _model(1), 2, 1.0), _group_reply("g1", _model(2), 1, 2.0)]
    with caplog.at_level(logging.WARNING, logger="flwr_sharded.flower.server.aggregation"):
        assert agg.add(good[0])
        assert not agg.add(bad)  # between two good replies: it must not disturb either
        assert agg.add(good[1])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "rejected the reply of" in lines[0] and reason in lines[0], lines
    for reply in good:
        reference.add(reply)
    report = agg.finalize()
    reference.finalize()
    assert report.accepted == ["g0", "g1"] and report.total_weight == 3.0
    for name in SHAPES:
        assert torch.equal(agg.result(name, 0), reference.result(name, 0))
    expected = _expected([(_model(1), 1.0), (_model(2), 2.0)])
    for name in SHAPES:
        torch.testing.assert_close(agg.result(name, 0), expected[name], rtol=0, atol=1e-6)


def test_spec_learned_from_the_first_reply_and_bf16_accumulated_in_fp32():
    models = [_model(s, torch.bfloat16) for s in (1, 2)]
    agg = StreamingShardAggregator()
    assert agg.add(_group_reply("a", models[0], 2, 1.0))
    assert not agg.add(_group_reply("b", _model(3), 1, 1.0))  # fp32 against a bf16 model
    assert agg.add(_group_reply("b", models[1], 1, 3.0)) is False  # a source replies once, even after a rejection
    assert agg.add(_group_reply("c", models[1], 1, 3.0))
    agg.finalize()
    back = mean_of(agg, _chunks(models[0], 2)[1])
    assert all(p.data.dtype == torch.bfloat16 for p in back)
    exact = _expected([(models[0], 1.0), (models[1], 3.0)])
    torch.testing.assert_close(agg.result("embed.weight", 0), exact["embed.weight"], rtol=0, atol=1e-6)


def test_rows_no_valid_reply_covered_keep_the_global_model():
    spec = spec_of(_model(0))
    partial = _chunks(_model(1), 2)[0]  # rank 0 of a group; its rank 1 never replied
    agg = StreamingShardAggregator(FedAvg(), 0, spec=spec, complete=False)
    agg.add(ShardReply("g0/rank0", 0, 1.0, partial))
    with pytest.raises(RuntimeError, match="no accepted reply"):
        agg.finalize()
    agg = StreamingShardAggregator(FedAvg(), 0, spec=spec, complete=False, global_params=_model(0))
    agg.add(ShardReply("g0/rank0", 0, 1.0, partial))
    agg.finalize()
    assert torch.equal(agg.result("embed.weight", 0, 4), _model(1)["embed.weight"][:4])
    assert torch.equal(agg.result("embed.weight", 4), _model(0)["embed.weight"][4:])


def test_nonlinear_rule_is_refused():
    with pytest.raises(ValueError, match="not linear"):
        StreamingShardAggregator(TrimmedMean())


@pytest.mark.parametrize("rule_cls", [Nesterov, FedAdam])
def test_outer_rule_on_the_server_path_equals_the_rule_on_whole_tensors(rule_cls):
    rule = rule_cls()
    spec = spec_of(_model(0))
    glob = {n: t.clone() for n, t in _model(0).items()}
    whole = {n: t.clone() for n, t in _model(0).items()}
    whole_state = {n: rule.init_state(t) for n, t in whole.items()}
    state = None
    for rnd in range(3):
        members = [({n: whole[n] + 0.1 * t for n, t in _model(10 * rnd + k).items()}, float(k + 1)) for k in (1, 2)]
        agg = StreamingShardAggregator(rule, rnd, spec=spec, global_params=glob, state=state)
        for k, ((model, w), S) in enumerate(zip(members, (1, 2))):
            assert agg.add(_group_reply(f"g{k}", model, S, w, round=rnd))
        agg.finalize()
        glob, state = {n: t.clone() for n, t in agg.model().items()}, agg.state
        for n in SHAPES:
            whole[n], whole_state[n] = rule.aggregate(whole[n], [(m[n], w) for m, w in members], whole_state[n])
            torch.testing.assert_close(glob[n], whole[n], rtol=0, atol=2e-6)


# ----- windows: the model a chunk of global rows at a time ---------------------------------------------------------
def test_chunk_windows_give_the_whole_models_mean_for_groups_of_any_sharding():
    """Three groups (S = 1, 2, 3), weighted; the model cut by `plan_ranges` into chunks of at most 40 fp32 bytes;
    each chunk averaged by its own windowed aggregator from the rows `requests_for` names in each group's pieces.
    Together the chunks give the whole model's weighted mean, and each chunk's sums stay within the budget."""
    from flwr_sharded.flower.server.stream import plan_ranges, requests_for

    models, weights, shards = [_model(i) for i in range(3)], [1.0, 2.0, 5.0], [1, 2, 3]
    spec = spec_of(models[0])
    groups = [{p.key: p for rank in _chunks(m, S) for p in rank} for m, S in zip(models, shards)]
    chunks = plan_ranges(spec, 40)
    assert len(chunks) > 5
    got: dict[str, list[torch.Tensor]] = {n: [] for n in SHAPES}
    for chunk in chunks:
        window = {name: (a, b) for name, a, b in chunk}
        assert len(window) == len(chunk)  # one range per parameter in a chunk
        row_bytes = {n: 4 * torch.Size(SHAPES[n][1:]).numel() for n in SHAPES}
        assert sum((b - a) * row_bytes[n] for n, a, b in chunk) <= max(40, max(row_bytes.values()))
        agg = StreamingShardAggregator(FedAvg(), 0, spec=spec, complete=False, window=window)
        for g, (pieces, w) in enumerate(zip(groups, weights)):
            rows = [ShardPiece(pieces[k].name, pieces[k].row_offset + a, pieces[k].global_shape, pieces[k].data[a:b])
                    for k, a, b in requests_for([p.layout for p in pieces.values()], chunk)]
            assert agg.add(ShardReply(f"g{g}", 0, w, rows))
        agg.finalize()
        for name, a, b in chunk:
            got[name].append(agg.result(name, a, b - a).clone())
    expected = _expected(list(zip(models, weights)))
    for name in SHAPES:
        torch.testing.assert_close(torch.cat(got[name]).reshape(SHAPES[name]), expected[name], rtol=1e-6, atol=1e-7)


def test_a_window_rejects_rows_outside_it_and_needs_a_plain_mean():
    spec = spec_of(_model(0))
    agg = StreamingShardAggregator(FedAvg(), 0, spec=spec, complete=False, window={"embed.weight": (2, 5)})
    data = _model(0)["embed.weight"]
    assert not agg.add(ShardReply("early", 0, 1.0, [ShardPiece("embed.weight", 1, (7, 3), data[1:4])]))
    assert not agg.add(ShardReply("other", 0, 1.0, [ShardPiece("head.bias", 0, (1,), torch.zeros(1))]))
    assert "outside this aggregator's window" in agg.report.rejected["early"]
    assert agg.add(ShardReply("inside", 0, 2.0, [ShardPiece("embed.weight", 2, (7, 3), data[2:5])]))
    agg.finalize()
    torch.testing.assert_close(agg.result("embed.weight", 2, 3), data[2:5])
    with pytest.raises(KeyError, match="outside"):
        agg.result("embed.weight", 0, 3)
    for kwargs in ({"complete": True}, {"spec": None, "complete": True},
                   {"rule": Nesterov(), "global_params": _model(0)}):
        with pytest.raises(ValueError, match="window"):
            StreamingShardAggregator(**{"rule": FedAvg(), "spec": spec, "complete": False, **kwargs},
                                     window={"embed.weight": (0, 7)})
    with pytest.raises(ValueError, match="not rows of the model"):
        StreamingShardAggregator(FedAvg(), spec=spec, complete=False, window={"embed.weight": (0, 8)})


# ----- real FSDP2 shards: the server path equals the decentralised sync ------------------------------------------
def _server_path_worker(rank: int, world: int):
    import torch.distributed as dist

    from flwr_sharded.parallel.alignment import local_shard
    from flwr_sharded.parallel.sync import ShardSync
    from tests.parallel.test_sync import WEIGHTS, _perturb, _sharded_tiny_model

    topo, model = _sharded_tiny_model("fl-fsdp", 2, 1, 2)
    _perturb(model, seed=100 + rank)
    pre = shard_pieces(model.named_parameters(), clone=True)
    ShardSync(model.named_parameters(), fed_group=topo.fed_group).sync(weight=WEIGHTS[topo.fed_index])
    after = [local_shard(p).clone() for p in model.parameters()]

    write_pieces(model.named_parameters(), pre)  # back to the pre-sync shards
    restored = all(torch.equal(local_shard(p), q.data) for p, q in zip(model.parameters(), pre))
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (topo.fed_index, encode_pieces(pre)))
    agg = StreamingShardAggregator(FedAvg(), round=0)  # spec learned from the first group's reply
    for f in sorted({f for f, _ in everyone}):
        pieces = [p for g, wire in everyone if g == f for p in decode_pieces(*wire)]
        assert agg.add(ShardReply(f"group{f}", 0, WEIGHTS[f], pieces))
    agg.finalize()
    write_pieces(model.named_parameters(), mean_of(agg, pre))
    max_err = max(float((local_shard(p) - a).abs().max()) for p, a in zip(model.parameters(), after))
    return {"restored": restored, "max_err": max_err, "shard": topo.shard_index,
            "offsets": {p.name: (p.row_offset, p.rows, p.global_shape[0]) for p in pre}}


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_server_path_equals_decentralised_sync_on_fsdp2_shards():
    out = run_ranks(_server_path_worker, 4, timeout=240)
    for res in out:
        assert res["restored"]
        assert res["max_err"] < 1e-6, res["max_err"]
        for name, (offset, rows, total) in res["offsets"].items():  # FSDP2's chunk rule, S = 2
            assert offset == res["shard"] * -(-total // 2), (name, offset)


def _hsdp_offsets_worker(rank: int, world: int):
    from tests.parallel.test_sync import _sharded_tiny_model

    topo, model = _sharded_tiny_model("hsdp", 1, 2, 2)  # placements (Replicate(), Shard(0))
    pieces = shard_pieces(model.named_parameters())
    write_pieces(model.named_parameters(), pieces)
    return topo.replica_index, topo.shard_index, {p.name: (p.row_offset, p.global_shape[0]) for p in pieces}


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_hsdp_replicas_send_the_same_row_ranges():
    out = run_ranks(_hsdp_offsets_worker, 4, timeout=240)
    by_shard = {}
    for replica, shard, offsets in out:
        assert all(o == shard * -(-total // 2) for o, total in offsets.values()), offsets
        by_shard.setdefault(shard, []).append(offsets)
    assert all(a == b for a, b in by_shard.values())


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("F", [2, 4])
def test_server_memory_stays_near_one_fp32_model_whatever_F(F):
    """What the aggregator holds (peak RSS less the reply in flight) is about one fp32 model for F = 2 and 4."""
    import json
    import os
    import subprocess
    import sys

    from tests.multiproc import REPO

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "OMP_NUM_THREADS": "1"}
    # 256 MiB: large enough that the process's fixed ~10-25 MiB (allocator arenas, lazy imports) stays small beside it
    out = subprocess.run([sys.executable, "-m", "tests.flower.server_path_memory", str(F), "fp32-rank", "256"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["aggregator_x"] < 1.25, figures
    assert figures["peak_x"] < 1.5 + 0.25, figures  # the accumulator + one rank's reply (half a model, S = 2)


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("F", [2, 4])
def test_server_strategy_holds_less_than_one_fp32_model_whatever_F(F):
    """ServerShardFedAvg over whole rounds (manifests, then pulls, means and applies chunk by chunk) on the fake
    grid: its own peak RSS over its RSS before round 1 stays below one fp32 model (128 MiB model, 4 MiB chunks),
    however many groups; the fake grid's queued replies are in this process too."""
    import json
    import os
    import subprocess
    import sys

    from tests.multiproc import REPO

    out = subprocess.run([sys.executable, "-m", "tests.flower.server_strategy_memory", str(F), "128", "4"], cwd=REPO,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["accepted"] == [F, F] and figures["pull_chunks"] == 32 * F, figures
    assert max(figures["server_peak_x"]) < 1.0, figures


def test_flower_records_round_trip_and_malformed_records_are_rejected(caplog):
    from flwr.app import ConfigRecord

    from flwr_sharded.flower.shard_files import SHARD_META
    from flwr.app import RecordDict

    from flwr_sharded.flower.server.aggregation import add_content

    def reply_content(pieces, round, weight):
        return RecordDict(shard_files.shard_records(*encode_pieces(pieces), round, weight))

    models = [_model(1, torch.bfloat16), _model(2, torch.bfloat16)]
    agg = StreamingShardAggregator(FedAvg(), 3, spec=spec_of(models[0]))
    assert add_content(agg, "g0", reply_content(_group_reply("x", models[0], 2, 1.0).pieces, 3, 1.0))
    broken = reply_content(_group_reply("x", models[1], 1, 1.0).pieces, 3, 1.0)
    broken[SHARD_META] = ConfigRecord({k: "float32|7,3" for k in broken[SHARD_META].keys()})
    with caplog.at_level(logging.WARNING, logger="flwr_sharded.flower.server.aggregation"):
        assert not add_content(agg, "g1", broken)
        assert not add_content(agg, "g2", reply_content(_group_reply("x", models[1], 1, 1.0).pieces, 2, 1.0))
    assert [r.getMessage() for r in caplog.records][0].count("malformed reply") == 1
    assert "stale" in caplog.records[1].getMessage()
    assert add_content(agg, "g3", reply_content(_group_reply("x", models[1], 1, 3.0).pieces, 3, 3.0))
    agg.finalize()
    expected = _expected([(models[0], 1.0), (models[1], 3.0)])
    torch.testing.assert_close(agg.result("block.0.proj", 0), expected["block.0.proj"], rtol=0, atol=1e-6)
