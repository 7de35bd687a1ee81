"""Sharded checkpoints: resume continues the exact run; an interrupted write leaves the previous one usable; export."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from flwr_sharded.training.checkpoint import LATEST, export_pretrained, latest_checkpoint
from tests.multiproc import torchrun

ARGS = ["--method", "fl-hsdp", "--federations", "2", "--replicas", "1", "--shards", "2", "--model", "tiny",
        "--seq-len", "32", "--batch-size", "2", "--steps", "12", "--aggregate-every", "3", "--log-every", "1",
        "--eval-every", "0", "--eval-blocks", "4", "--lr", "3e-3", "--no-progress"]


def _losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == "train"}


def _run(args: list[str]) -> None:
    result = torchrun(4, args, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.timeout(480)
@pytest.mark.parametrize("mode", [[], ["--async-checkpoint", "--outer", "nesterov"]],
                         ids=["sync-write", "async-write+outer-state"])
def test_resume_continues_the_same_run(data_dir, tmp_path, mode):
    ckpt = tmp_path / "ckpt"
    common = [*ARGS, *mode, "--data-dir", str(data_dir), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "5"]
    _run([*common, "--metrics", str(tmp_path / "straight.jsonl"), "--save", str(tmp_path / "straight")])
    for group in ("group-0", "group-1"):
        series = ckpt / group
        assert sorted(p.name for p in series.glob("step-*")) == ["step-00000010", "step-00000012"]  # keep 2
        # Pretend the run died after step 10 while writing step 12: only a partial .tmp is left.
        shutil.move(series / "step-00000012", series / "step-00000012.tmp")
        (series / "step-00000012.tmp" / "meta.json").unlink()
        (series / LATEST).write_text("step-00000010")
        assert latest_checkpoint(series).name == "step-00000010"
    _run([*common, "--resume", "--metrics", str(tmp_path / "resumed.jsonl"), "--save", str(tmp_path / "resumed")])
    straight, resumed = _losses(tmp_path / "straight.jsonl"), _losses(tmp_path / "resumed.jsonl")
    assert sorted(resumed) == [11, 12]  # only the steps after the checkpoint were run again
    for step in (11, 12):  # steps 10-12 cross a sync (at 12): data position, RNG, optimizer state all restored
        assert resumed[step] == pytest.approx(straight[step], abs=1e-6)
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(tmp_path / "straight").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "resumed").state_dict()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
    # export merges the shards of the newest checkpoint into the same model as --save
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
    assert main([*ARGS, "--data-dir", str(data_dir), "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume"]) == 2
    assert "parallel.method='fl-fsdp'" in capsys.readouterr().err
