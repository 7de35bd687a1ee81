"""Bounded damage on the server path, at the aggregator: expected weights, NaN, values out of bounds, a mean that
would overflow, and the robust rules (coordinate median, trimmed mean) per chunk against a central computation."""

from __future__ import annotations

import logging

import pytest
import torch

from flwr_sharded.errors import ConfigError
from flwr_sharded.flower.server.aggregation import (SUM_LIMIT, ExcludedContributions, ShardReply,
                                                    StreamingShardAggregator, out_of_bounds)
from flwr_sharded.flower.server.stream import plan_ranges, requests_for
from flwr_sharded.parallel import rules
from flwr_sharded.parallel.token_weights import check_weight, expected_weight, expected_weight_of
from flwr_sharded.parallel.shard_transport import ShardPiece
from tests.flower.test_server_path import SHAPES, _chunks, _expected, _group_reply, _model, spec_of

LOGGER = "flwr_sharded.flower.server.aggregation"


# ----- the expected weight ----------------------------------------------------------------------------------------
def test_the_expected_weight_is_the_tokens_the_groups_trained_on():
    assert expected_weight(steps=25, batch_size=4, grad_accum=2, seq_len=64, worlds=[2]) == 25 * 4 * 2 * 64 * 2
    assert expected_weight(steps=8, batch_size=4, grad_accum=1, seq_len=64, worlds=[2, 2, 1]) == 8 * 4 * 64 * 5

    class Train:  # the attributes of a TrainConfig it reads
        batch_size, grad_accum = 4, 1
        data = type("D", (), {"seq_len": 32})

    assert expected_weight_of(Train, steps=3, worlds=[2]) == 3 * 4 * 32 * 2
    with pytest.raises(ValueError, match="at least one rank"):
        expected_weight(steps=1, batch_size=1, grad_accum=1, seq_len=1, worlds=[0])


@pytest.mark.parametrize("weight, expected, reason", [
    (512.0, 512.0, None), (512, 512.0, None), (512.0 * (1 + 1e-12), 512.0, None), (1.0, None, None),
    (1e12, 512.0, "out of bounds"), (1e300, 512.0, "out of bounds"), (511.0, 512.0, "out of bounds"),
    (float("nan"), 512.0, "finite number > 0"), (float("inf"), None, "finite number > 0"),
    (0.0, None, "finite number > 0"), (-3.0, None, "finite number > 0"), (True, None, "finite number > 0"),
    ("512", 512.0, "finite number > 0"),
])
def test_check_weight(weight, expected, reason):
    got = check_weight(weight, expected)
    assert (got is None) if reason is None else (reason in got), got


# ----- bad contributions: one log line, nothing crashes, the mean of the others -------------------------------------
def _aggregate(replies, **kwargs):
    agg = StreamingShardAggregator(spec=spec_of(_model(0)), **kwargs)
    added = [agg.add(r) for r in replies]
    return agg, added


def _assert_mean_of(agg, models_weights):
    expected = _expected(models_weights)
    for name in SHAPES:
        torch.testing.assert_close(agg.result(name, 0), expected[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("weight", [1e12, 1e300])
def test_an_inflated_weight_is_refused_against_the_expected_one(weight, caplog):
    """With the expected weights (what the ServerApp knows), 1e12 and 1e300 are out of bounds; the result is the
    mean of the others."""
    expected = {"a": 2.0, "b": 1.0, "c": 1.0}.get
    replies = [_group_reply("a", _model(1), 2, 2.0), _group_reply("c", _model(3), 1, weight),
               _group_reply("b", _model(2), 1, 1.0)]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        agg, added = _aggregate(replies, expected_weight=expected)
        agg.finalize()
    assert added == [True, False, True]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "round 0" in lines[0] and "of c" in lines[0] and "out of bounds" in lines[0], lines
    _assert_mean_of(agg, [(_model(1), 2.0), (_model(2), 1.0)])


@pytest.mark.parametrize("weight", [1e300, 3e38, 1e39])
def test_an_absurd_weight_never_crashes_the_sums_even_unchecked(weight, caplog):
    """Without expected weights: a weight whose product with the reply's values leaves the fp32 range used to raise
    in the sums ("value cannot be converted to type float without overflow"); it is now a rejected reply."""
    replies = [_group_reply("a", _model(1), 2, 2.0), _group_reply("c", _model(3), 1, weight),
               _group_reply("b", _model(2), 1, 1.0)]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        agg, added = _aggregate(replies)
        agg.finalize()
    assert added == [True, False, True]
    assert len(caplog.records) == 1 and ("overflow" in caplog.text or "fp32 range" in caplog.text), caplog.text
    _assert_mean_of(agg, [(_model(1), 2.0), (_model(2), 1.0)])


def test_a_nan_group_is_rejected_with_one_line_and_the_others_averaged(caplog):
    nan = _model(3)
    nan["block.0.proj"][2, 1, 0] = float("nan")
    replies = [_group_reply("a", _model(1), 2, 2.0), _group_reply("c", nan, 2, 1.0),
               _group_reply("b", _model(2), 1, 1.0)]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        agg, added = _aggregate(replies)
        agg.finalize()
    assert added == [True, False, True] and "NaN or Inf" in agg.report.rejected["c"]
    assert len(caplog.records) == 1 and "rejected the reply of c" in caplog.text
    _assert_mean_of(agg, [(_model(1), 2.0), (_model(2), 1.0)])


def _huge(value: float) -> dict[str, torch.Tensor]:
    model = _model(3)
    model["embed.weight"][4, 2] = value
    return model


@pytest.mark.parametrize("first", [True, False], ids=["offender-first", "offender-last"])
def test_a_mean_that_would_overflow_excludes_the_offender_whatever_the_order(first, caplog):
    """Four contributions, two of them huge but finite (1.5e38 and 5e37, weight 1): each fits the fp32 sums alone,
    together they do not. With the magnitude test off, the overflow rule excludes the largest weight x |value|,
    wherever it came in the order, and keeps the rest; aggregating again without it gives their mean."""
    good = [_group_reply("a", _model(1), 2, 1.0), _group_reply("b", _model(2), 1, 2.0),
            _group_reply("d", _huge(5e37), 1, 1.0)]
    bad = _group_reply("c", _huge(1.5e38), 2, 1.0)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        agg, added = _aggregate([bad, *good] if first else [*good, bad])
        assert all(added)
        with pytest.raises(ExcludedContributions) as exc:
            agg.finalize()
    assert list(exc.value.reasons) == ["c"] and "would overflow" in exc.value.reasons["c"]
    assert agg.report.excluded == exc.value.reasons
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "excluded the reply of c" in lines[0] and "round 0" in lines[0], lines
    again, _ = _aggregate(good)
    again.finalize()
    expected = _expected([(_model(1), 1.0), (_model(2), 2.0), (_huge(5e37), 1.0)])
    for name in SHAPES:
        torch.testing.assert_close(again.result(name, 0), expected[name], rtol=1e-6, atol=1e-6)
        assert bool(torch.isfinite(again.result(name, 0)).all())


def test_a_contribution_that_alone_would_overflow_the_sums_is_rejected_at_once(caplog):
    replies = [_group_reply("a", _model(1), 2, 1.0), _group_reply("c", _huge(3e38), 2, 1.0),
               _group_reply("b", _model(2), 1, 1.0)]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        agg, added = _aggregate(replies)
        agg.finalize()
    assert added == [True, False, True] and "would overflow" in agg.report.rejected["c"]
    assert len(caplog.records) == 1
    _assert_mean_of(agg, [(_model(1), 1.0), (_model(2), 1.0)])


def test_values_far_above_the_others_are_excluded_by_the_magnitude_test():
    """1e30 is finite and its sum fits, but it would set the mean: 100 x the median of the largest |values| is the
    bound; within it (a 10x larger value) a contribution stays."""
    replies = [_group_reply("a", _model(1), 2, 1.0), _group_reply("b", _model(2), 1, 1.0),
               _group_reply("c", _huge(1e30), 1, 1.0)]
    agg, _ = _aggregate(replies, outlier_ratio=100.0)
    with pytest.raises(ExcludedContributions, match="more than 100 x"):
        agg.finalize()
    assert list(agg.report.excluded) == ["c"]
    largest = max(float(t.abs().max()) for t in _model(2).values())
    agg, _ = _aggregate([*replies[:2], _group_reply("c", _huge(10 * largest), 1, 1.0)], outlier_ratio=100.0)
    agg.finalize()
    assert agg.report.accepted == ["a", "b", "c"] and not agg.report.excluded


def test_out_of_bounds_rules():
    assert out_of_bounds({"a": (1.0, 2.0)}, 100.0) == {}  # alone: nothing to compare with
    assert list(out_of_bounds({"a": (1.0, 2.0), "b": (1.0, 2e5)}, 100.0)) == ["b"]  # two: the larger one
    assert out_of_bounds({"a": (1.0, 0.0), "b": (1.0, 50.0)}, 100.0) == {}  # the floor: max(1, median)
    assert out_of_bounds({"a": (1.0, 2.0), "b": (1.0, 2e5)}, 0.0) == {}  # off
    big = SUM_LIMIT * 0.6
    assert list(out_of_bounds({"a": (1.0, big), "b": (1.0, big), "c": (1.0, 1.0)}, 0.0)) in (["a"], ["b"])
    assert out_of_bounds({"a": (1.0, big), "b": (1.0, big)}, 0.0, sums=False) == {}


# ----- robust rules, chunk by chunk ---------------------------------------------------------------------------------
def _held_bytes(agg: StreamingShardAggregator) -> int:
    """Bytes of the tensors an aggregator holds (sums, row weights, the robust rules' stack)."""
    stack = agg._stack._stack.values() if agg._stack is not None else ()
    return sum(t.numel() * t.element_size() for t in (*agg._acc.values(), *agg._row_weight.values(), *stack))


def _chunked(models, rule, *, trim=1, budget=40, outlier_ratio=0.0, dtype=torch.float32):
    """Each model (S = 1, 2, 3, ... in turn) through windowed aggregators of `budget` fp32 bytes per chunk; the
    whole result, and the most bytes one chunk's aggregator held."""
    spec = spec_of(models[0])
    groups = [{p.key: p for rank in _chunks(m, 1 + i % 3) for p in rank} for i, m in enumerate(models)]
    got: dict[str, list[torch.Tensor]] = {n: [] for n in spec}
    held = 0
    for chunk in plan_ranges(spec, budget):
        agg = StreamingShardAggregator(spec=spec, complete=False, window={n: (a, b) for n, a, b in chunk},
                                       combine=rule, trim=trim, slots=len(models), outlier_ratio=outlier_ratio)
        for g, pieces in enumerate(groups):
            rows = [ShardPiece(pieces[k].name, pieces[k].row_offset + a, pieces[k].global_shape, pieces[k].data[a:b])
                    for k, a, b in requests_for([p.layout for p in pieces.values()], chunk)]
            assert agg.add(ShardReply(f"g{g}", 0, float(g + 1), rows))
            held = max(held, _held_bytes(agg))
        agg.finalize()
        for name, a, b in chunk:
            got[name].append(agg.result(name, a, b - a).clone())
    return {n: torch.cat(v).reshape(spec[n].shape) for n, v in got.items()}, held


@pytest.mark.parametrize("n", [3, 4, 5])
def test_the_chunked_median_is_the_coordinate_median(n):
    models = [_model(i) for i in range(n)]
    result, _ = _chunked(models, "median")
    for name in SHAPES:
        stacked = torch.stack([m[name] for m in models])
        central = torch.median(stacked, dim=0).values if n % 2 else torch.quantile(stacked, 0.5, dim=0)
        torch.testing.assert_close(result[name], central, rtol=0, atol=1e-6)


@pytest.mark.parametrize("n, trim", [(3, 1), (5, 1), (5, 2), (6, 2)])
def test_the_chunked_trimmed_mean_is_the_sorted_trim(n, trim):
    models = [_model(i, torch.bfloat16) for i in range(n)]
    result, _ = _chunked(models, "trimmed-mean", trim=trim)
    for name in SHAPES:
        ordered = torch.stack([m[name].float() for m in models]).sort(dim=0).values
        torch.testing.assert_close(result[name], ordered[trim:n - trim].mean(dim=0), rtol=0, atol=1e-6)


@pytest.mark.parametrize("rule", ["median", "trimmed-mean"])
def test_robust_rules_stay_near_the_honest_groups_with_one_outlier_group(rule):
    """Four honest groups near one model and a fifth 1e6 away (the magnitude test off, so it is combined): the
    robust rules stay within the honest groups' spread; the weighted mean moves by about 1e6 / 5."""
    base = _model(0)
    honest = [{n: t + 0.01 * _model(10 + i)[n] for n, t in base.items()} for i in range(4)]
    outlier = {n: t + 1e6 for n, t in base.items()}
    result, _ = _chunked([*honest, outlier], rule)
    for name in SHAPES:
        lo = torch.stack([h[name] for h in honest]).min(dim=0).values
        hi = torch.stack([h[name] for h in honest]).max(dim=0).values
        assert bool(((result[name] >= lo - 1e-6) & (result[name] <= hi + 1e-6)).all()), name


def test_robust_rules_hold_slots_times_the_chunk_whatever_the_model_size():
    """The stack of a chunk is slots x the chunk's rows in the wire dtype (here fp32): the same for a model 8 times
    larger, and never a model's worth per group."""
    small = [_model(i) for i in range(4)]
    large = [{n: torch.cat([t] * 8) if t.dim() else t for n, t in m.items()} for m in small]
    _, held_small = _chunked(small, "median", budget=48)
    _, held_large = _chunked(large, "median", budget=48)
    row_bytes = max(4 * torch.Size(s[1:]).numel() for s in SHAPES.values())
    assert held_small == held_large <= 4 * max(48, row_bytes) + 4 * 48, (held_small, held_large)
    model_bytes = sum(4 * t.numel() for t in large[0].values())
    assert held_large < model_bytes


def test_a_robust_rule_needs_a_window_enough_slots_and_whole_windows():
    spec = spec_of(_model(0))
    with pytest.raises(ValueError, match="window"):
        StreamingShardAggregator(spec=spec, combine="median", slots=3)
    with pytest.raises(ValueError, match="at least 3 slots"):
        StreamingShardAggregator(spec=spec, complete=False, window={"embed.weight": (0, 7)}, combine="trimmed-mean",
                                 slots=2)
    agg = StreamingShardAggregator(spec=spec, complete=False, window={"embed.weight": (0, 7)}, combine="median",
                                   slots=2)
    data = _model(1)["embed.weight"]
    assert not agg.add(ShardReply("part", 0, 1.0, [ShardPiece("embed.weight", 0, (7, 3), data[:4])]))
    assert "every row of the window" in agg.report.rejected["part"]


def test_trimmed_mean_blocks_give_the_same_result(monkeypatch):
    """`trimmed_mean` sorts a block of coordinates at a time; blocks of 7 coordinates change nothing."""
    stacked = torch.randn(5, 13, 11)
    whole = rules.trimmed_mean(stacked, 1)
    monkeypatch.setattr(rules, "TRIM_BLOCK", 35)
    torch.testing.assert_close(rules.trimmed_mean(stacked, 1), whole, rtol=0, atol=0)
    torch.testing.assert_close(whole, stacked.sort(dim=0).values[1:4].mean(dim=0), rtol=0, atol=1e-6)


# ----- the options --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("config, message", [
    ({"server-rule": "median"}, "'server-rule' 'median' combines facilities at the server"),
    ({"aggregation": "server", "server-rule": "trimmed-mean", "num-groups": 2}, "needs more than 2 facilities"),
    ({"aggregation": "server", "server-rule": "trimmed-mean", "num-groups": 4, "facilities": "a,a,b,b"},
     "this run has 2"),
    ({"aggregation": "server", "server-rule": "trimmed-mean", "num-groups": 4, "server-trim": 2},
     "needs more than 4 facilities"),
    ({"aggregation": "server", "server-rule": "mode"}, "server-rule"),
    ({"aggregation": "server", "server-outlier-ratio": -1.0}, "server-outlier-ratio"),
])
def test_bad_server_rule_options_are_refused(config, message):
    from flwr_sharded.flower.run_config import FlowerRun

    with pytest.raises(ConfigError, match=message):
        FlowerRun.from_run_config(config).validate()


def test_good_server_rule_options_pass():
    from flwr_sharded.flower.run_config import FlowerRun

    for config in ({"aggregation": "server", "server-rule": "median"},
                   {"aggregation": "server", "server-rule": "trimmed-mean", "num-groups": 3},
                   {"aggregation": "server", "server-rule": "trimmed-mean", "num-groups": 4, "facilities": "a,a,b,c"},
                   {"aggregation": "server", "server-rule": "trimmed-mean", "num-groups": 0}):
        FlowerRun.from_run_config(config).validate()
