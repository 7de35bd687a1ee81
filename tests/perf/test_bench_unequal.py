"""The benchmark's unequal scenario: its layouts and options, cross-group bytes from traffic probes, the groups'
timings from `sync_groups` records, eval perplexity at equal tokens, the targets and the report (synthetic inputs),
and one quick emulated run (root)."""

from __future__ import annotations

import json
import math

import pytest

from flwr_sharded.errors import ConfigError
from flwr_sharded_perf.bench.report import render_unequal
from flwr_sharded_perf.bench.targets import unequal_checks
from flwr_sharded_perf.bench.runs import BenchLayout
from flwr_sharded_perf.bench.scenarios import (at_equal_tokens, cross_group_traffic, eval_tokens, group_timing,
                                               parse_group_shards, ppl_at, predicted_sync, slow_seconds, unequal_layouts)
from flwr_sharded_perf.netemu.network import EmuTopology
from tests.multiproc import needs_emulation
from tests.perf.test_bench import REPO, _cli

FLAT6 = EmuTopology(name="flat", ranks_per_node=1, nodes=6, nodes_per_group=6, inter_node_bps=1e9,
                    inter_group_bps=None)


def test_unequal_layout_passes_group_shards():
    lay = BenchLayout.unequal("fl-fsdp", 1, (2, 4))
    assert (lay.F, lay.world, lay.text()) == (2, 6, "2x1x(2,4)")
    assert [list(r) for r in lay.group_ranks()] == [[0, 1], [2, 3, 4, 5]]
    args = lay.train_args(8)
    assert args[args.index("--group-shards") + 1] == "2,4" and "--shards" not in args and "--federations" not in args
    equal = BenchLayout("fl-fsdp", 2, 1, 3)
    assert equal.shards_per_group == (3, 3) and [list(r) for r in equal.group_ranks()] == [[0, 1, 2], [3, 4, 5]]
    assert "--group-shards" not in equal.train_args(8)


def test_unequal_layouts_and_their_errors():
    layouts = unequal_layouts(parse_group_shards("2,4"), FLAT6, 1)
    assert layouts["equal"] == BenchLayout("fl-fsdp", 2, 1, 3) and layouts["unequal"].group_shards == (2, 4)
    for text, words in (("2,2", "not all equal"), ("4", "at least two"), ("2,x", "comma-separated"),
                        ("1,2", "multiple of 2")):
        with pytest.raises(ConfigError, match=words):
            parse_group_shards(text)
    with pytest.raises(ConfigError, match="the cluster of --unequal 6"):
        unequal_layouts((2, 6), FLAT6, 1)
    with pytest.raises(ConfigError, match="--slow-group 2"):
        unequal_layouts((2, 4), FLAT6, 2)


def _probe(rank: int, collectives: list[tuple[str, str, list[int], int]], syncs: int = 2) -> dict:
    return {"rank": rank, "windows": {"step": 8, "sync": syncs}, "seconds": {"step": 4.0, "sync": 0.2 * (rank + 1)},
            "collectives": [{"phase": ph, "op": op, "ranks": ranks, "calls": 1, "bytes": b}
                            for ph, op, ranks, b in collectives]}


def test_cross_group_traffic_counts_only_sync_collectives_across_groups():
    groups = [range(0, 2), range(2, 6)]
    probes = [_probe(0, [("sync", "all_reduce", [0, 2], 1000), ("sync", "all_reduce", [0, 1], 64),
                         ("step", "all_reduce", [0, 3], 5000), ("sync", "all_gather", [0, 3], 8)]),
              _probe(2, [("sync", "all_reduce", [0, 2], 1000), ("sync", "all_reduce", [2, 3, 4, 5], 64)])]
    t = cross_group_traffic(probes, groups)
    # an all-reduce over 2 ranks sends its payload once (2 (n-1)/n); the list all-gather (n-1) x its input
    assert t["group_bytes_per_sync"] == [(1000 + 8) / 2, 1000 / 2]
    assert t["bytes_per_sync"] == 2008 / 2 and t["syncs"] == 2 and t["max_rank_bytes"] == 1008 / 2
    assert t["sync_s"] == pytest.approx(0.3) and t["sync_s_min"] == pytest.approx(0.1)


def test_predicted_sync_sends_the_model_per_group_whatever_its_S():
    shapes = [(12, 4), (8,), (6, 6)]
    model_bytes = (48 + 8 + 36) * 4
    for shards in ((2, 4), (3, 3), (1, 2, 3)):
        F = len(shards)
        p = predicted_sync(shards, 1, shapes, bandwidth_bps=1e9)
        for g in p["group_bytes_per_sync"]:  # every group sends 2 (F-1)/F x the model (padding aside)
            assert g == pytest.approx(2 * (F - 1) / F * model_bytes, rel=0.2)
        assert p["sync_s"] > 0
    assert predicted_sync((2, 4), 1, shapes, bandwidth_bps=None)["sync_s"] is None


def _records(idle_fast: float) -> list[dict]:
    """sync_groups records of two groups: group 0 steps 0.1 s, group 1 0.2 s (the slow one)."""
    return [{"kind": "sync_groups", "step": 8 * (i + 1), "sync_s": [0.05 + idle_fast, 0.05], "idle_s": [idle_fast, 0.0],
             "steps": [8, 8], "step_time_s": [0.1, 0.2]} for i in range(3)] + [{"kind": "train", "step": 8}]


def test_group_timing_finds_the_fastest_group_and_its_idle_share():
    from flwr_sharded_perf.bench.scenarios import sync_group_records

    records = sync_group_records(list(reversed(_records(0.8))))
    assert [r["step"] for r in records] == [8, 16, 24]
    t = group_timing(records)
    assert t["fastest"] == 0 and t["syncs_used"] == 2 and t["syncs"] == 3
    assert t["fastest_idle_fraction"] == pytest.approx(0.8 / (0.8 + 0.85))  # the sync's wall time holds the idle
    assert t["groups"][1]["period_s"] == pytest.approx(8 * 0.2 + 0.05)
    assert group_timing([]) is None


def test_slow_seconds_from_the_slow_groups_step_time():
    run = {"step_s": 0.5, "group_timing": group_timing(_records(0.8))}
    assert slow_seconds(run, 1)[0] == pytest.approx(0.2) and slow_seconds(run, 0)[0] == pytest.approx(0.1)
    assert slow_seconds({"step_s": 0.5, "group_timing": None}, 1)[0] == 0.5


def test_eval_perplexity_at_equal_tokens():
    # group 0 (2 ranks) 8 steps per sync, group 1 (4 ranks) 4: 8 x 2 + 4 x 4 = 32 rank-steps of 10 tokens per sync
    records = [{"kind": "sync_groups", "step": 8 * k, "steps": [8, 4]} for k in (1, 2)]
    records += [{"kind": "eval", "step": 8, "eval_ppl": 100.0, "tokens_seen": 480},
                {"kind": "eval", "step": 16, "eval_ppl": 25.0, "tokens_seen": 960},
                {"kind": "eval", "step": 20, "eval_ppl": 20.0, "tokens_seen": 1200}]
    assert eval_tokens(records, [20, 40]) == [(320.0, 100.0), (640.0, 25.0), (1200.0, 20.0)]
    curve = [(1000.0, 100.0), (2000.0, 25.0)]
    assert ppl_at(curve, 1500) == pytest.approx(50.0)  # linear in log ppl
    assert ppl_at(curve, 999) is None and ppl_at(curve, 2000) == 25.0
    cmp = at_equal_tokens([(1000.0, 110.0), (3000.0, 11.0)], curve)
    assert cmp["tokens"] == 2000 and cmp["ref_eval_ppl"] == 25.0
    assert cmp["delta"] == pytest.approx(math.sqrt(110 * 11) / 25 - 1)


def _run(layout: str, mb: float, pred_mb: float, timing: dict | None = None, ppl: dict | None = None) -> dict:
    return {"layout": layout, "step_s": 0.5, "final": {"eval_ppl": 90.0},
            "cross_group": {"bytes_per_sync": mb * 1e6, "sync_s": 0.2, "sync_s_min": 0.1},
            "predicted_sync": {"bytes_per_sync": pred_mb * 1e6, "sync_s": 0.1},
            "group_timing": timing, "ppl_vs_equal_speed": ppl, "eval_tokens": [(1000.0, 90.0)]}


@pytest.mark.dist
def test_unequal_checks_and_report():
    slow, speed = group_timing(_records(0.8)), group_timing(_records(0.05))
    scen = {"description": "flat", "cluster_file": "c.yaml", "batch_size": 1, "seq_len": 64, "steps": 32, "A": 8,
            "slow": {"group": 1, "seconds": 0.1, "why": "given"},
            "runs": {"equal": _run("2x1x3", 10.0, 10.0), "unequal": _run("2x1x(2,4)", 11.5, 11.0),
                     "unequal-slow": _run("2x1x(2,4)", 11.5, 11.0, slow),
                     "unequal-slow-speed": _run("2x1x(2,4)", 11.5, 11.0, speed,
                                                {"tokens": 1e3, "eval_ppl": 93.0, "ref_eval_ppl": 90.0,
                                                 "delta": 93 / 90 - 1})}}
    checks = {c["check"].split(": ", 1)[1]: c for c in unequal_checks(scen)}
    bytes_check = checks["cross-group bytes per sync over the equal federation's"]
    assert bytes_check["value"] == pytest.approx(1.15) and bytes_check["ok"] is False
    assert checks["unequal federation: cross-group bytes per sync against perf.unequal_sync_cost"]["ok"] is True
    idle = [c for name, c in checks.items() if "idle" in name]
    assert [c["ok"] for c in idle] == [None, True]  # today's is reported, the speed run's is the target
    ppl = next(c for name, c in checks.items() if "eval ppl" in name)
    assert ppl["ok"] is False and ppl["value"] == pytest.approx(1 / 30)
    text = "\n".join(render_unequal(scen))
    for words in ("Cross-group bytes and time per sync", "1.150x", "+4.55%", "0 (fastest)", "48.5%", "+3.33%"):
        assert words in text, words


@pytest.mark.dist
def test_bench_options_for_the_unequal_scenario(data_dir, tmp_path):
    result = _cli("bench", "--methods", "none", "--unequal", "none", "--contrast", "none", "--data-dir",
                  str(data_dir), "--out", str(tmp_path))
    assert result.returncode == 2 and "nothing to run" in result.stderr
    result = _cli("bench", "--methods", "none", "--unequal-groups", "2,2", "--data-dir", str(data_dir))
    assert result.returncode == 2 and "--unequal-groups" in result.stderr
    result = _cli("bench", "--methods", "none", "--unequal-runs", "equal,fast", "--data-dir", str(data_dir))
    assert result.returncode == 2 and "--unequal-runs" in result.stderr


@needs_emulation
@pytest.mark.timeout(300)
@pytest.mark.slow  # four emulated trainings (~1 min); the report's parts are tested above on recorded metrics
def test_quick_unequal_bench_end_to_end(data_dir, tmp_path):
    """The equal and the unequal federation on the flat 6-rank cluster: the meter's cross-group bytes per sync are
    the same for both (each group sends the model once) and perf.unequal_sync_cost's."""
    result = _cli("bench", "--quick", "--methods", "none", "--unequal-runs", "equal,unequal", "--data-dir",
                  str(data_dir), "--out", str(tmp_path / "out"), "--eval-blocks", "4",
                  "--unequal", str(REPO / "benchmarks" / "clusters" / "emulated-unequal.yaml"), timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    res = json.loads((tmp_path / "out" / "bench.json").read_text())
    runs = res["scenarios"]["unequal"]["runs"]
    assert set(runs) == {"equal", "unequal"} and "main" not in res["scenarios"]
    assert runs["unequal"]["group_shards"] == [2, 4] and runs["unequal"]["layout"] == "2x1x(2,4)"
    for r in runs.values():
        cg, pred = r["cross_group"], r["predicted_sync"]
        assert cg["syncs"] == 4 and abs(cg["bytes_per_sync"] / pred["bytes_per_sync"] - 1) <= 0.01
    assert runs["unequal"]["cross_group"]["bytes_per_sync"] <= 1.01 * runs["equal"]["cross_group"]["bytes_per_sync"]
    assert "Cross-group bytes and time per sync" in (tmp_path / "out" / "bench.md").read_text()
