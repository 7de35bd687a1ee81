"""Top-k in two levels: a central computation of the same definition (each site's weighted delta reduced, each
member's share of it selected and merged across the sites), bit-identical members, error feedback on the share, and
one share's row the only bytes that cross the sites; and a lying member of a top-k sync, flat and in two levels,
rejected on every member and named."""

from __future__ import annotations

import pytest
import torch

from flwr_sharded.parallel.sparse import HEADER_BYTES, RowLayout, kept_of
from flwr_sharded.parallel.wire import WIRES, sync_wire
from tests.multiproc import run_ranks

N, FRACTION, DECAY, SITES = 1001, 0.05, 0.9, [[0, 1], [2, 3]]  # a share of 501 and one of 500 values


def _values(rank: int, sync: int) -> tuple[torch.Tensor, float]:
    return torch.randn(N, generator=torch.Generator().manual_seed(10 * sync + rank)), 1.0 + rank


GLOBAL = torch.randn(N, generator=torch.Generator().manual_seed(99))


def _topk_worker(rank: int, world: int, merge: str, flush: bool):
    from datetime import timedelta

    import torch.distributed as dist

    from flwr_sharded.parallel.sites import SiteLayout, site_groups
    from flwr_sharded.parallel.sparse import SparseWire
    from flwr_sharded.parallel.traffic import TrafficMeter
    from flwr_sharded.parallel.workspace import Workspace

    dist.init_process_group("gloo")
    flat = dist.new_group(list(range(world)))
    groups = site_groups(SiteLayout.parse("a,a,b,b"), [list(range(world))], 0, rank, flat, timedelta(seconds=60))
    wire, workspace = SparseWire(WIRES["float32"], FRACTION, merge, DECAY), Workspace()
    total = sum(_values(r, 0)[1] for r in range(world))
    residual, out = torch.zeros(N), {"results": [], "residuals": []}
    for sync in range(2):
        x, weight = _values(rank, sync)
        with TrafficMeter() as meter:
            out["sent"] = (wire.dense() if flush and sync == 1 else wire).reduce(
                x, GLOBAL.clone(), weight / total, flat, workspace, residual, sites=groups)
        out["results"].append(x)
        out["residuals"].append(residual.clone())
        out["records"] = [(r.op, r.ranks, r.nbytes) for r in meter.records]
    x, weight = _values(rank, 0)
    with TrafficMeter() as meter:  # the flat top-k of the same values
        out["flat_sent"] = wire.reduce(x, GLOBAL.clone(), weight / total, flat, Workspace(), torch.zeros(N))
    out["flat_records"] = [(r.op, r.ranks, r.nbytes) for r in meter.records]
    return out


def _central(merge: str, flush: bool) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """The definition, share by share in float64: each site's weighted delta (`scatter-mean`: over its weight) plus
    the decayed residual, its top entries, merged over the sites; the residual is what a site did not send."""
    total = sum(_values(r, 0)[1] for r in range(4))
    part = -(-N // 2)
    bounds = [(0, part), (part, N)]
    residuals = [[torch.zeros(hi - lo, dtype=torch.float64) for lo, hi in bounds] for _ in SITES]
    results = []
    for sync in range(2):
        result = GLOBAL.double().clone()
        for j, (lo, hi) in enumerate(bounds):
            rows, weights = [], []
            for g, members in enumerate(SITES):
                D = sum((_values(m, sync)[0] - GLOBAL).double()[lo:hi] * (_values(m, 0)[1] / total) for m in members)
                S = sum(_values(m, 0)[1] / total for m in members)
                if flush and sync == 1:  # every entry: the weighted sum plus the weighted residual
                    y = D + DECAY * residuals[g][j] * (S if merge == "scatter-mean" else 1.0)
                    residuals[g][j] = torch.zeros_like(y)
                    rows.append((torch.arange(hi - lo), y))
                    weights.append(S)
                    continue
                y = (D / S if merge == "scatter-mean" else D) + DECAY * residuals[g][j]
                index = torch.topk(y.abs(), kept_of(hi - lo, FRACTION)).indices
                residuals[g][j] = y.clone()
                residuals[g][j][index] = 0.0
                rows.append((index, y[index]))
                weights.append(S)
            share = result[lo:hi]
            if flush and sync == 1:
                share += sum(v for _, v in rows)
            elif merge == "sum":
                for index, v in rows:
                    share[index] += v
            else:  # each row clipped to the lower median norm of the two, weighted mean over the senders
                norms = [v.norm() for _, v in rows]
                median = min(norms)
                num, den = torch.zeros(hi - lo, dtype=torch.float64), torch.zeros(hi - lo, dtype=torch.float64)
                for (index, v), n, S in zip(rows, norms, weights):
                    num[index] += S * min(1.0, median / n) * v
                    den[index] += S
                share += torch.where(den > 0, num / den.clamp_min(1e-300), torch.zeros_like(num))
        results.append(result)
    return results, [torch.cat(residuals[g]) for g in range(2)]


@pytest.mark.dist
@pytest.mark.parametrize("merge, flush", [("scatter-mean", False), ("sum", False), ("scatter-mean", True)],
                         ids=["scatter-mean", "sum", "scatter-mean-flush"])
def test_two_level_topk_is_its_central_definition_and_crosses_the_sites_with_one_share_row(merge, flush):
    results = run_ranks(_topk_worker, 4, merge, flush, timeout=120)
    central, site_residuals = _central(merge, flush)
    part = -(-N // 2)
    for rank, res in enumerate(results):
        for sync in range(2):
            assert torch.equal(res["results"][sync], results[0]["results"][sync]), ("members differ", rank, sync)
            err = (res["results"][sync].double() - central[sync]).abs().max().item()
            assert err <= 1e-5 * central[sync].abs().max().item(), (rank, sync, err)
        # this member's residual: its site's unsent part of its share, zeros elsewhere
        g, j = rank // 2, rank % 2
        lo, hi = (0, part) if j == 0 else (part, N)
        residual = res["residuals"][1]
        assert torch.count_nonzero(residual[:lo]) == 0 and torch.count_nonzero(residual[hi:]) == 0
        assert torch.allclose(residual[lo:hi].double(), site_residuals[g][lo:hi], atol=1e-6, rtol=1e-5)
    if flush:
        return
    # the bytes: the only exchange across the sites is the all-gather of one row of a share (501 values) with the
    # same share's member at the other site; the flat top-k all-gathers a row of all 1001 values over all four
    share_row = RowLayout(part, FRACTION, WIRES["float32"]).bytes
    flat_row = RowLayout(N, FRACTION, WIRES["float32"]).bytes
    records, flat_records = results[0]["records"], results[0]["flat_records"]
    crossing = [(r, b) for op, r, b in records if len({m // 2 for m in r}) > 1]
    assert crossing == [((0, 2), 2 * share_row)], crossing
    assert [(r, b) for op, r, b in flat_records] == [((0, 1, 2, 3), 4 * flat_row)]
    # per member across the sites: one share row to the other site's member, against the flat all-gather's full
    # row to each of the L = 2 members there; a share row is 1/L of a full row up to its header and padding
    assert abs(share_row * 2 - flat_row) <= 2 * (HEADER_BYTES + 6), (share_row, flat_row)
    across, flat_across = share_row * 1, flat_row * 2
    assert abs(across / flat_across - 1 / 4) < 0.02, (across, flat_across)
    # what reduce returns: the in-site ring (two shares of 502 fp32, the last the weight) and the share's row
    assert results[0]["sent"] == 2 * (2 - 1) * (part + 1) * 4 + share_row
    assert results[0]["flat_sent"] == 3 * flat_row


def _shard_sync_worker(rank: int, world: int):
    from datetime import timedelta

    import torch.distributed as dist

    from flwr_sharded.parallel.sites import SiteLayout, site_groups
    from flwr_sharded.parallel.sparse import SparseWire
    from flwr_sharded.parallel.sync import ShardSync
    from flwr_sharded.parallel.workspace import Workspace

    dist.init_process_group("gloo")
    flat = dist.new_group(list(range(world)))
    groups = site_groups(SiteLayout.parse("a,a,b,b"), [list(range(world))], 0, rank, flat, timedelta(seconds=60))
    start = torch.randn(N, generator=torch.Generator().manual_seed(3))  # the same on every rank
    param = torch.nn.Parameter(start.clone())
    try:
        ShardSync([("w", param)], fed_group=groups, wire=sync_wire("float32", FRACTION, restart=True),
                  error_feedback=True)
    except ValueError as exc:
        refused = str(exc)
    sync = ShardSync([("w", param)], fed_group=groups, wire=sync_wire("float32", FRACTION), error_feedback=True,
                     max_move=0)
    sync.capture_global()
    delta = _values(rank, 0)[0]
    with torch.no_grad():
        param.add_(delta)
    values = param.detach().clone()
    sync.sync(1.0 + rank)
    # the same reduction called directly: the sync feeds the two-level wire its weighted share and global values
    expected, residual = values.clone(), torch.zeros(N)
    SparseWire(WIRES["float32"], FRACTION).reduce(expected, start.clone(), (1.0 + rank) / 10, flat, Workspace(),
                                                   residual, sites=groups)
    return {"param": param.detach().clone(), "expected": expected, "refused": refused,
            "residual": sync.state.feedback.residuals["0"].clone(), "expected_residual": residual}


@pytest.mark.dist
def test_a_shard_sync_runs_top_k_in_two_levels_and_refuses_a_residual_restart():
    results = run_ranks(_shard_sync_worker, 4, timeout=120)
    for res in results:
        assert torch.equal(res["param"], results[0]["param"]), "members differ after the sync"
        assert torch.equal(res["param"], res["expected"])
        assert torch.equal(res["residual"], res["expected_residual"])
        assert "cannot reduce in two levels" in res["refused"] and "residual restart" in res["refused"]


def _lying_topk_worker(rank: int, world: int, two_level: bool) -> dict:
    """Four members syncing 2% of each delta by top-k (flat, or at sites a, a, b, b); member 2 sends 1e30, NaN or 100x
    its values to the third sync and reports itself healthy."""
    from datetime import timedelta

    import torch.distributed as dist

    from flwr_sharded.parallel.admission import SyncRejected, healthy
    from flwr_sharded.parallel.sites import SiteLayout, site_groups
    from flwr_sharded.parallel.sync import ShardSync

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    group = dist.group.WORLD
    if two_level:
        flat = dist.new_group(list(range(world)))
        group = site_groups(SiteLayout.parse("a,a,b,b"), [list(range(world))], 0, rank, flat, timedelta(seconds=60))
    base = torch.randn(30000, generator=torch.Generator().manual_seed(0))
    lying = [False]

    def scenario(lie: str | None, overlapped: bool = False) -> list:
        params = [torch.nn.Parameter(base[:20000].clone()), torch.nn.Parameter(base[20000:].clone())]
        s = ShardSync([("a", params[0]), ("b", params[1])], fed_group=group, bucket_bytes=40000,
                      wire=sync_wire("float32", 0.02), error_feedback=True)
        s.verdict = lambda *args: True if lying[0] else healthy(*args)  # the liar's verdict on itself
        s.capture_global()
        out, now = [], base.clone()
        for step in range(3):
            mine = now + 0.01 * torch.randn(30000, generator=torch.Generator().manual_seed(100 * step + rank))
            if lie is not None and step == 2 and rank == 2:
                mine = torch.full_like(mine, float(lie)) if lie != "x100" else mine * 100
                lying[0] = True
            with torch.no_grad():
                params[0].copy_(mine[:20000])
                params[1].copy_(mine[20000:])
            try:
                if overlapped:
                    s.start(1.0 + rank, overlap=True)
                    lying[0] = False
                    s.finish(timeout=60)
                else:
                    s.sync(weight=1.0 + rank)
                now = torch.cat([p.detach() for p in params])
                out.append(("adopted", now.clone()))
            except SyncRejected as exc:
                wrote = not torch.allclose(torch.cat([p.detach() for p in params]), mine, rtol=0, atol=0,
                                           equal_nan=True)
                out.append(("rejected", exc.offenders, str(exc), wrote))
            finally:
                lying[0] = False
        return out

    return {name: scenario(*args) for name, args in {
        "healthy": (None,), "1e30": ("1e30",), "nan": ("nan",), "x100": ("x100",),
        "overlapped-1e30": ("1e30", True)}.items()}


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("two_level", [False, True], ids=["flat", "two-level"])
def test_a_top_k_member_lying_about_its_values_is_rejected_everywhere_and_named(two_level):
    """The merge's clip to the median row norm would hide the liar's row (its result is plausible on the honest
    members: only the liar itself rejected it, and nobody was named); every member rejects a row far above the
    others' (`sparse.outlying_rows`), writes nothing, and the offender search names member 2, in two levels too (not
    member 3, at its site). Honest syncs are adopted, alike on every member."""
    results = run_ranks(_lying_topk_worker, 4, two_level, timeout=200)
    for rank, res in enumerate(results):
        for step, outcome in enumerate(res["healthy"]):
            assert outcome[0] == "adopted", (rank, step, outcome)
            assert torch.equal(outcome[1], results[0]["healthy"][step][1])
        for name in ("1e30", "nan", "x100", "overlapped-1e30"):
            first, second, third = res[name]
            assert first[0] == second[0] == "adopted", (name, rank)
            assert third[0] == "rejected", (name, rank, third)
            assert third[1] == [2], (name, rank, third[2])
            assert "member(s) [2] of the federation group sent it" in third[2]
            assert not third[3], (name, rank)  # nothing written (a blocking sync) or merged (an overlapped one)
