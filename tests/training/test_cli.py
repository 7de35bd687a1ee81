"""Bad input to the training entry point: a clear error naming the option, before any process group or file."""

from __future__ import annotations


import pytest

from flwr_sharded.config import TrainConfig, load_config
from flwr_sharded.validation import validate

from flwr_sharded.errors import ConfigError
from flwr_sharded.train import main

from tests import REPO


BAD = [
    # (world size, arguments, words the message must contain)
    (4, ["--method", "fl-fsdp", "--federations", "2", "--shards", "3"],
     ["world size 4", "F*R*S", "6", "launch it with: torchrun --nproc-per-node 6 -m flwr_sharded.train --method"]),
    (4, ["--method", "fl-fsdp", "--federations", "0", "--shards", "4"], ["--federations", ">= 1"]),
    (4, ["--method", "hsdp", "--replicas", "-1", "--shards", "4"], ["--replicas", ">= 1"]),
    (4, ["--method", "fsdp", "--shards", "0"], ["--shards", ">= 1"]),
    (4, ["--method", "fl-fsdp", "--federations", "2", "--shards", "2", "--aggregate-every", "0"],
     ["--aggregate-every", ">= 1"]),
    (4, ["--method", "fsdp", "--federations", "2", "--shards", "2"], ["--federations must be 1", "fl-fsdp"]),
    (4, ["--method", "hsdp", "--federations", "2", "--replicas", "2"], ["--federations must be 1"]),
    (4, ["--method", "fl-fsdp", "--federations", "2", "--replicas", "2"], ["--replicas must be 1", "fl-hsdp"]),
    (4, ["--method", "fsdp", "--replicas", "2", "--shards", "2"], ["--replicas must be 1", "hsdp"]),
    (4, ["--method", "ddp", "--shards", "4"], ["--method must be one of", "fsdp, hsdp, fl-fsdp, fl-hsdp"]),
    (4, ["--shards", "4", "--method", "fsdp", "--optimizer", "lamb"], ["--optimizer must be one of", "adamw, sgd"]),
    (4, ["--shards", "4", "--method", "fsdp", "--model", "gpt-17"], ["--model", "unknown model", "tiny"]),
    (4, ["--shards", "4", "--method", "fsdp", "--dataset", "no/such/path.txt"], ["--dataset", "does not exist"]),
    (4, ["--shards", "4", "--method", "fsdp", "--dataset", "bad name!"], ["--dataset", "neither"]),
    (4, ["--shards", "4", "--method", "fsdp", "--partition", "random"], ["--partition must be one of", "iid"]),
    (4, ["--shards", "4", "--method", "fsdp", "--streaming"], ["--streaming", "set --max-train-blocks"]),
    (4, ["--shards", "4", "--method", "fsdp", "--tokenize-workers", "0"], ["--tokenize-workers", ">= 1"]),
    (4, ["--shards", "4", "--method", "fsdp", "--grad-clip", "-1"], ["--grad-clip", ">= 0"]),
    (4, ["--shards", "4", "--method", "fsdp", "--lr", "0"], ["--lr", "> 0"]),
    (4, ["--shards", "4", "--method", "fsdp", "--steps", "0"], ["--steps", ">= 1"]),
    (4, ["--method", "fl-fsdp", "--federations", "4", "--outer", "adagrad"], ["--outer must be one of", "nesterov"]),
    (4, ["--method", "fl-fsdp", "--federations", "4", "--outer", "fedadam", "--outer-momentum", "0.9"],
     ["--outer-momentum does not apply to --outer fedadam", "fedavgm, nesterov"]),
    (4, ["--shards", "4", "--method", "fsdp", "--checkpoint-every", "5"], ["--checkpoint-dir"]),
    (4, ["--method", "fl-fsdp", "--federations", "4", "--sync-dtype", "float16"],
     ["--sync-dtype must be one of", "float32, bfloat16", "'float16'"]),
    (4, ["--method", "fl-fsdp", "--federations", "4", "--outer", "trimmed-mean", "--sync-dtype", "bfloat16"],
     ["--sync-dtype bfloat16", "--outer trimmed-mean", "--sync-dtype float32"]),
    (4, ["--method", "fl-fsdp", "--federations", "4", "--outer", "median", "--sync-dtype", "int8"],
     ["--sync-dtype int8", "--outer median", "needs every member's shards"]),
    (4, ["--method", "fl-fsdp", "--federations", "4", "--outer", "median", "--sync-delay", "1"],
     ["--sync-delay 1", "--outer median", "use a linear rule", "--sync-delay 0"]),
    (4, ["--method", "fl-fsdp", "--federations", "4", "--outer", "median", "--outer-lr", "0.5"],
     ["--outer-lr does not apply to --outer median"]),
    (4, ["--shards", "4", "--method", "fsdp", "--lr", "nan"], ["--lr", "finite", "nan"]),
    (4, ["--shards", "4", "--method", "fsdp", "--timeout", "inf"], ["--timeout", "finite", "inf"]),
    (4, ["--shards", "4", "--method", "fsdp", "--steps", "ten"], ["--steps", "of type int", "'ten'"]),
    (4, ["--shards", "4", "--method", "fsdp", "--beta2", "1.0"], ["--beta2", "in [0, 1)"]),
    (4, ["--shards", "4", "--method", "fsdp", "--proximal-mu", "0.1"], ["--proximal-mu", "FL method"]),
    (4, ["--method", "fl-fsdp", "--federations", "4", "--outer", "nesterov", "--outer-lr", "-1"],
     ["--outer-lr", "> 0"]),
]


@pytest.mark.parametrize("world,args,words", BAD, ids=[" ".join(b[1]) for b in BAD])
def test_bad_input_is_refused_before_any_work(data_dir, tmp_path, monkeypatch, capsys, world, args, words):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    run_dir = tmp_path / "run"
    code = main([*args, "--data-dir", str(data_dir), "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 2
    for word in words:
        assert word in err, err
    assert not run_dir.exists()


@pytest.mark.parametrize("yaml_text,words", [
    ("optim:\n  lr: fast\n", ["'optim.lr'", "of type float", "'fast'"]),
    ("parallel:\n  shards: 2.5\n", ["'parallel.shards'", "of type int"]),
    ("parallel: 3\n", ["parallel must be a mapping"]),
    ("steps: .nan\n", ["'steps'", "of type int"]),
    ("optim:\n  lr: .inf\n", ["'optim.lr'", "finite"]),
    ("model:\n  pretrained: maybe\n", ["'model.pretrained'", "of type bool"]),
])
def test_wrong_yaml_types_name_the_key(tmp_path, monkeypatch, capsys, yaml_text, words):
    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml_text)
    assert main(["--config", str(cfg), "--print-config"]) == 2
    err = capsys.readouterr().err
    assert str(cfg) in err
    for word in words:
        assert word in err, err


def test_print_config_validates_first(capsys):
    assert main(["--method", "fsdp", "--federations", "2", "--print-config"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "--federations must be 1" in captured.err
    assert main(["--method", "fl-fsdp", "--federations", "2", "--print-config"]) == 0
    assert '"federations": 2' in capsys.readouterr().out


def test_flwr_sharded_train_takes_the_training_options(capsys):
    from flwr_sharded.cli import main as cli_main

    assert cli_main(["train", "--method", "fl-fsdp", "--federations", "3", "--lr", "0.01", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert '"federations": 3' in out and '"lr": 0.01' in out


def test_a_run_directory_that_holds_a_run_is_refused(data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    assert main(["--method", "fsdp", "--data-dir", str(data_dir), "--run-dir", str(tmp_path / "run")]) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_missing_data_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    missing = tmp_path / "nowhere"
    assert main(["--method", "fsdp", "--data-dir", str(missing)]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "prepare-data" in err
    assert not missing.exists()


def test_unknown_yaml_key(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("parallel:\n  method: fsdp\n  shard: 2\n")
    assert main(["--config", str(cfg)]) == 2
    assert "shard" in capsys.readouterr().err


@pytest.mark.parametrize("path", sorted((REPO / "configs").rglob("*.yaml")), ids=lambda p: str(p.relative_to(REPO)))
def test_shipped_configs_are_valid(path):
    cfg = load_config(path)
    validate(cfg, cfg.parallel.world_size)
    if "paper" in path.parts:
        assert cfg.parallel.world_size == 512 and cfg.model.name == "llama3.1-8b"
    else:
        assert cfg.parallel.world_size == 4


def test_command_line_overrides_yaml(tmp_path):
    from flwr_sharded.train import resolve_config, train_parser

    args = train_parser().parse_args(["--config", str(REPO / "configs/local/fl-hsdp.yaml"), "--aggregate-every", "3",
                                      "--no-sync"])
    cfg = resolve_config(args)
    assert cfg.parallel.aggregate_every == 3 and cfg.parallel.sync is False and cfg.parallel.replicas == 2
    with pytest.raises(ConfigError):
        validate(cfg, 8)
    cfg = resolve_config(train_parser().parse_args(["--method", "fl-fsdp", "--federations", "4", "--outer", "nesterov",
                                                    "--sync-dtype", "bfloat16"]))
    assert cfg.parallel.sync_dtype == "bfloat16" and TrainConfig().parallel.sync_dtype == "float32"
    validate(cfg, 4)
