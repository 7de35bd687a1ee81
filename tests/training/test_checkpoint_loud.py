"""Checkpoints that cannot be written are loud: an async save writes over a gloo group of its own (DCP refuses a group
without a CPU backend, as NCCL's is), and a write that fails stops the static engine's run with a clear error.
In-process, a world of one gloo rank."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from flwr_sharded.training import checkpoint as checkpoint_lib
from flwr_sharded.training.checkpoint import CheckpointWriteError, Checkpointer
from flwr_sharded.training.checkpoint_series import LATEST, latest_checkpoint
from tests.multiproc import free_port


@pytest.fixture
def world_of_one():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def test_an_async_save_needs_a_cpu_backend_and_writes_over_its_own_gloo_group(world_of_one, tmp_path, monkeypatch):
    dist = world_of_one
    gpu_only = dist.new_group(backend="cuda:gloo")  # like an NCCL group: no CPU backend
    assert not checkpoint_lib.cpu_capable(gpu_only) and checkpoint_lib.cpu_capable(dist.group.WORLD)
    common = dict(fed_index=0, group_rank=0, group_pg=dist.group.WORLD, async_save=True)
    with pytest.raises(ValueError, match="no process group to write over"):
        Checkpointer(tmp_path, **common)
    with pytest.raises(ValueError, match="no CPU backend"):
        Checkpointer(tmp_path, **common, async_pg=gpu_only)

    own = checkpoint_lib.write_group([[0]], 0, 60.0)
    seen = []
    async_save = checkpoint_lib.dcp.async_save
    monkeypatch.setattr(checkpoint_lib.dcp, "async_save",
                        lambda *a, **k: seen.append(k["process_group"]) or async_save(*a, **k))
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    saver = Checkpointer(tmp_path, **common, async_pg=own)
    saver.save(1, model, optimizer, meta={}, rank_state={})
    saver.wait()
    assert seen == [own] and own is not dist.group.WORLD
    assert latest_checkpoint(saver.directory) == saver.directory / "step-00000001"
    expected = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    saver.load(saver.directory / "step-00000001", model, optimizer)
    assert torch.equal(model.weight, expected)

    saver.async_pg = gpu_only  # a group that cannot carry it: every rank is told at the commit, nothing is committed
    saver.save(2, model, optimizer, meta={}, rank_state={})
    with pytest.raises(CheckpointWriteError, match="no CPU backend.*step-00000001 is kept"):
        saver.wait()
    assert sorted(p.name for p in saver.directory.iterdir()) == [LATEST, "step-00000001"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_checkpoint_that_cannot_be_written_stops_the_run(data_dir, tmp_path, monkeypatch, capsys, async_save):
    """A full disk (injected) at step 4's checkpoint: the run stops with exit code 1 and the error (at once, or for
    an async save at the next save, step 6), the run directory says failed, step 2's checkpoint is kept."""
    import torch.distributed.checkpoint.filesystem as dcp_fs

    from flwr_sharded.train import main

    write_item = dcp_fs._write_item
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"

    def full_disk(*args, **kwargs):
        if (ckpt / "group-0" / "step-00000004.tmp").exists():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write_item(*args, **kwargs)

    monkeypatch.setattr(dcp_fs, "_write_item", full_disk)
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(key, value)
    args = ["--method", "fsdp", "--model", "tiny", "--seq-len", "32", "--batch-size", "2", "--steps", "8",
            "--log-every", "1", "--eval-every", "0", "--eval-blocks", "2", "--no-progress", "--data-dir", str(data_dir),
            "--run-dir", str(run_dir), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
            *(["--async-checkpoint"] if async_save else [])]
    assert main(args) == 1
    err = capsys.readouterr().err
    stop = 6 if async_save else 4
    assert "flwr-sharded: error: checkpoint step-00000004 not written" in err, err[-3000:]
    assert "No space left on device" in err and f"The run stops at step {stop}" in err, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "CheckpointWriteError" in summary["error"]
    steps = [json.loads(line).get("step") for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if json.loads(line).get("kind") == "train"]
    assert max(steps) == stop  # no training after the failure was known
    series = ckpt / "group-0"
    kept = ["step-00000002"] + (["step-00000006"] if async_save else [])  # an async save still wrote the next one
    assert sorted(p.name for p in series.iterdir() if p.name != LATEST) == kept
    assert Path(series / LATEST).read_text() == kept[-1]
