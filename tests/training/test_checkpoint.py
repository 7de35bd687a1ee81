"""Sharded checkpoints: resume continues the exact run; an interrupted write leaves the previous one usable; export."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flwr_sharded.flower.launch import pid_alive
from flwr_sharded.training.checkpoint_export import export_pretrained
from flwr_sharded.training.checkpoint_files import read_meta
from flwr_sharded.training.checkpoint_series import LATEST, latest_checkpoint
from tests.multiproc import REPO, children, faults_env, free_port, train_ranks

ARGS = ["--method", "fl-hsdp", "--federations", "2", "--replicas", "1", "--shards", "2", "--model", "tiny",
        "--seq-len", "32", "--batch-size", "2", "--steps", "12", "--aggregate-every", "3", "--log-every", "1",
        "--eval-every", "0", "--eval-blocks", "4", "--lr", "3e-3", "--no-progress"]


def _losses(run_dir: Path, *, resumed: bool = False) -> dict[int, float]:
    """Train losses by step (`resumed`: only those after the resume record, the steps this run took)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if resumed:
        kinds = [r["kind"] for r in records]
        records = records[kinds.index("resume") + 1:] if "resume" in kinds else []
    return {r["step"]: r["loss"] for r in records if r.get("kind") == "train"}


def _run(args: list[str]) -> None:
    result = train_ranks(4, args, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.dist
@pytest.mark.timeout(480)
@pytest.mark.parametrize("mode", [[], ["--async-checkpoint", "--outer", "nesterov", "--sync-dtype", "bfloat16"]],
                         ids=["sync-write", "async-write+outer-state+bf16-sync-global-state"])
def test_resume_continues_the_same_run(data_dir, tmp_path, mode):
    ckpt = tmp_path / "ckpt"
    common = [*ARGS, *mode, "--data-dir", str(data_dir), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "5"]
    _run([*common, "--run-dir", str(tmp_path / "straight")])
    for group in ("group-0", "group-1"):
        series = ckpt / group
        assert sorted(p.name for p in series.glob("step-*")) == ["step-00000010", "step-00000012"]  # keep 2
        # Pretend the run died after step 10 while writing step 12: only a partial .tmp is left.
        shutil.move(series / "step-00000012", series / "step-00000012.tmp")
        (series / "step-00000012.tmp" / "meta.json").unlink()
        (series / LATEST).write_text("step-00000010")
        assert latest_checkpoint(series).name == "step-00000010"
    _run([*common, "--resume", "--run-dir", str(tmp_path / "resumed")])
    straight, resumed = _losses(tmp_path / "straight"), _losses(tmp_path / "resumed", resumed=True)
    assert sorted(resumed) == [11, 12]  # only the steps after the checkpoint were run again
    assert _losses(tmp_path / "resumed") == {**{k: v for k, v in straight.items() if k <= 10}, **resumed}
    for step in (11, 12):  # steps 10-12 cross a sync (at 12): data position, RNG, optimizer state all restored
        assert resumed[step] == pytest.approx(straight[step], abs=1e-6)
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(tmp_path / "straight" / "model").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "resumed" / "model").state_dict()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
    # export merges the shards of the newest checkpoint into the same model as the run's model/
    exported = export_pretrained(ckpt / "group-0", tmp_path / "exported")
    c = AutoModelForCausalLM.from_pretrained(exported).state_dict()
    assert all(torch.equal(b[k], c[k]) for k in b)


def test_resume_refuses_a_missing_or_incompatible_checkpoint(data_dir, tmp_path, monkeypatch, capsys):
    from flwr_sharded.train import main

    monkeypatch.setenv("WORLD_SIZE", "4")
    args = [*ARGS, "--data-dir", str(data_dir), "--checkpoint-dir", str(tmp_path / "none"), "--resume"]
    assert main(args) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    series = tmp_path / "ckpt" / "group-0" / "step-00000004"
    series.mkdir(parents=True)
    from flwr_sharded.config import TrainConfig, config_to_dict

    saved = config_to_dict(TrainConfig())
    saved["parallel"].update(method="fl-fsdp", federations=4, replicas=1, shards=1)
    (series / "meta.json").write_text(json.dumps({"step": 4, "config": saved}))
    (series.parent / LATEST).write_text(series.name)
    # one group's checkpoint is not the run's: both groups resume from the same step, which group 1 lacks
    assert main([*ARGS, "--data-dir", str(data_dir), "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume"]) == 2
    assert "every federation group holds" in capsys.readouterr().err
    shutil.copytree(series.parent, tmp_path / "ckpt" / "group-1")
    series_1 = tmp_path / "ckpt" / "group-1" / series.name
    assert main([*ARGS, "--data-dir", str(data_dir), "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume"]) == 2
    assert "parallel.method='fl-fsdp'" in capsys.readouterr().err
    # a bfloat16 sync needs the global shards, which a float32 fedavg checkpoint does not hold
    from flwr_sharded.train import resolve_config, train_parser

    saved = config_to_dict(resolve_config(train_parser().parse_args([*ARGS, "--data-dir", str(data_dir)])))
    for meta in (series / "meta.json", series_1 / "meta.json"):
        meta.write_text(json.dumps({"step": 4, "config": saved}))
    assert main([*ARGS, "--data-dir", str(data_dir), "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume",
                 "--sync-dtype", "bfloat16"]) == 2
    assert "parallel.sync_dtype='float32'" in capsys.readouterr().err
    # a top-k sync's residuals hold what it has not sent yet: a dense sync cannot take them over
    saved["parallel"].update(sync_dtype="int8", sync_error_feedback=True, sync_topk=0.02)
    for meta in (series / "meta.json", series_1 / "meta.json"):
        meta.write_text(json.dumps({"step": 4, "config": saved}))
    assert main([*ARGS, "--data-dir", str(data_dir), "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume",
                 "--sync-dtype", "int8", "--sync-error-feedback"]) == 2
    assert "parallel.sync_topk=0.02" in capsys.readouterr().err
    # the sum merge's residuals are weighted, scatter-mean's are not: a checkpoint from before the option summed
    del saved["parallel"]["sync_topk_merge"]
    for meta in (series / "meta.json", series_1 / "meta.json"):
        meta.write_text(json.dumps({"step": 4, "config": saved}))
    assert main([*ARGS, "--data-dir", str(data_dir), "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume",
                 "--sync-dtype", "int8", "--sync-error-feedback", "--sync-topk", "0.02"]) == 2
    assert "parallel.sync_topk_merge='sum'" in capsys.readouterr().err


def _start_torchrun(nproc: int, args: list[str], log: Path, **env: str) -> subprocess.Popen:
    """`torchrun -m flwr_sharded.train` in its own session, output to `log`; the caller kills it (`_kill_job`)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(free_port()), "-m", "flwr_sharded.train", *args]
    with open(log, "ab") as fh:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1",
                                **env}, cwd=REPO, start_new_session=True)


def _kill_job(launcher: subprocess.Popen, workers: list[int]) -> None:
    """SIGKILL the workers, then the launcher (so none outlives it), and reap the launcher; bounded."""
    for pid in [*workers, *children(launcher.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(launcher.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    launcher.wait(timeout=30)


def _wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the job exited ({proc.returncode}) before {what}:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not seen within {timeout:.0f} s")
        time.sleep(0.02)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_job_killed_while_writing_a_checkpoint_resumes_from_the_last_committed_one(data_dir, tmp_path):
    """fsdp S=2, 12 steps, a checkpoint every 4. The test-only fault hook (`tests/faults`, `commit_delay`) holds every
    commit for 8 s; once step 8's files are all written into `step-00000008.tmp/` (its `meta.json.part` exists), the
    whole job (both ranks and the launcher) gets SIGKILL.

    The committed step 4 stays `latest` and intact, the partial step 8 is never taken as a checkpoint, and `--resume`
    (no hook) continues at step 5 with the losses the killed run logged for steps 5-8, then commits steps 8 and 12.
    Recovery time = relaunch -> first step after the checkpoint.
    """
    ckpt, series = tmp_path / "ckpt", tmp_path / "ckpt" / "group-0"
    common = ["--method", "fsdp", "--shards", "2", "--model", "tiny", "--seq-len", "32", "--batch-size", "2",
              "--steps", "12", "--log-every", "1", "--eval-every", "0", "--eval-blocks", "4", "--lr", "3e-3",
              "--no-progress", "--data-dir", str(data_dir), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "4",
              "--no-save-model"]
    killed_run, resumed_run = tmp_path / "killed", tmp_path / "resumed"
    resumed_metrics = resumed_run / "metrics.jsonl"
    job = _start_torchrun(2, [*common, "--run-dir", str(killed_run)], tmp_path / "killed.log",
                          **faults_env(commit_delay=8))
    workers: list[int] = []
    try:
        _wait_for(lambda: (series / LATEST).is_file(), 180, "the commit of step 4", job, tmp_path / "killed.log")
        workers = children(job.pid)
        partial = series / "step-00000008.tmp"
        _wait_for(lambda: (partial / "meta.json.part").is_file(), 60, "step 8 written", job, tmp_path / "killed.log")
    finally:
        _kill_job(job, workers)  # the fault: SIGKILL of the whole job (and the clean-up if a wait above failed)
    assert job.returncode == -signal.SIGKILL
    assert len(workers) == 2
    deadline = time.monotonic() + 10
    while any(pid_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(pid) for pid in workers)

    # the crash left a complete-looking but uncommitted step 8; `latest` still names step 4, which is whole
    assert (series / LATEST).read_text() == "step-00000004"
    assert latest_checkpoint(series) == series / "step-00000004"
    assert not (series / "step-00000008").exists() and not (partial / "meta.json").exists()
    assert {"rank-0.pt", "rank-1.pt", ".metadata"} <= {p.name for p in partial.iterdir()}  # written, not committed
    assert read_meta(series / "step-00000004")["step"] == 4
    assert {"rank-0.pt", "rank-1.pt", ".metadata"} <= {p.name for p in (series / "step-00000004").iterdir()}
    killed = _losses(killed_run)
    assert sorted(killed) == list(range(1, 9))

    restarted = time.monotonic()
    job = _start_torchrun(2, [*common, "--resume", "--run-dir", str(resumed_run)], tmp_path / "resumed.log")
    try:
        _wait_for(lambda: resumed_metrics.is_file() and bool(_losses(resumed_run, resumed=True)), 180,
                  "the first resumed step", job, tmp_path / "resumed.log")
        first_step_s = time.monotonic() - restarted
        assert job.wait(timeout=180) == 0, (tmp_path / "resumed.log").read_text()[-4000:]
        resumed_s = time.monotonic() - restarted
    finally:
        _kill_job(job, [])
    resumed = _losses(resumed_run, resumed=True)
    assert sorted(resumed) == list(range(5, 13))  # from the committed step 4, not from the partial step 8
    for step in range(5, 9):
        assert resumed[step] == pytest.approx(killed[step], abs=1e-6)
    assert (series / LATEST).read_text() == "step-00000012"
    assert sorted(p.name for p in series.glob("step-*")) == ["step-00000008", "step-00000012"]  # .tmp replaced
    print(f"\ncheckpoint-write kill: resumed from step 4 (4 steps redone); first new step {first_step_s:.1f} s after "
          f"the relaunch, the 8 remaining steps and 2 checkpoints done {resumed_s:.1f} s after it")


@pytest.mark.dist
def test_resume_extends_a_run_in_its_run_directory(data_dir, tmp_path):
    """`flwr-sharded train --steps 30 --resume` after a 20-step run, as the docs type it (one process): the steps the
    schedule had planned are taken as before, the extra ones at its final rate, and the run directory's metrics go
    on (one record per step, one summary, at the end)."""
    from tests.training.test_train_launch import flwr_sharded_train

    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    common = ["--method", "fsdp", "--shards", "1", "--model", "tiny", "--seq-len", "32", "--batch-size", "2",
              "--log-every", "1", "--eval-every", "0", "--eval-blocks", "2", "--lr", "3e-3", "--no-save-model",
              "--no-progress", "--data-dir", str(data_dir), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "10"]
    first = flwr_sharded_train(*common, "--steps", "20", "--run-dir", str(run_dir), timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    before = _losses(run_dir)
    refused = flwr_sharded_train(*common, "--steps", "5", "--resume", timeout=120)
    assert refused.returncode == 2 and "--steps 5 is below the checkpoint's step 20" in refused.stderr
    (ckpt / "group-0" / LATEST).write_text("step-00000010")  # as if the run had died after step 10
    resumed = flwr_sharded_train(*common, "--steps", "30", "--resume", timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (f"resumed from step 10 (checkpoint {ckpt / 'group-0' / 'step-00000010'}); --steps 30 extends the run: "
            "the learning-rate schedule keeps its 20 steps, steps 21-30 run at its final rate 0.0003") \
        in resumed.stderr, resumed.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds.count("summary") == 1 and kinds[-1] == "summary" and records[-1]["steps"] == 30
    steps = [r["step"] for r in records if r["kind"] == "train"]
    assert steps == list(range(1, 31)) and kinds.index("resume") == kinds.index("train") + 10  # 11-20 redone once
    after = _losses(run_dir)
    for step in range(11, 21):  # the schedule the checkpoint had planned: the same steps as before
        assert after[step] == pytest.approx(before[step], abs=1e-6)
    lrs = {r["step"]: r["lr"] for r in records if r["kind"] == "train"}
    assert all(lrs[s] == pytest.approx(3e-4) for s in range(21, 31)) and lrs[10] > 3e-4
    elapsed = [r["elapsed_s"] for r in records if r["kind"] == "train"]
    assert elapsed == sorted(elapsed)  # the time axis goes on from the earlier run's
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 30


def _damage(checkpoint: Path) -> str:
    """Cut the largest file of a checkpoint to half its size (a copy interrupted, a disk that lost blocks)."""
    victim = max((p for p in checkpoint.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    with open(victim, "r+b") as fh:
        fh.truncate(victim.stat().st_size // 2)
    return victim.name


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_groups_resume_together_from_the_newest_step_every_group_holds_intact(data_dir, tmp_path, monkeypatch,
                                                                                capsys):
    """Two groups; group 0's newest checkpoint damaged: both resume from the step before (group 1 passes over its
    intact newest one), take the same steps as the run straight through, and write no checkpoint off schedule. With
    no step intact in both, --resume stops before any work, naming what each group holds. A write that fails in one
    group leaves the other's previous checkpoint in place (keep 1), so the run resumes from it."""
    from flwr_sharded.train import main

    ckpt = tmp_path / "ckpt"
    common = [*ARGS, "--data-dir", str(data_dir), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "4"]
    _run([*common, "--run-dir", str(tmp_path / "straight")])
    cut = _damage(ckpt / "group-0" / "step-00000012")
    out = train_ranks(4, [*common, "--resume", "--run-dir", str(tmp_path / "resumed")], timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resume: skipped step-00000012 ({cut} has" in out.stderr, out.stderr[-3000:]  # group 0 says why
    assert "skipped step-00000012 (not complete in every federation group)" in out.stderr  # and group 1
    straight, resumed = _losses(tmp_path / "straight"), _losses(tmp_path / "resumed", resumed=True)
    assert sorted(resumed) == [9, 10, 11, 12]  # from step 8, in both groups (else the syncs would not line up)
    for step in resumed:
        assert resumed[step] == pytest.approx(straight[step], abs=1e-6)
    for group in ("group-0", "group-1"):  # step 12 written again, nothing off schedule (no step 9)
        assert sorted(p.name for p in (ckpt / group).iterdir()) == [LATEST, "step-00000008", "step-00000012"]
        assert latest_checkpoint(ckpt / group).name == "step-00000012"

    # no step intact in both: stopped before any process group, each group's steps named
    monkeypatch.setenv("WORLD_SIZE", "4")
    _damage(ckpt / "group-0" / "step-00000008")
    _damage(ckpt / "group-1" / "step-00000012")
    capsys.readouterr()
    assert main([*common, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "every federation group holds" in err and "group 0: 12; group 1: 8" in err, err

    # keep 1: step 8's write fails in group 1 only (its directory's name is taken by a file); group 0's step 4,
    # the newest step both hold, is not rotated away, and the run resumes from it
    shutil.rmtree(ckpt)
    (ckpt / "group-1").mkdir(parents=True)
    (ckpt / "group-1" / "step-00000008.tmp").write_text("in the way")
    one = [*common, "--keep-checkpoints", "1", "--steps", "8"]
    failed = train_ranks(4, [*one, "--run-dir", str(tmp_path / "failed")], timeout=240)
    assert failed.returncode != 0 and "checkpoint step-00000008 not written" in failed.stderr, failed.stderr[-3000:]
    assert (ckpt / "group-0" / "step-00000004").is_dir() and (ckpt / "group-1" / "step-00000004").is_dir()
    (ckpt / "group-1" / "step-00000008.tmp").unlink()
    _run([*one, "--resume", "--run-dir", str(tmp_path / "again")])
    assert sorted(_losses(tmp_path / "again", resumed=True)) == [5, 6, 7, 8]


def _mount_tmpfs(where: Path, size: str) -> None:
    """A tmpfs of `size` at `where`; skips the test where mounting is not permitted (not root, a container without
    CAP_SYS_ADMIN)."""
    where.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a {size} tmpfs for the checkpoint directory (needs root and CAP_SYS_ADMIN): "
                    f"{mounted.stderr.strip()}")


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_checkpoint_that_finds_the_disk_full_stops_the_run_and_the_previous_one_resumes_bit_for_bit(data_dir,
                                                                                                    tmp_path):
    """fsdp S=2, 12 steps, a checkpoint every 4, the checkpoint directory on a 5 MiB tmpfs (one checkpoint of the tiny
    model and its Adam moments is about 3.3 MiB): step 4 is committed, step 8 runs out of space while it is written.

    The run stops (exit 1) with one error naming the failure, the step and the newest checkpoint; the partial step 8
    is removed, so `latest` and the only step directory are step 4's. Once there is room (the tmpfs remounted at
    20 MiB), `--resume` loads step 4 and takes steps 5-8 with exactly the losses the stopped run logged (the same
    floats: model, optimizer, data position and RNG restored bit for bit), then commits steps 8 and 12."""
    ckpt = tmp_path / "ckpt"
    series = ckpt / "group-0"
    common = ["--method", "fsdp", "--shards", "2", "--model", "tiny", "--seq-len", "32", "--batch-size", "2",
              "--steps", "12", "--log-every", "1", "--eval-every", "0", "--eval-blocks", "4", "--lr", "3e-3",
              "--no-progress", "--data-dir", str(data_dir), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "4",
              "--no-save-model"]
    _mount_tmpfs(ckpt, "5m")
    try:
        full = train_ranks(2, [*common, "--run-dir", str(tmp_path / "full")], timeout=240)
        assert full.returncode == 1, full.stderr[-4000:]
        assert "checkpoint step-00000008 not written" in full.stderr, full.stderr[-4000:]
        # the rank whose write meets the full disk first says so; torch's zip writer of another may report the short
        # write as "unexpected pos"
        assert "No space left on device" in full.stderr or "unexpected pos" in full.stderr, full.stderr[-4000:]
        assert "The run stops at step 8 (newest checkpoint: step-00000004)" in full.stderr, full.stderr[-4000:]
        assert (series / LATEST).read_text() == "step-00000004"
        assert sorted(p.name for p in series.iterdir()) == [LATEST, "step-00000004"]  # no step-8 or .tmp left
        assert latest_checkpoint(series) == series / "step-00000004"
        stopped = _losses(tmp_path / "full")
        print("\nfull tmpfs: " + next(line for line in full.stderr.splitlines() if "flwr-sharded: error" in line))
        assert sorted(stopped) == list(range(1, 9))

        remounted = subprocess.run(["mount", "-o", "remount,size=20m", str(ckpt)], capture_output=True, text=True)
        assert remounted.returncode == 0, remounted.stderr
        resumed_run = train_ranks(2, [*common, "--resume", "--run-dir", str(tmp_path / "resumed")], timeout=240)
        assert resumed_run.returncode == 0, resumed_run.stderr[-4000:]
        resumed = _losses(tmp_path / "resumed", resumed=True)
        assert sorted(resumed) == list(range(5, 13))  # from step 4
        assert [resumed[s] for s in range(5, 9)] == [stopped[s] for s in range(5, 9)]  # bit for bit
        assert (series / LATEST).read_text() == "step-00000012"
        assert sorted(p.name for p in series.glob("step-*")) == ["step-00000008", "step-00000012"]
    finally:
        subprocess.run(["umount", "-l", str(ckpt)], capture_output=True)
