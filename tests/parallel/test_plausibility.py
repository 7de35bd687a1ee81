"""A member that lies about its own verdict cannot make the others adopt its values, and is named (CPU, gloo).

The move bound and the offender's judgement are checked on their own; then three ranks, each a federation group of
S = 1, sync twice honestly (the history) and a third time with rank 2 lying: it sends 1e30, NaN or 100x its values
while reporting itself healthy. Blocking and overlapped syncs, fp32 and int8 wires.
"""

from __future__ import annotations

import math

import pytest
import torch

from flwr_sharded.parallel import plausibility
from flwr_sharded.parallel.offender import judge
from flwr_sharded.parallel.plausibility import MOVE_HISTORY, SAMPLE, MoveBound
from flwr_sharded.parallel.wire import wire_of
from tests.multiproc import run_ranks


def test_the_bound_starts_at_the_bucket_norm_then_follows_the_median_of_adopted_moves_per_token():
    bound = MoveBound(10.0)
    mine = [torch.full((4,), 1.0)]  # norm 2
    bound.begin(2.0)
    assert bound.allowed(0, 2.0) == pytest.approx(20.0)
    assert bound.plausible(0, [torch.full((4,), 1.5)], mine)  # move 1
    assert not bound.plausible(0, [torch.full((4,), 12.0)], mine)  # move 22 > 20
    bound.discard()
    assert bound.allowed(0, 2.0) == pytest.approx(20.0)  # a rejected sync leaves no move behind
    bound.begin(2.0)
    bound.plausible(0, [torch.full((4,), 1.5)], mine)
    bound.record()  # 1 / 2 tokens
    bound.begin(4.0)  # a period twice as long may move twice as far
    assert bound.allowed(0, 2.0) == pytest.approx(20.0)
    for move in [3.0] * MOVE_HISTORY:
        bound._pending[0] = move
        bound.record()
    assert bound.allowed(0, 2.0) == pytest.approx(120.0)  # only the last MOVE_HISTORY moves count
    bound.begin(1.0)
    assert bound.plausible(0, [torch.full((4,), 3.0 / 2 + 1e-7)], [torch.full((4,), 3.0 / 2)])
    bound.record()
    assert list(bound._moves[0])[-1] == 3.0  # rounding-sized moves are not kept
    assert not bound.plausible(0, [torch.tensor([1.0, 1.0, float("nan"), 1.0])], mine)
    bound.begin(1.0, judges=False)  # its own values are not sound: it cannot judge
    assert bound.plausible(0, [torch.tensor([1.0, 1.0, float("nan"), 1.0])], mine)


def test_the_norms_measured_before_the_reduction_judge_as_the_ones_measured_after():
    g = torch.Generator().manual_seed(2)
    buckets = [[torch.randn(n, generator=g) for n in sizes] for sizes in ((100, 3000), (5,), (), (7, 9, 11))]
    norms = plausibility.bucket_norms(buckets)
    assert norms == pytest.approx([float(torch.cat(b).norm()) if b else 0.0 for b in buckets], rel=1e-6)
    for scale, expected in ((1.0 + 1e-3, True), (30.0, False)):
        fresh, given = MoveBound(10.0), MoveBound(10.0)
        fresh.begin(1.0)
        given.begin(1.0, own_norms=norms)
        for k in (0, 1, 3):
            means = [t * scale for t in buckets[k]]
            assert fresh.plausible(k, means, buckets[k]) is given.plausible(k, means, buckets[k]) is expected
        assert fresh._pending == pytest.approx(given._pending)


def test_the_sampled_move_reads_views_built_once_per_bucket_and_offset():
    import random

    g = torch.Generator().manual_seed(3)
    sizes = [plausibility.EXACT_BELOW // 3 + extra for extra in (0, 5, 4099)]  # a sampled bucket of 3 segments
    mine = [torch.randn(n, generator=g) for n in sizes]
    flat = torch.cat(mine) + 0.01 * torch.randn(sum(sizes), generator=g)  # the result's buffer
    means = list(flat.split(sizes))
    bound = MoveBound(10.0)
    bound._offsets = random.Random(5)
    draws = random.Random(5)
    for _ in range(3):
        bound.begin(1.0, own_norms=plausibility.bucket_norms([mine]))
        assert bound.plausible(0, means, mine)
        expected = plausibility._move(means, mine, every=SAMPLE, offset=draws.randrange(SAMPLE))
        assert bound._pending[0] == pytest.approx(expected, rel=1e-5)
        flat.add_(0.001)  # the next sync's result, in the same buffer: the cached views see it
    views = bound._samples[0][2]
    assert 1 <= len(views) <= 3 and all(v[0][0].data_ptr() >= flat.data_ptr() for v in views.values())
    other = [m.clone() for m in means]  # the bucket's views were rebuilt: its cached blocks are dropped
    bound.begin(1.0)
    assert bound.plausible(0, other, mine) and bound._samples[0][0] is other and len(bound._samples[0][2]) == 1


def test_measured_norms_serve_as_the_finiteness_verdict_and_an_overflowed_one_is_looked_at_again():
    from flwr_sharded.parallel.admission import healthy

    huge = [torch.full((4,), 2e19)]  # finite values whose norm overflows fp32 (their sum does not)
    assert plausibility.bucket_norms([huge]) == [math.inf] and healthy(huge, 1.0, None, [math.inf]) is True
    nan = [torch.tensor([1.0, float("nan")])]
    assert healthy(nan, 1.0, None, plausibility.bucket_norms([nan])) is False
    assert healthy([torch.ones(3)], 1e9, 10.0, [1.7]) is False  # the weight is out of bounds
    assert MoveBound(0.0).enabled is False
    assert MoveBound(10.0).allowed(1, 0.0) == math.inf  # nothing to scale a bound by


def test_a_sparse_huge_value_is_caught_by_the_norms_whatever_the_sample():
    bound = MoveBound(10.0)
    mine = [torch.randn(plausibility.EXACT_BELOW, generator=torch.Generator().manual_seed(0))]  # a sampled bucket
    spiked = mine[0].clone()
    spiked[12345] = 1e30 / 3
    for _ in range(8):  # whichever blocks the sample draws
        bound.begin(1.0)
        assert not bound.plausible(0, [spiked], mine)


def test_the_sampled_move_estimates_the_exact_one():
    g = torch.Generator().manual_seed(1)
    segments = [torch.randn(n, generator=g) for n in (100, 70000, 3, 250000, 20000)]
    moved = [s + 0.01 * torch.randn(s.shape, generator=g) for s in segments]
    exact = plausibility._move(moved, segments, every=1, offset=0)
    assert exact == pytest.approx(float(torch.cat([m - s for m, s in zip(moved, segments)]).norm()), rel=1e-5)
    estimates = [plausibility._move(moved, segments, every=SAMPLE, offset=o) for o in range(SAMPLE)]
    assert sum(e * e for e in estimates) / SAMPLE == pytest.approx(exact * exact, rel=1e-4)  # every element once
    assert all(0.7 * exact < e < 1.3 * exact for e in estimates), (exact, estimates)


@pytest.mark.parametrize("case, expected", [
    ("honest", set()), ("huge", {2}), ("nan", {2}), ("two-liars", set()), ("wrote-it", {2}), ("huge-from-writer",
                                                                                             set()),
])
def test_the_judgement_names_only_the_member_whose_values_alone_explain_the_rejection(case, expected):
    torch.manual_seed(0)
    base = torch.randn(64)
    gathered = [base + 0.01 * torch.randn(64) for _ in range(4)]
    intact = True
    if case in ("huge", "two-liars", "huge-from-writer"):
        gathered[2] = torch.full((64,), 1e30)
    if case == "two-liars":
        gathered[3] = torch.full((64,), -1e30)
    if case in ("nan", "wrote-it"):
        gathered[2][5] = float("nan")
    if case in ("wrote-it", "huge-from-writer"):
        intact = False  # member 0 wrote the bucket: it can still tell NaN, not a move
    assert judge(gathered, [1.0, 2.0, 3.0, 4.0], 0, intact, MoveBound(10.0), 0) == expected
    assert 2 not in judge(gathered, [1.0, 2.0, 0.0, 4.0], 0, intact, MoveBound(10.0), 0)  # left out: not judged


def _lying_worker(rank: int, world: int) -> dict:
    from datetime import timedelta

    import torch.distributed as dist

    from flwr_sharded.parallel.admission import SyncRejected, healthy
    from flwr_sharded.parallel.sync import ShardSync

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    group = dist.group.WORLD
    lying = [False]
    base = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    weights = [1.0, 2.0, 3.0]

    def values(step: int, member: int) -> torch.Tensor:
        return base + 0.01 * torch.randn(3000, generator=torch.Generator().manual_seed(100 * step + member))

    def scenario(lie: str | None, *, wire: torch.dtype | None = None, overlapped: bool = False,
                 max_move: float = 10.0) -> list:
        params = [torch.nn.Parameter(base[:2000].clone()), torch.nn.Parameter(base[2000:].clone())]
        s = ShardSync([("a", params[0]), ("b", params[1])], fed_group=group, bucket_bytes=4000,
                      wire=None if wire is None else wire_of(wire), max_move=max_move)
        s.verdict = lambda *args: True if lying[0] else healthy(*args)  # the liar's verdict on itself
        s.capture_global()
        out = []
        for step in range(3):
            mine = values(step, rank)
            with torch.no_grad():
                if lie is not None and step == 2 and rank == 2:
                    mine = torch.full_like(mine, float(lie)) if lie != "x100" else mine * 100
                    lying[0] = True
                params[0].copy_(mine[:2000])
                params[1].copy_(mine[2000:])
            try:
                if not overlapped:
                    s.sync(weight=weights[rank])
                else:
                    s.start(weights[rank], overlap=True)
                    lying[0] = False
                    s.finish(timeout=60)
                out.append(("adopted", torch.cat([p.detach() for p in params])))
            except SyncRejected as exc:
                now = torch.cat([p.detach() for p in params])
                out.append(("rejected", exc.offenders, str(exc), torch.allclose(now, mine, rtol=0, atol=0,
                                                                                equal_nan=True)))
            finally:
                lying[0] = False
        return out

    central = [sum(w * values(step, j) for j, w in enumerate(weights)) / sum(weights) for step in range(3)]
    out = {"central": central}
    for name, kwargs in {"healthy-unchecked": dict(lie=None, max_move=0.0), "healthy": dict(lie=None),
                         "1e30": dict(lie="1e30"), "nan": dict(lie="nan"), "x100": dict(lie="x100"),
                         "int8-1e30": dict(lie="1e30", wire=torch.int8),
                         "overlapped-1e30": dict(lie="1e30", overlapped=True),
                         "overlapped-int8-x100": dict(lie="x100", overlapped=True, wire=torch.int8)}.items():
        out[name] = scenario(**kwargs)
    return out


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_a_lying_member_is_rejected_on_every_rank_and_named():
    results = run_ranks(_lying_worker, 3, timeout=200)
    central = results[0]["central"]
    for rank, res in enumerate(results):
        healthy, unchecked = res["healthy"], res["healthy-unchecked"]
        for step in range(3):
            assert healthy[step][0] == "adopted"
            assert torch.equal(healthy[step][1], unchecked[step][1])  # the check changes no healthy result
            assert torch.allclose(healthy[step][1], central[step], atol=1e-6)
        for name in ("1e30", "nan", "x100", "int8-1e30", "overlapped-1e30", "overlapped-int8-x100"):
            first, second, third = res[name]
            assert first[0] == second[0] == "adopted", name
            assert third[0] == "rejected", (name, third)
            assert third[1] == [2], (name, rank, third[2])  # every rank names the liar
            assert "member(s) [2] of the federation group sent it" in third[2]
            assert third[3], (name, rank)  # a rejected blocking sync wrote nothing; an overlapped one merged nothing


def test_a_bucket_is_judged_with_one_host_read_and_the_figures_of_separate_ones(monkeypatch):
    g = torch.Generator().manual_seed(5)
    mine = [torch.randn(n, generator=g) for n in (300, 4000, 17)]
    cases = [[t * 1.01 for t in mine], [t * 40.0 for t in mine], [t.bfloat16() for t in mine]]
    expected = []
    for means in cases:  # the figures as separate reads give them: norms, move, bound
        norm = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(means))))
        own = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(mine))))
        move = plausibility._distance(*plausibility._blocks(means, mine, every=1, offset=0), 1)
        allowed = 10.0 * own
        expected.append((abs(norm - own) <= allowed and move <= allowed, move))
    reads = []
    for name in ("tolist", "item", "__float__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _f=original, _n=name: reads.append(_n) or _f(self, *a))
    for means, (verdict, move) in zip(cases, expected):
        bound = MoveBound(10.0)
        bound.begin(1.0)
        reads.clear()
        assert bound.plausible(0, means, mine) is verdict
        assert reads == ["tolist"]
        assert bound._pending.get(0) == (move if verdict else None)
