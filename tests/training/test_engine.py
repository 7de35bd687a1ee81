"""The four methods end to end through the real torchrun entry point, on gloo with a tiny model."""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.faults.cut_link import run_cut
from tests.multiproc import faults_env, needs_emulation, train_ranks

pytestmark = pytest.mark.dist  # every test here starts processes

LAYOUTS = {
    "fsdp": ["--method", "fsdp", "--shards", "4"],
    "hsdp": ["--method", "hsdp", "--replicas", "2", "--shards", "2"],
    "fl-fsdp": ["--method", "fl-fsdp", "--federations", "2", "--shards", "2"],
    "fl-hsdp": ["--method", "fl-hsdp", "--federations", "2", "--replicas", "2", "--shards", "1"],
}


def _common(data_dir: Path, tmp: Path, name: str) -> list[str]:
    return ["--model", "tiny", "--data-dir", str(data_dir), "--seq-len", "64", "--batch-size", "2",
            "--run-dir", str(tmp / name), "--no-progress", "--eval-blocks", "8"]


def _records(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r.get("kind") == kind]


def _state(directory: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory).state_dict()


def _run(nproc: int, args: list[str], timeout: float = 300, env: dict[str, str] | None = None) -> None:
    result = train_ranks(nproc, args, timeout=timeout, env=env)
    assert result.returncode == 0, result.stderr[-4000:]


SGD = ["--optimizer", "sgd", "--lr", "0.5", "--weight-decay", "0", "--grad-clip", "0", "--warmup", "0",
       "--min-lr-ratio", "1", "--aggregate-every", "1", "--steps", "6", "--eval-every", "0"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("fl,base,nproc", [
    (["--method", "fl-fsdp", "--federations", "2", "--shards", "2"], ["--method", "fsdp", "--shards", "4"], 4),
    (["--method", "fl-hsdp", "--federations", "2", "--replicas", "2", "--shards", "2"],
     ["--method", "hsdp", "--replicas", "4", "--shards", "2"], 8),
    (["--method", "fl-fsdp", "--federations", "4", "--shards", "1", "--sync-sites", "a,a,b,b"],
     ["--method", "fsdp", "--shards", "4"], 4),
], ids=["fl-fsdp=fsdp", "fl-hsdp=hsdp", "two-level-fl-fsdp=fsdp"])
def test_fl_with_sgd_and_a1_equals_its_base_method(data_dir, tmp_path, fl, base, nproc):
    """Plain SGD, A = 1, no clipping: averaging the groups' updated shards equals one step on the averaged gradient.

    Tolerance: 1e-5 absolute on every parameter after 6 steps (fp32; only the summation order differs).
    """
    _run(nproc, [*fl, *SGD, *_common(data_dir, tmp_path, "fl")])
    _run(nproc, [*base, *SGD, *_common(data_dir, tmp_path, "base")])
    fl_state, base_state = _state(tmp_path / "fl" / "model"), _state(tmp_path / "base" / "model")
    assert fl_state.keys() == base_state.keys()
    diffs = {k: float((fl_state[k] - base_state[k]).abs().max()) for k in fl_state}
    assert max(diffs.values()) < 1e-5, sorted(diffs.items(), key=lambda kv: -kv[1])[:3]
    # the runs did train: the weights moved away from each other's start by far more than the tolerance
    fl_losses = [r["loss"] for r in _records(tmp_path / "fl", "train")]
    base_losses = [r["loss"] for r in _records(tmp_path / "base", "train")]
    assert fl_losses == pytest.approx(base_losses, abs=1e-4)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("method", list(LAYOUTS))
def test_each_method_lowers_the_loss(data_dir, tmp_path, method):
    _run(4, [*LAYOUTS[method], *_common(data_dir, tmp_path, method), "--steps", "40", "--lr", "3e-3",
             "--aggregate-every", "4", "--log-every", "5", "--eval-every", "20", "--no-save-model"])
    train = _records(tmp_path / method, "train")
    evals = _records(tmp_path / method, "eval")
    assert train[-1]["loss"] < train[0]["loss"] - 1.0, (train[0]["loss"], train[-1]["loss"])
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    config = _records(tmp_path / method, "start")[0]
    assert config["effective_batch"] == (4 if method.startswith("fl-") else 8)
    if method.startswith("fl-"):
        assert train[-1]["syncs"] == 10 and train[-1]["sync_s"] > 0


@pytest.mark.timeout(300)
def test_gradient_accumulation_equals_the_larger_batch(data_dir, tmp_path):
    """Two micro-batches of 1 sequence give the same step as one batch of 2 (same blocks, mean of equal means)."""
    common = ["--method", "fsdp", "--shards", "2", *SGD, "--model", "tiny", "--data-dir", str(data_dir),
              "--seq-len", "64", "--no-progress", "--eval-blocks", "2"]
    _run(2, [*common, "--batch-size", "2", "--grad-accum", "1", "--run-dir", str(tmp_path / "big")])
    _run(2, [*common, "--batch-size", "1", "--grad-accum", "2", "--run-dir", str(tmp_path / "accum")])
    big, accum = _state(tmp_path / "big" / "model"), _state(tmp_path / "accum" / "model")
    assert max(float((big[k] - accum[k]).abs().max()) for k in big) < 1e-5


FAILED_SYNC = ["--method", "fl-fsdp", "--federations", "2", "--shards", "1", "--aggregate-every", "2",
               "--steps", "6", "--log-every", "1", "--eval-every", "0", "--no-save-model"]


@pytest.mark.timeout(300)
def test_a_sync_that_fails_on_one_member_is_rolled_back_everywhere_and_training_goes_on(data_dir, tmp_path):
    """Member 0 fails its second sync after the reduction succeeded everywhere (injected): both members roll back
    to the first sync (step 2), train steps 3-4 again on fresh batches and adopt the next syncs; the run completes
    with the failure in its metrics. With --sync-retries 0 the same failure stops every rank with the error."""
    _run(2, [*FAILED_SYNC, *_common(data_dir, tmp_path, "retry")], env=faults_env(fail_sync=2))
    failed = _records(tmp_path / "retry", "sync_failed")
    assert [(r["step"], r["restored_step"], r["retry"]) for r in failed] == [(4, 2, 1)]
    assert "injected fault: sync attempt 2 fails" in failed[0]["error"]
    train = _records(tmp_path / "retry", "train")
    assert [r["step"] for r in train] == [1, 2, 3, 3, 4, 5, 6]  # step 4's window undone, steps 3-4 trained again
    assert train[-1]["syncs"] == 3 and train[3]["loss"] != train[2]["loss"]  # fresh batches after the rollback

    result = train_ranks(2, [*FAILED_SYNC, "--sync-retries", "0", *_common(data_dir, tmp_path, "stop")], timeout=200,
                      env=faults_env(fail_sync=2))
    assert result.returncode != 0
    assert "the sync of fragment 0 after step 4 failed" in result.stderr and "--sync-retries 0: stopping" in \
        result.stderr, result.stderr[-3000:]
    assert json.loads((tmp_path / "stop" / "summary.json").read_text())["status"] == "failed"


@pytest.mark.timeout(300)
def test_an_overlapped_sync_lost_by_one_member_is_undone_by_all_at_their_next_exchange(data_dir, tmp_path):
    """Overlapped syncs (tau = 1, A = 2): member 0's second sync fails when its result arrives (injected), after
    member 1 merged it. Member 0 merges nothing and restores nothing; at the members' next exchange its count of
    adopted merges is behind, and both return to the last confirmed commit (step 2) together and train on to the
    end. The next exchange is the next sync's admission (records every 8 steps: the failure is every member's at
    the merge after step 6) or the confirmation before a record (every step: at step 4 already). Either way one
    failure, restored to step 2, blaming member 0, and the same steps after it on both members (else their syncs
    and records would not line up)."""
    overlapped = ["--method", "fl-fsdp", "--federations", "2", "--shards", "1", "--aggregate-every", "2",
                  "--sync-delay", "1", "--steps", "8", "--eval-every", "0", "--no-save-model", "--sync-retries", "3"]
    for log_every, failed_at in ((8, 6), (1, 4)):
        name = f"log{log_every}"
        _run(2, [*overlapped, "--log-every", str(log_every), *_common(data_dir, tmp_path, name)],
             env=faults_env(fail_sync=2))
        failed = _records(tmp_path / name, "sync_failed")
        assert [(r["step"], r["restored_step"], r["blame"]) for r in failed] == [(failed_at, 2, [0])], failed
        assert "did not adopt a merge the others adopted" in failed[0]["error"]
        train = _records(tmp_path / name, "train")
        assert train[-1]["step"] == 8 and train[-1]["syncs"] == 4  # steps 3-8 again: syncs at 4, 6, 8 after 2
        if log_every == 1:
            assert [r["step"] for r in train] == [1, 2, 3, 3, 4, 5, 6, 7, 8]


@pytest.mark.timeout(300)
def test_a_failed_collective_is_retried_where_its_groups_recover_and_stops_the_run_where_they_cannot(data_dir,
                                                                                                  tmp_path):
    """Member 0's second sync fails as a collective (injected): every rank learns it was a failed collective; over
    gloo the run rolls back and trains on; where the groups cannot be rebuilt (NCCL's, emulated) every rank stops
    with the error and the way to resume, whatever --sync-retries says."""
    _run(2, [*FAILED_SYNC, *_common(data_dir, tmp_path, "gloo")], env=faults_env(fail_sync=2, collective_sync=1))
    assert [(r["step"], r["restored_step"]) for r in _records(tmp_path / "gloo", "sync_failed")] == [(4, 2)]

    result = train_ranks(2, [*FAILED_SYNC, *_common(data_dir, tmp_path, "nccl")], timeout=200,
                      env=faults_env(fail_sync=2, collective_sync=1, no_rebuild=1))
    assert result.returncode != 0
    assert "a collective failed on NCCL" in result.stderr and "--resume" in result.stderr, result.stderr[-3000:]
    assert json.loads((tmp_path / "nccl" / "summary.json").read_text())["status"] == "failed"


@pytest.mark.timeout(300)
def test_a_member_lying_about_its_values_is_rolled_back_everywhere_named_and_training_goes_on(data_dir, tmp_path):
    """Member 2 of three sends 1e30 to its second sync and reports itself healthy (the test-only hook of
    `tests/faults`): every rank rejects the result, names member 2, returns to the first sync (step 2) and
    trains on; the run completes with a finite loss."""
    args = [*FAILED_SYNC, "--federations", "3", *_common(data_dir, tmp_path, "lie")]
    result = train_ranks(3, args, timeout=250, env=faults_env(lie="1e30@2@2"))
    assert result.returncode == 0, result.stderr[-4000:]
    failed = _records(tmp_path / "lie", "sync_failed")
    assert [(r["step"], r["restored_step"], r["blame"]) for r in failed] == [(4, 2, [2])], failed
    assert "member(s) [2] of the federation group sent it" in failed[0]["error"]
    train = _records(tmp_path / "lie", "train")
    assert train[-1]["step"] == 6 and train[-1]["syncs"] == 3 and train[-1]["loss"] < 20, train[-1]


@pytest.mark.timeout(600)
def test_a_top_k_sync_in_two_levels_trains_and_a_lying_member_is_rolled_back_and_named(data_dir, tmp_path):
    """Four groups at sites a, a, b, b syncing 2% of each delta in two levels (`parallel.sparse_sites`): every sync
    is adopted and the loss stays finite (`tests/parallel/test_sites_topk.py` holds the members bit-identical). With
    member 2 sending 1e30 to its second sync and reporting itself healthy, in two levels and with the flat top-k, every
    rank rejects the result (its row is far above the others': `sparse.outlying_rows`), names member 2 (not its
    site's other member 3), returns to the first sync and trains on."""
    topk = [*FAILED_SYNC, "--federations", "4", "--sync-topk", "0.02", "--sync-error-feedback"]
    two_level = [*topk, "--sync-sites", "a,a,b,b"]
    _run(4, [*two_level, *_common(data_dir, tmp_path, "sites")], timeout=300)
    train = _records(tmp_path / "sites", "train")
    assert train[-1]["step"] == 6 and train[-1]["syncs"] == 3 and not _records(tmp_path / "sites", "sync_failed")
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in train) and train[-1]["loss"] < 20, train[-1]
    for name, args in {"lie": two_level, "flat-lie": topk}.items():
        result = train_ranks(4, [*args, *_common(data_dir, tmp_path, name)], timeout=300,
                             env=faults_env(lie="1e30@2@2"))
        assert result.returncode == 0, result.stderr[-4000:]
        failed = _records(tmp_path / name, "sync_failed")
        assert [(r["step"], r["restored_step"], r["blame"]) for r in failed] == [(4, 2, [2])], (name, failed)
        assert "member(s) [2] of the federation group sent it" in failed[0]["error"], (name, failed)
        train = _records(tmp_path / name, "train")
        assert train[-1]["step"] == 6 and all(torch.isfinite(torch.tensor(r["loss"])) for r in train), train[-1]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("wire", [["--sync-dtype", "int8"], ["--sync-delay", "1"]],
                         ids=["int8-values", "fp32-overlapped"])
def test_a_top_k_sync_trains_and_stays_finite(data_dir, tmp_path, wire):
    """Two groups syncing 2% of each delta (`--sync-topk`, error feedback): blocking with int8 values, and
    overlapped (tau = 1) with fp32 values, logged after every step, while a sync is in flight (with S = 1 the
    federation group spans the world: it must not be the group of the main thread's log all-reduce). Every sync is
    adopted and the loss stays finite."""
    args = [*FAILED_SYNC, "--sync-topk", "0.02", "--sync-error-feedback", *wire, *_common(data_dir, tmp_path, "topk")]
    result = train_ranks(2, args, timeout=250)
    assert result.returncode == 0, result.stderr[-4000:]
    train = _records(tmp_path / "topk", "train")
    assert train[-1]["step"] == 6 and train[-1]["syncs"] == 3 and not _records(tmp_path / "topk", "sync_failed")
    assert "top-k 0.02 with error feedback" in result.stderr
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in train) and train[-1]["loss"] < 20, train[-1]


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_a_rank_frozen_inside_a_sync_is_retried_without_a_partial_commit_and_catches_up(data_dir, tmp_path):
    """fl-fsdp F=3, S=1, 8 steps, a sync every 2, --timeout 10, --sync-retries 3. The rank of group 1 stops itself
    (SIGSTOP, the test-only hook `freeze_sync`) inside its second sync, after the admission: groups 0 and 2 wait
    in the reduction until the timeout, fail that sync together (one `sync_failed` record, within the timeout +
    10 s of the freeze) and go back to the first sync's step. After 15 s (longer than the timeout) the frozen rank
    gets SIGCONT: its reduction fails too, it rolls back to the same step, and the retries bring all three groups to
    the run's end with the same model (each group's final checkpoint exported and compared exactly)."""
    from tests.multiproc import children
    from tests.training.test_checkpoint import _kill_job, _start_torchrun

    from flwr_sharded.training.checkpoint_export import export_pretrained

    timeout, run_dir, ckpt, log = 10.0, tmp_path / "run", tmp_path / "ckpt", tmp_path / "run.log"
    args = ["--method", "fl-fsdp", "--federations", "3", "--shards", "1", "--model", "tiny", "--data-dir",
            str(data_dir), "--seq-len", "32", "--batch-size", "2", "--steps", "8", "--aggregate-every", "2",
            "--log-every", "1", "--eval-every", "0", "--eval-blocks", "4", "--no-progress", "--no-save-model",
            "--timeout", str(timeout), "--sync-retries", "3", "--run-dir", str(run_dir), "--checkpoint-dir", str(ckpt)]
    job = _start_torchrun(3, args, log, **faults_env(freeze_sync="2@1"))
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 180
        frozen = None
        while frozen is None:
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            workers = children(job.pid)
            frozen = next((pid for pid in workers if _stopped(pid)), None)
            time.sleep(0.05)
        frozen_at = time.monotonic()
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.is_file() and _records(run_dir, "sync_failed")):
            assert job.poll() is None and time.monotonic() < frozen_at + 60, log.read_text()[-4000:]
            time.sleep(0.1)
        failed_s = time.monotonic() - frozen_at
        time.sleep(max(0.0, frozen_at + 15 - time.monotonic()))
        assert _stopped(frozen)
        os.kill(frozen, signal.SIGCONT)
        assert job.wait(timeout=200) == 0, log.read_text()[-6000:]
    finally:
        _kill_job(job, workers)
    failed = _records(run_dir, "sync_failed")
    assert failed[0]["step"] == 4 and failed[0]["restored_step"] == 2, failed
    assert failed_s < timeout + 10, failed_s
    train = _records(run_dir, "train")
    assert train[-1]["step"] == 8 and math.isfinite(train[-1]["loss"])
    states = [_state(export_pretrained(ckpt / f"group-{f}", tmp_path / f"model-{f}")) for f in range(3)]
    for other in states[1:]:
        assert all(torch.equal(states[0][k], other[k]) for k in states[0])
    print(f"\nstatic engine, a rank frozen inside a sync: the others failed it {failed_s:.1f} s after the freeze "
          f"(--timeout {timeout:.0f} s); {len(failed)} failed sync(s), the run completed with equal models")


@pytest.mark.slow
@needs_emulation
@pytest.mark.timeout(600)
def test_a_groups_uplink_cut_inside_a_sync_is_retried_without_a_partial_commit_and_catches_up(data_dir, tmp_path):
    """fl-fsdp F=3 x S=2 in the emulated network, a group per node, --timeout 25, --sync-retries 3: group 1's uplink
    goes down for 30 s while its rank 1 is inside the second sync (shard 0's reduction done, shard 1's waiting for it;
    `tests/faults/cut_link.py`). Every member fails that sync together within the timeout + 10 s (its ranks that
    finished wait for the one still inside its reduction, not time out before it) and goes back to the first sync's
    step; once the link is back, the groups are made anew and the retries bring all three to the run's end with the
    same model (each group's final checkpoint exported and compared exactly)."""
    from flwr_sharded.training.checkpoint_export import export_pretrained

    seen = run_cut("static", tmp_path, data_dir)
    assert seen["ranks_exit"] == 0, seen.get("error")
    assert seen["failed_s"] < seen["timeout"] + 10, seen
    failed, train = _records(tmp_path / "run", "sync_failed"), _records(tmp_path / "run", "train")
    assert failed[0]["step"] == 4 and failed[0]["restored_step"] == 2, failed
    assert train[-1]["step"] == 8 and math.isfinite(train[-1]["loss"])
    states = [_state(export_pretrained(tmp_path / "ckpt" / f"group-{f}", tmp_path / f"model-{f}")) for f in range(3)]
    for other in states[1:]:
        assert all(torch.equal(states[0][k], other[k]) for k in states[0])
    print(f"\nstatic engine, a group's uplink cut for {seen['cut_s']:.0f} s inside a sync: every member failed it "
          f"{seen['failed_s']:.1f} s after the cut (--timeout {seen['timeout']:.0f} s), {len(failed)} failed sync(s); "
          f"the run ended {seen['ended_s'] - seen['restored_s']:.1f} s after the link came back, with equal models")
