"""A decentralised sync admits only healthy members with weights in bounds, and adopts only finite results."""

from __future__ import annotations

import logging

import pytest
import torch

from flwr_sharded.parallel.admission import all_finite, healthy
from flwr_sharded.parallel.wire import wire_of
from tests.multiproc import run_ranks

WEIGHTS = [1.0, 3.0, 2.0]


def _values(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    return [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen)]


def _admission_worker(rank: int, world: int):
    from datetime import timedelta

    import torch.distributed as dist

    from flwr_sharded.parallel.admission import SyncRejected, commit_vote
    from flwr_sharded.parallel.sync import ShardSync

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("flwr_sharded.parallel.admission").addHandler(handler)

    def run(case: str, *, overlapped: bool = False, wire: torch.dtype | None = None):
        params = [torch.nn.Parameter(v) for v in _values(0 if wire is not None else rank)]
        weight = WEIGHTS[rank]
        sync = ShardSync([(f"p{i}", p) for i, p in enumerate(params)], fed_group=dist.group.WORLD,
                         wire=None if wire is None else wire_of(wire))
        sync.max_weight = 10.0
        if wire is not None:  # the last global model (the same everywhere), then some local steps
            sync.capture_global()
            with torch.no_grad():
                for p, step in zip(params, _values(10 + rank)):
                    p.add_(0.1 * step)
        with torch.no_grad():
            if rank == 2 and case in ("nan", "liar", "all-nan"):
                params[1][3] = float("nan")
            if case == "all-nan":
                params[0][0, 0] = float("inf")
        if rank == 2 and case in ("inflated", "absurd"):
            weight = 1e12 if case == "inflated" else 1e300
        if rank == 2 and case == "liar":  # claims to be healthy and sends its NaN
            sync.verdict = lambda *args: True
        before = [p.detach().clone() for p in params]
        try:
            if overlapped:
                sync.start(weight, overlap=True)
                stats = sync.finish(timeout=30)
            else:
                stats = sync.sync(weight)
        except SyncRejected as exc:
            return {"rejected": str(exc), "before": before}
        return {"after": [p.detach().clone() for p in params], "total": stats.total_weight, "before": before,
                "left_out": sync.left_out}

    out = {case: run(case) for case in ("nan", "inflated", "absurd", "liar", "all-nan")}
    out["nan-overlapped"] = run("nan", overlapped=True)
    out["nan-int8-overlapped"] = run("nan", overlapped=True, wire=torch.int8)
    out["nan-overlapped-liar"] = run("liar", overlapped=True)
    out["lines"] = lines
    out["commit-vote"] = [commit_vote(True, dist.group.WORLD, torch.device("cpu")),
                          commit_vote(rank != 1, dist.group.WORLD, torch.device("cpu"))]
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_admission_worker, 3, timeout=120)


@pytest.mark.dist
@pytest.mark.parametrize("case", ["nan", "inflated", "absurd", "nan-overlapped"])
def test_a_member_that_is_not_finite_or_out_of_bounds_is_left_out_and_healed(results, case):
    expected = [(WEIGHTS[0] * a + WEIGHTS[1] * b) / (WEIGHTS[0] + WEIGHTS[1])
                for a, b in zip(results[0][case]["before"], results[1][case]["before"])]
    for rank in range(3):  # the member left out receives the others' mean too
        out = results[rank][case]
        assert out["total"] == WEIGHTS[0] + WEIGHTS[1]
        assert out["left_out"] == [2]  # every member knows who was left out
        for got, want in zip(out["after"], expected):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.dist
def test_an_8bit_overlapped_sync_leaves_a_nan_member_out(results):
    for rank in range(3):
        after = results[rank]["nan-int8-overlapped"]["after"]
        assert all_finite(after)
        torch.testing.assert_close(after, results[0]["nan-int8-overlapped"]["after"], rtol=0, atol=0)


@pytest.mark.dist
@pytest.mark.parametrize("case", ["liar", "nan-overlapped-liar", "all-nan"])
def test_a_result_that_is_not_finite_somewhere_is_rejected_by_every_member(results, case):
    for rank in range(3):
        assert "rejected" in results[rank][case], rank
    assert ("no member" in results[0][case]["rejected"]) == (case == "all-nan")


@pytest.mark.dist
def test_one_log_line_names_the_member_left_out(results):
    lines = results[0]["lines"]
    assert any("member 2" in line and "not finite" in line for line in lines)
    assert any("member 2" in line and "1e+12 is out of bounds" in line for line in lines)
    assert all("member 2" in line for line in results[2]["lines"])  # a member names itself, rank 0 names all
    assert all("member 1" in line for line in results[1]["lines"])  # left out once: the all-NaN case
    assert len(results[2]["lines"]) == len([line for line in lines if "member 2" in line])


@pytest.mark.dist
def test_the_commit_vote_names_the_members_that_failed_on_every_member(results):
    for rank in range(3):
        assert results[rank]["commit-vote"] == [[], [1]]


def test_healthy_checks_the_weight_and_the_values():
    values = [torch.ones(3)]
    assert healthy(values, 5.0, 10.0)
    assert not healthy(values, 11.0, 10.0)
    assert not healthy(values, float("nan"), None)
    assert not healthy(values, 0.0, None)
    assert not healthy([torch.tensor([1.0, float("inf")])], 1.0, None)
