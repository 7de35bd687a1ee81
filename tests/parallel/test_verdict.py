"""One verdict type for the fault checks of both paths: the weight check, the server's chunk bounds, the strikes."""

from __future__ import annotations

import pytest

from flwr_sharded.parallel.verdict import DROPPED, MAGNITUDE, NAMED, OVERFLOW, WEIGHT, Verdict, reasons


def test_the_weight_check_names_the_member_and_its_reason_is_check_weights():
    from flwr_sharded.parallel.token_weights import check_weight, weight_verdict

    assert weight_verdict(3, 100.0, 100.0) is None
    for weight, expected, at_most in ((float("nan"), None, None), (1e12, 100.0, None), (50.0, None, 10.0)):
        verdict = weight_verdict(3, weight, expected, at_most=at_most)
        assert verdict.member == 3 and verdict.kind == WEIGHT
        assert verdict.reason == check_weight(weight, expected, at_most=at_most)


def test_the_chunk_bounds_give_magnitude_and_overflow_verdicts():
    from flwr_sharded.flower.server.aggregation import SUM_LIMIT, out_of_bounds, out_of_bounds_verdicts

    stats = {"a": (1.0, 2.0), "b": (1.0, 2e5), "c": (2.0, SUM_LIMIT), "d": (1.0, 1.0)}
    verdicts = out_of_bounds_verdicts(stats, 100.0)
    assert [(v.member, v.kind) for v in verdicts] == [("b", MAGNITUDE), ("c", MAGNITUDE)]
    verdicts = out_of_bounds_verdicts(stats, 0.0)
    assert [(v.member, v.kind) for v in verdicts] == [("c", OVERFLOW)]
    assert out_of_bounds(stats, 0.0) == reasons(verdicts)


def test_a_verdict_has_a_known_kind_and_the_first_verdict_on_a_member_is_its_reason():
    with pytest.raises(ValueError, match="verdict kind must be one of"):
        Verdict(1, "why", "grumpy")
    assert reasons([Verdict(1, "first", DROPPED), Verdict(1, "second", NAMED), Verdict(2, "x", NAMED)]) == {
        1: "first", 2: "x"}


@pytest.mark.dist
def test_the_verdict_module_is_torch_free():
    import subprocess
    import sys

    from tests.multiproc import REPO

    code = ("import sys; import flwr_sharded.parallel.verdict, flwr_sharded.parallel.token_weights; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(REPO), "PATH": ""})
    assert out.returncode == 0 and out.stdout.strip() == "False", (out.stdout, out.stderr)
