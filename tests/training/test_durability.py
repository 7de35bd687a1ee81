"""Durable checkpoints: a full disk keeps the previous checkpoint and training goes on, a corrupted committed
checkpoint is skipped for the previous complete one, a resume with another lr/optimizer/precision/schedule is
refused naming the option, and every file loads with `weights_only=True`. Two gloo ranks, the tiny model."""

from __future__ import annotations

import json
import shutil
import os
import time
from pathlib import Path

import pytest
import torch

from flwr_sharded.config import TrainConfig, config_to_dict
from flwr_sharded.errors import ConfigError
from flwr_sharded.training import checkpoint_files
from flwr_sharded.training.checkpoint_resume import check_resumable
from flwr_sharded.training.checkpoint_series import LATEST, find_checkpoint, latest_checkpoint
from tests.multiproc import run_ranks


def _config(data_dir: str, ckpt: str, **optim) -> TrainConfig:
    cfg = TrainConfig()
    cfg.parallel.method, cfg.parallel.shards = "fsdp", 2
    cfg.model.name, cfg.data.data_dir, cfg.data.seq_len, cfg.data.eval_blocks = "tiny", data_dir, 32, 4
    cfg.batch_size, cfg.steps, cfg.optim.lr = 2, 12, 3e-3
    cfg.checkpoint.dir, cfg.checkpoint.keep = ckpt, 2
    for key, value in optim.items():
        setattr(cfg.optim, key, value)
    return cfg


def _trainer(cfg: TrainConfig):
    from flwr_sharded.parallel.topology import init_topology
    from flwr_sharded.training.trainer import Trainer

    return Trainer(cfg, init_topology(cfg.parallel))


def _train(trainer, steps: int) -> list[float]:
    return [float(trainer.step()) for _ in range(steps)]


def _checksum(trainer) -> float:
    from flwr_sharded.training.trainer import local_shards_checksum

    return local_shards_checksum(trainer.model)


def _faults(rank: int, world: int, data_dir: str, ckpt: str) -> dict:
    """One trainer: a checkpoint at step 2; at step 4 a full disk (ENOSPC) in rank 1's DCP shard write, at step 6 in
    rank 0's rank-state file of an async save; complete checkpoints at steps 8 and 10. Then step 10's shard file is
    truncated and step 8's rank-1 state overwritten with zeros of the same size (only loading tells), and a new
    trainer resumes: it must skip both and go on from step 2 with the losses steps 3-4 had."""
    import errno
    import logging

    import torch.distributed as dist
    import torch.distributed.checkpoint.filesystem as dcp_fs

    cfg = _config(data_dir, ckpt)
    cfg.checkpoint.keep, cfg.checkpoint.async_save = 3, True  # the async saves' write group is built
    t = _trainer(cfg)
    cfg.checkpoint.async_save = t.checkpointer.async_save = False  # each save below sets its mode
    _train(t, 2)
    t.save_checkpoint()
    at_2 = _checksum(t)
    reference = _train(t, 2)

    def enospc(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    out: dict = {"reference": reference, "full_disk": []}
    for module, name, victim, async_save in ((dcp_fs, "_write_item", 1, False), (checkpoint_files, "write_bytes", 0, True)):
        t.checkpointer.async_save = async_save
        original = getattr(module, name)
        if rank == victim:
            setattr(module, name, enospc)
        start = time.perf_counter()
        error = t.checkpoint_or_report(lambda: (t.save_checkpoint(), t.checkpointer.wait()))  # async: fails in wait
        failed_s = time.perf_counter() - start
        setattr(module, name, original)  # the disk has room again
        step_before = t.step_count
        losses = _train(t, 2)  # training goes on from where it was
        out["full_disk"].append({"error": error, "failed_s": failed_s, "steps": (step_before, t.step_count),
                                 "finite": all(x == x for x in losses)})
    t.checkpointer.async_save = False
    t.save_checkpoint()
    out["next_complete_s"] = time.perf_counter() - start  # from the second failure to the commit of step 8
    _train(t, 2)
    t.save_checkpoint()
    out["committed"] = sorted(p.name for p in (Path(ckpt) / "group-0").iterdir())
    dist.barrier()
    series = Path(ckpt) / "group-0"
    if rank == 0:
        victim = sorted((series / "step-00000010").glob("*.distcp"))[-1]  # cut short: a full disk, a partial copy
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
        victim = series / "step-00000008" / "rank-1.pt"  # same size, garbage
        victim.write_bytes(bytes(victim.stat().st_size))
    dist.barrier()
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("flwr_sharded.training.trainer").addHandler(Keep())
    cfg.checkpoint.resume = True
    start = time.perf_counter()
    resumed = _trainer(cfg)
    resumed.resume()
    out.update(resume_s=time.perf_counter() - start, step=resumed.step_count,
               checksum_ok=abs(_checksum(resumed) - at_2) < 1e-9, losses=_train(resumed, 2), logs=records)
    resumed.save_checkpoint()
    resumed.checkpointer.prune()  # as a run does once every group committed it
    return out


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_full_disk_keeps_the_previous_checkpoint_and_a_corrupted_one_is_skipped(data_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    series = ckpt / "group-0"
    results = run_ranks(_faults, 2, str(data_dir), str(ckpt), timeout=240)
    for r in results:
        sync, background = r["full_disk"]  # both ranks were told, with the failing rank's reason
        assert "No space left on device" in sync["error"] and "group rank 1" in sync["error"], sync["error"]
        assert "checkpoint step-00000004 not written" in sync["error"] and "step-00000002 is kept" in sync["error"]
        assert "No space left on device" in background["error"] and "group rank 0" in background["error"]
        assert "checkpoint step-00000006 not written" in background["error"]
        assert [f["steps"] for f in r["full_disk"]] == [(4, 6), (6, 8)] and sync["finite"] and background["finite"]
        assert r["committed"] == [LATEST, "step-00000002", "step-00000008", "step-00000010"]  # no 4, 6 or .tmp
        assert r["step"] == 2 and r["checksum_ok"]
        assert r["losses"] == pytest.approx(r["reference"], abs=1e-6)  # optimizer, data position, RNG of step 2
    (line,) = results[0]["logs"]  # one line, on group rank 0, naming what was skipped and why
    assert "skipped step-00000010" in line and "bytes, the commit recorded" in line, line
    assert "step-00000008 (failed to load on group rank 1" in line and "resuming from step-00000002" in line, line
    assert results[1]["logs"] == []
    assert latest_checkpoint(series) == series / "step-00000004"  # the resumed timeline; 8 and 10 are dropped
    assert sorted(p.name for p in series.iterdir()) == [LATEST, "step-00000002", "step-00000004"]
    for step in ("step-00000002", "step-00000004"):
        assert checkpoint_files.incomplete_reason(series / step) == ""
        for rank_file in (series / step).glob("rank-*.pt"):  # plain tensors and containers only
            state = torch.load(rank_file, weights_only=True)
            assert isinstance(state["rng"], torch.Tensor) and set(state["stream"]) == {"epoch", "position"}
    for i, what in enumerate(("DCP shards, rank 1", "rank state, rank 0, async")):
        print(f"\nfull disk ({what}): reported on every rank, training went on, after "
              f"{max(r['full_disk'][i]['failed_s'] for r in results):.2f} s")
    print(f"\nfull disk: from the second failure to the next complete checkpoint (2 steps + save): "
          f"{max(r['next_complete_s'] for r in results):.2f} s")
    print(f"\ncorrupted checkpoints (truncated + garbage): resumed from the previous complete one in "
          f"{max(r['resume_s'] for r in results):.2f} s (model build + 2 skips + load)")


def _fake_checkpoint(tmp: Path, cfg: TrainConfig) -> Path:
    series = tmp / "ckpt" / "group-0"
    step = series / "step-00000004"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": 4, "config": config_to_dict(cfg)}))
    (series / LATEST).write_text(step.name)
    return step


@pytest.mark.parametrize("change,named", [
    ({"lr": 1e-3}, ["optim.lr=0.003", "optim.lr=0.001"]),
    ({"warmup": 0.0, "min_lr_ratio": 1.0}, ["optim.warmup=0.1", "optim.min_lr_ratio=0.1", "optim.warmup=0.0"]),
    ({"weight_decay": 0.0}, ["optim.weight_decay=0.1"]),
    ({"precision": "bf16"}, ["model.precision='auto'", "model.precision='bf16'"]),
])
def test_resume_refuses_a_changed_lr_schedule_or_precision(tmp_path, change, named):
    cfg = _config("/data", str(tmp_path / "ckpt"))
    _fake_checkpoint(tmp_path, cfg)
    mine = _config("/data", str(tmp_path / "ckpt"))
    for key, value in change.items():
        target = mine.model if key == "precision" else mine.optim
        setattr(target, key, value)
    with pytest.raises(ConfigError) as refused:
        check_resumable(mine, tmp_path / "ckpt")
    assert all(n in str(refused.value) for n in named), str(refused.value)
    assert "resume with the checkpoint's values" in str(refused.value)


def test_resume_may_extend_the_steps(tmp_path):
    cfg = _config("/data", str(tmp_path / "ckpt"))
    _fake_checkpoint(tmp_path, cfg)
    longer = _config("/data", str(tmp_path / "ckpt"))
    longer.steps = 24  # the schedule keeps the checkpoint's span (12); the extra steps run at the final rate
    check_resumable(longer, tmp_path / "ckpt")


def test_a_flower_group_resumes_from_its_own_series(tmp_path):
    """A Flower group's series follows its partition (`group-<partition id>`): it is checked alone, whatever the
    other partitions hold."""
    cfg = _config("/data", str(tmp_path / "ckpt"))
    step = _fake_checkpoint(tmp_path, cfg)
    with pytest.raises(ConfigError, match=r"no complete checkpoint in .*group-1"):
        check_resumable(cfg, tmp_path / "ckpt", groups=[1])
    (tmp_path / "ckpt" / "group-1").mkdir()
    shutil.copytree(step, tmp_path / "ckpt" / "group-1" / step.name)
    assert check_resumable(cfg, tmp_path / "ckpt", groups=[1]) == tmp_path / "ckpt" / "group-1" / step.name


def test_resume_always_refuses_another_optimizer(tmp_path):
    cfg = _config("/data", str(tmp_path / "ckpt"))
    _fake_checkpoint(tmp_path, cfg)
    mine = _config("/data", str(tmp_path / "ckpt"), optimizer="sgd")
    with pytest.raises(ConfigError, match="optim.optimizer='adamw', this run has 'sgd'.*does not carry over"):
        check_resumable(mine, tmp_path / "ckpt")


def test_incomplete_and_damaged_checkpoints_are_named_and_skipped(tmp_path):
    series = tmp_path / "group-0"
    good, bad, partial = series / "step-00000002", series / "step-00000004", series / "step-00000006.tmp"
    for step, path in ((2, good), (4, bad)):
        path.mkdir(parents=True)
        (path / "rank-0.pt").write_bytes(b"x" * 10)
        checkpoint_files.write_json(path / "meta.json", {"step": step, "files": {"rank-0.pt": 10}})
    partial.mkdir()
    (series / LATEST).write_text(bad.name)
    (bad / "rank-0.pt").write_bytes(b"x" * 3)
    found, skipped = find_checkpoint(series)
    assert found == good and skipped == ["step-00000004 (rank-0.pt has 3 bytes, the commit recorded 10)"]
    (bad / "meta.json").write_text("{not json")
    assert "meta.json unreadable" in find_checkpoint(series)[1][0]
    os.replace(good, good.with_name(good.name + ".old"))  # a commit cut short between its two renames
    assert find_checkpoint(series)[0] == series / "step-00000002.old"


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_a_crafted_metadata_file_is_refused_without_running_code(tmp_path, monkeypatch):
    import pickle

    import torch.distributed.checkpoint as dcp

    good = tmp_path / "good"
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(good), no_dist=True)
    stored = checkpoint_files.SafeReader(str(good)).read_metadata().state_dict_metadata
    assert stored["model.weight"].properties.dtype == torch.bfloat16 and tuple(stored["model.weight"].size) == (2, 3)
    restored = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(restored, storage_reader=checkpoint_files.SafeReader(str(good)), no_dist=True)
    torch.testing.assert_close(restored["model"], model.state_dict(), rtol=0, atol=0)

    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / ".metadata").write_bytes(pickle.dumps(_Evil()))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(pickle.UnpicklingError, match=r"names (posix|nt|os)\.system, which is not one of DCP's"):
        checkpoint_files.SafeReader(str(evil)).read_metadata()
    assert not (tmp_path / "pwned").exists()
