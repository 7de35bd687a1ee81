"""`flwr run apps/llama_fl_hsdp --stream` in local simulation, through the README's demo script."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.flower.conftest import run_demo, run_demo_killing_a_group
from tests.flower.procs import DEMO, FAST_RUN_CONFIG, REPO, base_env, pids_matching, round_records, run_config_args, \
    wait_until
from tests.multiproc import train_ranks

K, A, N = FAST_RUN_CONFIG["syncs-per-round"], FAST_RUN_CONFIG["aggregate-every"], FAST_RUN_CONFIG["num-server-rounds"]


@pytest.mark.timeout(600)
def test_demo_runs_end_to_end_and_leaves_no_process(simulation_run):
    run = simulation_run
    assert run.returncode == 0, run.output[-5000:]
    for r in range(1, N + 1):
        assert f"[ROUND {r}/{N}] 2 group(s)" in run.output
    assert "round 1: train loss" in run.output and "eval ppl" in run.output and "tokens/s" in run.output
    assert "orchestration" in run.output and "Summary:" in run.output
    assert len(run.rounds) == N
    for record in run.rounds:
        assert (record["groups"], record["synced"], record["syncs"], record["steps"]) == (2, 1, K, K * A)
        assert record["checksums_equal"] == 1 and len(record["checksums"]) == 2
        sums = list(record["checksums"].values())
        assert len(sums[0]) == K * 2 and sums[0] == sums[1]  # every shard identical in both groups after each sync
        assert record["tokens_per_s"] > 0 and record["eval_ppl"] > 0
    assert run.rounds[-1]["train_loss"] < run.rounds[0]["train_loss"]
    assert "finish: 2 of 2 node(s) answered (2 group(s) shut down)" in run.output
    assert "flwr_sharded: the run COMPLETED" in run.output and str(run.run_dir) in run.output
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds"] == N
    assert json.loads((run.run_dir / "config.json").read_text())["federation"]["rounds"] == N
    # nothing left: the SuperLink of this FLWR_HOME, its SuperExec, the groups of this run
    time.sleep(1)
    assert run.run_id
    assert pids_matching("flower-superlink", str(run.flwr_home)) == []
    assert pids_matching("flwr_sharded.flower.group", f"run-{run.run_id}/") == []
    assert "stopped the local SuperLink" in run.output


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_simulation_loss_curve_matches_the_static_engine(simulation_run, data_dir, tmp_path):
    """Same seeds and samples as `torchrun -m flwr_sharded.train --method fl-fsdp --federations 2 --shards 2` for
    N*K*A steps: every step's loss (mean over all ranks) and each round's held-out loss agree within 1e-5
    (in practice bit-identical)."""
    run = simulation_run
    assert run.returncode == 0, run.output[-3000:]
    c = FAST_RUN_CONFIG
    metrics = tmp_path / "static" / "metrics.jsonl"
    result = train_ranks(4, ["--method", "fl-fsdp", "--federations", "2", "--shards", "2", "--model", c["model"],
                          "--data-dir", str(data_dir), "--seq-len", str(c["seq-len"]), "--batch-size",
                          str(c["batch-size"]), "--eval-blocks", str(c["eval-blocks"]), "--steps", str(N * K * A),
                          "--aggregate-every", str(A), "--lr", str(c["lr"]), "--seed", str(c["seed"]),
                          "--warmup", "0.1", "--min-lr-ratio", "0.1", "--weight-decay", "0.1", "--grad-clip", "1.0",
                          "--log-every", "1", "--eval-every", str(K * A), "--run-dir", str(metrics.parent),
                          "--no-save-model", "--no-progress"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    static_losses = [r["loss"] for r in records if r["kind"] == "train"]
    static_evals = [r["eval_loss"] for r in records if r["kind"] == "eval"]
    flower_losses = [x for r in run.rounds for x in r["losses"]]
    assert flower_losses == pytest.approx(static_losses, abs=1e-5)
    assert [r["eval_loss"] for r in run.rounds] == pytest.approx(static_evals, abs=1e-5)


@pytest.mark.dist
@pytest.mark.timeout(400)
def test_bad_run_config_is_a_clear_error_before_any_training(data_dir, tmp_path):
    run = run_demo(tmp_path, data_dir, {**FAST_RUN_CONFIG, "method": "fl-bogus"}, timeout=300)
    assert "run config 'method' must be one of fl-fsdp, fl-hsdp" in run.output, run.output[-3000:]
    assert "[ROUND" not in run.output and "hello to" not in run.output
    assert pids_matching("flower-superlink", str(run.flwr_home)) == []


@pytest.mark.dist
@pytest.mark.slow  # a simulation killed with kill -9 and resumed (~1.5 min): `make test-slow`, which CI runs
@pytest.mark.timeout(900)
def test_a_killed_run_resumes_after_its_last_checkpointed_round(data_dir, tmp_path):
    """Checkpoints after rounds 2 and 4; the whole run (SuperLink, ServerApp, Ray, groups) is killed -9 after round 3's
    record (round 3 is then lost work). `resume = true` goes on after round 2: rounds 3 and 4 give
    the uninterrupted run's losses, evaluation and shards (no lost or repeated samples, a continuous schedule)."""
    import uuid

    from tests.flower.procs import kill_tree_by_env

    config = {**FAST_RUN_CONFIG, "num-server-rounds": 4, "syncs-per-round": 1, "aggregate-every": 3,
              "checkpoint-rounds": 2}
    reference = run_demo(tmp_path / "reference", data_dir, {**config, "checkpoint-dir": str(tmp_path / "ref-ckpt")})
    assert reference.returncode == 0 and [r["round"] for r in reference.rounds] == [1, 2, 3, 4], reference.output
    checkpoints = tmp_path / "ckpt"
    tag = uuid.uuid4().hex
    work = tmp_path / "killed"
    work.mkdir()
    metrics = work / "run" / "metrics.jsonl"
    env = base_env(FLWR_HOME=str(work / "flwr_home"), FLWR_SHARDED_DATA=str(data_dir), FLWR_SHARDED_TEST_TAG=tag)
    cmd = ["bash", str(DEMO), *run_config_args({**config, "checkpoint-dir": str(checkpoints),
                                                "run-dir": str(work / "run")})]
    with open(work / "out.txt", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
    try:
        wait_until(lambda: len(round_records(metrics)) >= 3 or proc.poll() is not None, 300, 0.05, "round 3")
        assert proc.poll() is None, (work / "out.txt").read_text()[-3000:]
    finally:
        killed = kill_tree_by_env("FLWR_SHARDED_TEST_TAG", tag)
    assert killed >= 4  # the script, the SuperLink and its children, the groups' ranks
    assert [r["round"] for r in round_records(metrics)] == [1, 2, 3]
    resumed = run_demo(tmp_path / "resumed", data_dir, {**config, "checkpoint-dir": str(checkpoints),
                                                        "resume": True})
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert "resuming after round 2 of 4" in resumed.output
    assert [r["round"] for r in resumed.rounds] == [3, 4]
    for got, want in zip(resumed.rounds, reference.rounds[2:]):
        assert got["groups"] == 2 and got["checksums_equal"] == 1, got
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-6, abs=1e-6)
        assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-6)
        assert next(iter(got["checksums"].values())) == pytest.approx(next(iter(want["checksums"].values())),
                                                                       rel=1e-6, abs=1e-6)


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_a_killed_group_is_dropped_relaunched_and_rejoins_with_a_catch_up(data_dir, tmp_path):
    """Kill -9 one group's processes after round 1: its round fails and it is dropped (the survivor rolls back if
    the sync was under way); at the next round the ServerApp offers it to rejoin, the ClientApp launches a new group,
    and the round starts with a catch-up, after which both groups hold identical shards again."""
    config = {**FAST_RUN_CONFIG, "num-server-rounds": 4, "syncs-per-round": 1, "aggregate-every": 3, "shards": 1,
              "rendezvous-timeout": 10.0, "sync-timeout": 20.0}  # the survivor's wait for the dead member
    # groups of one rank: a catch-up of S = 2 shard indices is test_group.py's restarted group
    returncode, output, rounds, victim = run_demo_killing_a_group(tmp_path, data_dir, config)
    assert returncode == 0, output[-4000:]
    assert len(rounds) == 4, output[-4000:]
    dropped = [r for r in rounds if r["dropped"]]
    rejoined = [r for r in rounds if r["rejoined"]]
    assert dropped and rejoined and rejoined[0]["round"] > dropped[0]["round"], rounds
    assert rejoined[0]["rejoined"] == [victim] and "rejoin" in output
    for r in rounds[rounds.index(rejoined[0]):]:
        assert r["groups"] == 2 and r["synced"] == 1 and r["checksums_equal"] == 1, r
