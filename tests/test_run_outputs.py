"""What runs leave behind: the run directory, TensorBoard and W&B sinks, the plot of several runs, the option
reference generated from the schema."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from flwr_sharded.errors import ConfigError
from flwr_sharded.run_dir import RunDir, check_run_dir, default_run_dir, read_records

from tests import REPO



def _static_run(path: Path, speed: float, **sinks) -> Path:
    run = RunDir(path, config={"parallel": {"method": "fl-fsdp"}}, **sinks)
    for step in range(1, 6):
        run.log({"kind": "train", "step": step, "loss": 9 - step, "ppl": 2.0 ** (9 - step),
                 "elapsed_s": step / speed, "tokens_seen": step * 1000})
    run.log({"kind": "eval", "step": 5, "eval_loss": 4.5, "eval_ppl": 90.0, "elapsed_s": 5 / speed,
             "tokens_seen": 5000})
    run.finish({"status": "completed"})
    return path


def _flower_run(path: Path) -> Path:
    run = RunDir(path, config={"train": {"parallel": {"method": "fl-hsdp"}}, "federation": {}})
    for r in range(1, 4):
        run.log({"kind": "round", "round": r, "train_ppl": 500.0 / r, "eval_ppl": 600.0 / r, "elapsed_s": 10.0 * r,
                 "tokens_seen": 4000 * r})
    run.finish({"status": "completed"})
    return path


def test_a_run_directory_holds_config_metrics_and_summary(tmp_path):
    path = _static_run(tmp_path / "a", speed=1.0)
    assert json.loads((path / "config.json").read_text()) == {"parallel": {"method": "fl-fsdp"}}
    records = read_records(path)
    assert [r["kind"] for r in records] == ["train"] * 5 + ["eval", "summary"]
    summary = json.loads((path / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["elapsed_s"] >= 0
    assert records[-1] == {"kind": "summary", **summary}, "metrics.jsonl ends with summary.json's content"
    with pytest.raises(ConfigError, match="already holds a run"):
        check_run_dir(path, resume=False)
    assert check_run_dir(path, resume=True) == path
    first, second = default_run_dir(parent=tmp_path / "out"), None
    first.mkdir(parents=True)
    second = default_run_dir(parent=tmp_path / "out")
    assert second != first and second.name.startswith(first.name)


def test_a_resumed_run_continues_the_metrics_with_one_summary_at_the_end(tmp_path):
    from flwr_sharded.plot import curves

    path = _static_run(tmp_path / "a", speed=1.0)  # steps 1-5 and a summary; resumed from a checkpoint at step 3
    run = RunDir(path, config={"parallel": {"method": "fl-fsdp"}})
    run.continue_from(path, 3, tmp_path / "ckpt" / "group-0" / "step-00000003")
    for step in (4, 5, 6):
        run.log({"kind": "train", "step": step, "loss": 1.0, "ppl": 2.7, "elapsed_s": step - 3.0,
                 "tokens_seen": step * 1000})
    run.finish({"status": "completed", "steps": 6})
    records = read_records(path)
    assert [(r["kind"], r.get("step")) for r in records] == [
        ("train", 1), ("train", 2), ("train", 3), ("resume", 3), ("train", 4), ("train", 5), ("train", 6),
        ("summary", None)]
    assert records[-1]["steps"] == 6 and records[3]["continued_records"] == 3
    assert curves(path)["train"][0] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # the time axis goes on from the earlier run
    flower = _flower_run(tmp_path / "flower")  # a Flower run resumed in its run-dir: every round, one summary
    run = RunDir(flower, config={})
    run.continue_from(flower, None, "/ckpt")
    run.finish({"status": "completed"})
    assert [r["kind"] for r in read_records(flower)] == ["round"] * 3 + ["resume", "summary"]


def test_a_flower_run_resumed_in_its_run_dir_ends_with_one_summary(tmp_path):
    from flwr_sharded.flower.run_config import FlowerRun
    from flwr_sharded.flower.server.app import run_directory

    path = _flower_run(tmp_path / "run")
    run = FlowerRun.from_run_config({"run-dir": str(path), "checkpoint-dir": str(tmp_path / "ckpt"), "resume": True})
    with run_directory(run, 7) as run_dir:
        run_dir.log({"kind": "round", "round": 3, "elapsed_s": 1.0, "tokens_seen": 1})
    assert [r["kind"] for r in read_records(path)] == ["round"] * 3 + ["resume", "round", "summary"]


def test_a_stopped_flower_run_stays_stopped_when_its_serverapp_then_fails(tmp_path, monkeypatch):
    """`flwr stop`: the exit handler records `stopped` (and would shut Ray down); the ServerApp's thread, failing as
    Ray goes, neither overwrites it nor swallows its error."""
    from flwr_sharded.flower.run_config import FlowerRun
    from flwr_sharded.flower.server import app

    handlers, shutdowns = [], []
    monkeypatch.setattr(app, "add_exit_handler", lambda fn, **kw: handlers.append((fn, kw)))
    monkeypatch.setattr(app, "stop_ray", lambda: shutdowns.append(True))
    run = FlowerRun.from_run_config({"run-dir": str(tmp_path / "run")})
    with pytest.raises(ValueError, match="I/O operation"):
        with app.run_directory(run, 7):
            (handler, options), = handlers
            assert options == {"run_before_force_exit": True}
            handler()
            raise ValueError("I/O operation on closed file.")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "stopped" and shutdowns == [True]
    handler()  # once only
    assert shutdowns == [True]


def test_tensorboard_and_wandb_receive_the_same_records(tmp_path, monkeypatch):
    calls: dict[str, list] = {"init": [], "log": [], "finish": []}

    class _Run:
        def log(self, data, step):
            calls["log"].append((step, data))

        def finish(self):
            calls["finish"].append(True)

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls["init"].append(kw) or _Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    path = _static_run(tmp_path / "tb", speed=1.0, tensorboard=True, wandb_project="proj")
    events = list((path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("train/loss")] == [8, 7, 6, 5, 4]
    assert calls["init"][0]["project"] == "proj" and calls["init"][0]["config"]["parallel"]["method"] == "fl-fsdp"
    assert [s for s, _ in calls["log"]] == [1, 2, 3, 4, 5, 5] and calls["finish"] == [True]


def test_plot_draws_static_and_flower_runs_against_time_and_tokens(tmp_path, capsys):
    from flwr_sharded.cli import main
    from flwr_sharded.plot import curves, label

    fast, slow, flower = (_static_run(tmp_path / "fast", 2.0), _static_run(tmp_path / "slow", 0.5),
                          _flower_run(tmp_path / "flower"))
    assert curves(fast)["train"][0] == [0.5, 1.0, 1.5, 2.0, 2.5] and curves(slow)["train"][1] == curves(fast)[
        "train"][1]
    assert curves(flower)["eval"][2] == [600.0, 300.0, 200.0]
    assert label(flower) == "flower: fl-hsdp (Flower, decentralized), float32 wire"
    wired = RunDir(tmp_path / "int8", config={"parallel": {"method": "fl-fsdp", "aggregate_every": 25,
                                                           "sync_dtype": "int8", "sync_fragments": 4}})
    wired.finish({"status": "completed"})
    assert label(tmp_path / "int8") == "int8: fl-fsdp, A=25, int8 wire, 4 fragments"
    fsdp = RunDir(tmp_path / "fsdp", config={"parallel": {"method": "fsdp", "sync_dtype": "int8"}})
    fsdp.finish({"status": "completed"})
    assert label(tmp_path / "fsdp") == "fsdp: fsdp"  # no shard sync to describe
    from flwr_sharded.plot import figure

    fig = figure([fast, slow, flower, tmp_path / "int8"])  # the legend: one entry per run, over no axes
    fig.canvas.draw()
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [label(fast), label(slow), label(flower)]
    box = legend.get_window_extent()
    assert not any(box.overlaps(ax.get_window_extent()) for ax in fig.axes)
    out = tmp_path / "cmp.png"
    assert main(["plot", str(fast), str(slow), str(flower), "-o", str(out)]) == 0
    assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"
    assert main(["plot", str(tmp_path), "-o", str(out)]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_the_option_reference_is_generated_from_the_schema():
    from flwr_sharded.options_doc import render

    assert (REPO / "docs" / "options.md").read_text() == render(), \
        "docs/options.md drifted: run `flwr-sharded options --write docs/options.md`"
