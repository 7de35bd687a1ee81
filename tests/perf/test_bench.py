"""`flwr-sharded bench`: measured traffic against the cost model, a quick emulated run of the methods, the
emulated sync benchmark, and the report logic."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from flwr_sharded.errors import ConfigError
from flwr_sharded_perf.bench.targets import agreement
from flwr_sharded_perf.bench.runs import default_layouts, model_units, parse_layouts, step_stats, vocab_size_of
from flwr_sharded_perf.netemu.network import EmuTopology
from flwr_sharded_perf.placement import TIERS, Placement
from flwr_sharded_perf.traffic_report import compare, load_probes, ring_bytes_sent
from tests import REPO
from tests.multiproc import needs_emulation, train_ranks


# 2 groups x 1 node x 2 ranks: FSDP's ring and the FL sync cross the 200 Mbit/s group uplinks, shards stay on loopback
SMALL = {"name": "two-groups", "gpus_per_node": 2, "nodes": 2, "nodes_per_group": 1, "gpu_memory": "1GB",
         "flops_per_gpu": "4GFLOPS", "backend": "gloo", "shared": ["inter_group"],
         "bandwidth": {"intra_node": "7.5Gbit", "inter_group": "200Mbit"}}


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flwr_sharded.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


# ---------------------------------------------------------------------------------------------------------------------
# Measured traffic without emulation: torchrun on loopback, the engine's --measure-traffic switch.


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("method, layout, A", [("fl-hsdp", ["--federations", "2", "--replicas", "2"], 2),
                                               ("fl-hsdp", ["--federations", "2", "--replicas", "2",
                                                            "--sync-dtype", "bfloat16"], 2),
                                               ("fl-hsdp", ["--federations", "2", "--replicas", "2",
                                                            "--sync-dtype", "int8", "--sync-delay", "1"], 2),
                                               ("hsdp", ["--replicas", "2", "--shards", "2"], 1)],
                         ids=["fl-hsdp", "fl-hsdp-bf16-sync", "fl-hsdp-int8-overlapped-sync", "hsdp"])
def test_measured_collectives_match_the_cost_model(data_dir, tmp_path, method, layout, A):
    """Bytes per tier from the recorded collectives of every step and sync equal `placement.traffic` within 5%
    (here: exactly, but for the 8-bit rows' padding), for a placement of the 4 ranks on 2 pretend nodes (the tiers
    follow the rank numbers). With a bfloat16 or int8 sync the cross-group all-reduce (here the only inter-node
    traffic) is predicted at its wire bytes per parameter; an overlapped sync's thread is counted as the sync."""
    from flwr_sharded.parallel.wire import SYNC_DTYPE_BYTES

    dtype = layout[layout.index("--sync-dtype") + 1] if "--sync-dtype" in layout else "float32"
    wire_ratio = SYNC_DTYPE_BYTES[dtype] / 4
    args = ["--method", method, *layout, "--model", "tiny", "--data-dir", str(data_dir), "--seq-len", "32",
            "--batch-size", "1", "--steps", "6", "--aggregate-every", str(A), "--log-every", "2", "--eval-every", "0",
            "--eval-blocks", "4", "--no-progress", "--measure-traffic", str(tmp_path / "traffic")]
    result = train_ranks(4, args, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    probes = load_probes(tmp_path / "traffic")
    assert [p["rank"] for p in probes] == [0, 1, 2, 3]
    assert probes[0]["windows"]["step"] == 6 and probes[0]["windows"]["sync"] == (3 if A == 2 else 0)
    F, R = (2, 2) if method == "fl-hsdp" else (1, 2)
    S = 4 // (F * R)
    units = model_units("tiny", vocab_size_of(str(data_dir)), 32, S)
    placement = Placement(F=F, R=R, S=S, gpus_per_node=2, nodes_per_group=None)
    cmp = compare(probes, method, placement, units, A=A, backend="gloo", reshard_root=True, wire_ratio=wire_ratio)
    assert cmp.max_error() <= 0.05, cmp.to_dict()["error"]
    total = cmp.predicted_total()
    assert total["inter_node"] > 0 and total["intra_node"] > 0
    # evaluation and logging collectives are counted apart, not as steps
    assert sum(cmp.collectives["other"][t] for t in TIERS) > 0


def test_sent_bytes_rules():
    assert ring_bytes_sent("all_gather_single", 800, 4) == 600
    assert ring_bytes_sent("all_gather", 200, 4) == 600  # the list form's payload: one rank's part
    assert ring_bytes_sent("reduce_scatter_single", 800, 4, "gloo") == 1200  # gloo runs an all-reduce
    assert ring_bytes_sent("reduce_scatter_single", 800, 4, "nccl") == 600
    assert ring_bytes_sent("all_reduce", 800, 4) == 1200
    assert ring_bytes_sent("broadcast", 800, 2) == 800
    assert ring_bytes_sent("all_reduce", 800, 1) == 0
    with pytest.raises(ValueError):
        ring_bytes_sent("all_to_all_single", 8, 2)


# ---------------------------------------------------------------------------------------------------------------------
# Layouts, statistics, agreement (no processes).


def _topo(**changes) -> EmuTopology:
    from flwr_sharded_perf.cluster import cluster_from_dict

    return EmuTopology.from_cluster(cluster_from_dict({**SMALL, **changes}))


def test_default_layouts_follow_the_paper():
    big = _topo(nodes=4, nodes_per_group=2, bandwidth={"intra_node": "7Gbit", "inter_node": "1Gbit",
                                                       "inter_group": "100Mbit"})
    got = {k: v.text() for k, v in default_layouts(big).items()}
    assert got == {"fsdp": "1x1x8", "hsdp": "1x4x2", "fl-fsdp": "4x1x2", "fl-hsdp": "2x2x2"}
    assert {k: v.text() for k, v in default_layouts(_topo()).items()} == {
        "fsdp": "1x1x4", "hsdp": "1x2x2", "fl-fsdp": "2x1x2"}
    over = parse_layouts("fl-fsdp=4x1x1,hsdp=1x4x1", _topo())
    assert over["fl-fsdp"].text() == "4x1x1" and over["hsdp"].text() == "1x4x1"


@pytest.mark.parametrize("text, words", [("fsdp=1x1x3", "has 3 ranks"), ("fsdp=1x2x2", "R=1"),
                                         ("ddp=1x1x4", "unknown method"), ("fl-fsdp=4x1", "FxRxS"),
                                         ("hsdp=1x1x4", "not a hsdp layout")])
def test_bad_layouts(text, words):
    with pytest.raises(ConfigError, match=words):
        parse_layouts(text, _topo())


def test_the_top_k_runs_train_the_sparse_recipe_and_count_its_dense_flush():
    from argparse import Namespace

    from flwr_sharded.parallel.wire import sync_wire_ratio
    from flwr_sharded_perf.bench.runs import sync_variant

    opts = Namespace(sync_fragments=2, sync_delay=3, sync_alpha=0.0, sync_carry=True, sync_topk=0.01,
                     sync_dtype="float32")
    v = sync_variant("fl-fsdp-overlap-topk", opts)
    args = v.train_args()
    assert args[args.index("--sync-dtype") + 1] == "int2" and args[args.index("--sync-topk") + 1] == "0.01"
    assert args[args.index("--sync-restart") + 1] == "residual" and "--sync-dense-flush" in args
    assert args[args.index("--sync-error-decay") + 1] == "1"
    sparse, dense = sync_wire_ratio("int2", 0.01, 4), sync_wire_ratio("int2")
    assert v.wire_ratio(4, 4) == pytest.approx((3 * sparse + dense) / 4) and sparse < 0.01 < v.wire_ratio(4, 4)
    assert sync_variant("fl-fsdp-int2", opts).wire_ratio(4, 4) == dense


def test_step_stats_leave_out_the_warm_up_window():
    windows = [{"steps": 4, "step_s": 9.0, "forward": 1, "backward": 1, "optimizer": 1, "sync": 0},
               {"steps": 4, "step_s": 1.0, "forward": 0.2, "backward": 0.5, "optimizer": 0.1, "sync": 0.2},
               {"steps": 4, "step_s": 3.0, "forward": 0.2, "backward": 0.5, "optimizer": 0.1, "sync": 2.2}]
    stats = step_stats([windows, windows])
    assert stats["windows_used"] == 4 and stats["step_s"] == 2.0 and stats["step_s_mean"] == 2.0
    assert stats["step_s_std"] == 1.0 and stats["phases"]["sync"] == pytest.approx(1.2)


def _fake_run(method: str, layout: str, step: float, A: int = 8, sync: bool = True) -> dict:
    F, R, S = (int(x) for x in layout.split("x"))
    return {"method": method, "layout": layout, "F": F, "R": R, "S": S, "A": A if method.startswith("fl-") else 1,
            "sync": sync, "step_s": step}


def test_agreement_applies_the_planner_rule():
    scen = {"runs": {"hsdp": _fake_run("hsdp", "1x4x2", 1.00), "fl-fsdp": _fake_run("fl-fsdp", "4x1x2", 0.95),
                     "no-sync": _fake_run("fl-fsdp", "4x1x2", 0.5, sync=False)},
            "planner": {"fl_margin": 0.1, "predicted_order": ["hsdp", "fl-fsdp"],
                        "first_choice": {"method": "hsdp", "F": 1, "R": 4, "S": 2, "A": 1}}}
    agree = agreement(scen)
    assert agree["planner"] == "hsdp" and agree["measured_fastest"] == "fl-fsdp" and not agree["ok"]
    assert agree["measured_by_rule"] == "hsdp" and agree["ok_by_rule"]  # FL is < 10% faster: the rule keeps HSDP
    assert "+5.3%" in agree["text"]
    scen["runs"]["fl-fsdp"]["step_s"] = 0.5
    agree = agreement(scen)
    assert agree["measured_by_rule"] == "fl-fsdp" and not agree["ok_by_rule"]


# ---------------------------------------------------------------------------------------------------------------------
# Emulated runs (root).


@pytest.mark.dist
@needs_emulation
@pytest.mark.timeout(300)
def test_quick_bench_end_to_end(data_dir, tmp_path):
    from tests.perf.test_netemu import assert_clean, host_state

    cluster = tmp_path / "two-groups.yaml"
    cluster.write_text(yaml.safe_dump(SMALL))
    before = host_state()
    result = _cli("bench", "--quick", "--cluster", str(cluster), "--data-dir", str(data_dir), "--out",
                  str(tmp_path / "out"), "--eval-blocks", "4", "--methods",
                  "fsdp,fl-fsdp,no-sync,fl-fsdp-overlap-int8")  # hsdp: the same code path as fsdp's
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_clean(before)
    res = json.loads((tmp_path / "out" / "bench.json").read_text())
    runs = res["scenarios"]["main"]["runs"]
    assert set(runs) == {"fsdp", "fl-fsdp", "no-sync", "fl-fsdp-overlap-int8"}
    overlapped = runs.pop("fl-fsdp-overlap-int8")  # an int8 sync overlapped with one step: a quarter on the uplink
    assert overlapped["sync_variant"] == {"dtype": "int8", "fragments": 1, "delay": 1, "alpha": 0.0, "carry": True,
                                          "error_feedback": True, "topk": None, "restart": "global",
                                          "dense_flush": False, "error_decay": None, "flat": False}
    assert overlapped["traffic_max_error"] <= 0.05, overlapped["traffic"]["error"]
    from flwr_sharded_perf.bench.targets import cross_group_bytes_per_sync

    ratio = cross_group_bytes_per_sync(overlapped) / cross_group_bytes_per_sync(runs["fl-fsdp"])
    assert 0.24 <= ratio <= 0.27, ratio
    for key, r in runs.items():
        assert r["traffic_max_error"] <= 0.05, (key, r["traffic"]["error"])
        t = r["traffic"]
        for tier in TIERS:  # the wire carries what the collectives send, plus TCP/IP headers and ACKs
            allm = sum(t["collectives"][p][tier] for p in ("step", "sync", "other"))
            if allm > 1e6:
                assert 0.98 <= t["wire_ratio"][tier] <= 1.12, (key, tier, t["wire_ratio"])
        assert r["steps"] == 8 and r["effective_batch"] == (2 if key in ("fl-fsdp", "no-sync") else 4)
    # FSDP's ring crosses the slow uplink every step, FL+FSDP only every A steps, the no-sync limit never
    inter = {k: sum(r["traffic"]["collectives"][p]["inter_group"] for p in ("step", "sync")) for k, r in runs.items()}
    assert inter["fsdp"] > inter["fl-fsdp"] > inter["no-sync"] == 0
    assert runs["fsdp"]["step_s"] > runs["fl-fsdp"]["step_s"]
    assert (tmp_path / "out" / "time_to_ppl.png").stat().st_size > 10_000
    report = (tmp_path / "out" / "bench.md").read_text()
    for heading in ("Step time and speedups", "Phase breakdown", "Overlapped, quantized and sparse syncs",
                    "Time to target on this cluster", "Bytes per tier", "Learning quality", "Planner agreement",
                    "Targets"):
        assert heading in report
    ttt = res["scenarios"]["main"]["time_to_target"]  # evaluations at steps 4 and 8 (--quick: --eval-every 4)
    assert set(ttt["runs"]) == {"fl-fsdp", "no-sync", "fl-fsdp-overlap-int8"}
    assert ttt["target_eval_ppl"] == runs["fl-fsdp"]["final"]["eval_ppl"]
    assert [e["step"] for e in runs["fl-fsdp"]["eval"]] == [4, 8]
    assert 0 < runs["fl-fsdp"]["eval"][0]["time_s"] < runs["fl-fsdp"]["eval"][1]["time_s"] == \
        runs["fl-fsdp"]["final"]["train_time_s"]
    assert ttt["runs"]["fl-fsdp"]["vs_reference"] == 1.0 and ttt["runs"]["no-sync"]["compute_utilisation"] == 1.0


@pytest.mark.dist
@needs_emulation
@pytest.mark.timeout(240)
def test_sync_bench_under_shaping(tmp_path):
    result = _cli("bench", "sync", "--bandwidths", "50Mbit", "--layers", "2", "--hidden", "32", "--repeats", "3",
                  "--sync-out", str(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    files = sorted(tmp_path.glob("sync_emulated_*.json"))
    assert len(files) == 2
    by_net = {json.loads(f.read_text())["network"]: json.loads(f.read_text()) for f in files}
    shaped, loop = by_net["50Mbit"], by_net["loopback"]
    # across 50 Mbit/s one flat all-reduce of the shard takes at least bytes / bandwidth
    assert shaped["median_s"]["flat"] >= 0.8 * shaped["shard_bytes_per_rank"] * 8 / 50e6  # less the tbf burst
    assert shaped["median_s"]["flat"] > 5 * loop["median_s"]["flat"]
    assert "sync / flat" in result.stdout


def test_bench_rejects_bad_options_before_building_anything(tmp_path, data_dir, capsys):
    """In-process: the command exits 2 with the reason, and starts no process (this tier refuses any start)."""
    from flwr_sharded.cli import main

    cluster = tmp_path / "c.yaml"
    cluster.write_text(yaml.safe_dump(SMALL))
    cases = [(["--model", "nope"], "preset"), (["--layouts", "fsdp=1x1x3"], "has 3 ranks"),
             (["--data-dir", str(tmp_path / "missing")], "missing"), (["--steps", "0"], "--steps"),
             (["--contrast", str(tmp_path / "nope.yaml")], "cannot read")]
    for extra, words in cases:
        args = ["bench", "--cluster", str(cluster), "--contrast", "none", "--data-dir", str(data_dir), *extra]
        try:
            code = main(args)
        except SystemExit as stopped:  # argparse's own errors
            code = stopped.code
        stderr = capsys.readouterr().err
        assert code == 2, (extra, stderr)
        assert words in stderr, (extra, stderr)
