"""`flwr-sharded check`: a run config checked before `flwr run` submits it, the key named when Flower would refuse it
(`Invalid run configuration.`) or the ServerApp would; no Flower run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flwr_sharded.cli import main
from tests.flower.procs import APP, FAST_RUN_CONFIG, REPO, run_config_args


@pytest.fixture(autouse=True)
def _prepared_data(data_dir, monkeypatch):
    """The model and data checks look at the default data directory, as a simulation's groups would."""
    monkeypatch.setenv("FLWR_SHARDED_DATA", str(data_dir))


def _check(capsys, *run_config: str, app: str = str(APP)) -> tuple[int, str]:
    flags = [a for a in run_config if a.startswith("--")]
    code = main(["check", "--app", app, *flags, *(a for text in run_config if text not in flags
                                                  for a in ("--run-config", text))])
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.dist
def test_a_typo_d_key_is_named_with_the_key_it_resembles():
    proc = subprocess.run([sys.executable, "-m", "flwr_sharded.cli", "check", "--run-config", "num-server-round=2"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)  # the default --app, as documented
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "'num-server-round'" in proc.stderr and "did you mean num-server-rounds" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_bad_value_or_a_malformed_pair_is_named(capsys):
    code, text = _check(capsys, "aggregate-every=0")
    assert code == 2 and "'aggregate-every' must be an integer >= 1, got 0" in text
    code, text = _check(capsys, "num-server-rounds=2 model=small")
    assert code == 2 and "'model'" in text and 'model="small"' in text
    code, text = _check(capsys, "num-server-rounds=2 lr")
    assert code == 2 and "'lr' is not a key=value pair" in text
    code, text = _check(capsys, "rendezvous-timeout=2000")  # the ServerApp's cross-key checks (validate) run too
    assert code == 2 and "'rendezvous-timeout' must be below 'round-timeout'" in text


def test_a_good_run_config_is_summarised(capsys):
    code, text = _check(capsys, 'num-server-rounds=5 model="small" lr=0.001', "sync-fragments=4 sync-dtype=\"int8\"")
    assert code == 0, text
    assert text.strip() == ("run config OK: fl-fsdp, 2 groups of R=1 x S=2 ranks (decentralized); 5 rounds x K=4 "
                            "syncs x A=25 steps = 500 steps; model small; sync int8, 4 fragments, outer fedavg; "
                            "no overlap")
    code, text = _check(capsys, "model=\"small\" sync-fragments=4 sync-delay=2 sync-alpha=0.5 outer=\"nesterov\" outer-lr=0.5")
    assert code == 0 and text.strip().endswith("sync float32, 4 fragments, outer nesterov lr 0.5; overlap tau=2 "
                                               "alpha=0.5 carry"), text


def test_the_tests_flwr_run_arguments_and_a_toml_file_are_accepted(capsys, tmp_path):
    config = {**FAST_RUN_CONFIG, "num-groups": 2, "run-dir": str(tmp_path / "run")}
    assert main(["check", "--app", str(APP), *run_config_args(config)]) == 0, capsys.readouterr().err
    assert "2 rounds x K=2 syncs x A=4 steps = 16 steps; model tiny" in capsys.readouterr().out
    toml = tmp_path / "run.toml"
    toml.write_text("num-server-rounds = 4\nmodel = \"small\"\n")
    code, text = _check(capsys, str(toml))
    assert code == 0 and "4 rounds" in text and "model small" in text


def test_a_key_the_app_lacks_is_refused_as_flower_would(capsys, tmp_path):
    app = tmp_path / "app"
    app.mkdir()
    text = (APP / "pyproject.toml").read_text()
    app.joinpath("pyproject.toml").write_text(text.replace("\nsync-alpha = 0.0\n", "\n"))
    code, text = _check(capsys, "sync-alpha=0.5", app=str(app))
    assert code == 2 and "'sync-alpha' is not a key of the app's [tool.flwr.app.config]" in text
    code, text = _check(capsys, "lr=0.01", app=str(tmp_path))
    assert code == 2 and "no pyproject.toml" in text


def test_the_model_and_the_data_are_checked_as_the_groups_would_before_any_starts(capsys, tmp_path, monkeypatch):
    from flwr_sharded.presets import PRESETS

    code, text = _check(capsys, 'model="smal"')  # a typo'd preset: named once, as the run config spells it
    assert code == 2 and text.strip().splitlines() == [
        f"flwr-sharded check: error: run config 'model': unknown model 'smal'; use a preset ({', '.join(PRESETS)}), "
        "a Hugging Face id (org/name) or a local model directory"]
    missing = tmp_path / "no-data"
    code, text = _check(capsys, f'data-dir="{missing}"')
    assert code == 2 and f"data directory {missing} ('data-dir') does not exist" in text
    assert f"`flwr-sharded prepare-data --data-dir {missing}`" in text  # a command keeps its flags
    code, text = _check(capsys, "sync-fragments=3")  # the tiny model has 2 blocks
    assert code == 2 and "'sync-fragments' 3: model tiny has 2 transformer blocks" in text

    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    code, text = _check(capsys, 'model="acme/not-cached"')
    assert code == 2 and "'model': 'acme/not-cached' is not in the Hugging Face cache" in text
    # the groups of a deployment hold the data and the model: only what holds everywhere is checked here
    code, text = _check(capsys, 'model="acme/not-cached"', f'data-dir="{missing}"', "--deployment")
    assert code == 0, text
    code, text = _check(capsys, 'model="smal"', "--deployment")
    assert code == 2 and "'model': unknown model 'smal'" in text


@pytest.mark.dist
def test_the_server_app_checks_the_model_and_data_in_a_simulation_only(tmp_path):
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    from flwr_sharded.errors import ConfigError
    from flwr_sharded.flower.server.app import load_run

    config = {"data-dir": str(tmp_path / "no-data")}
    simulation = InMemoryGrid.__new__(InMemoryGrid)  # only its type matters
    with pytest.raises(ConfigError, match=r"run config data directory .* \('data-dir'\) does not exist"):
        load_run(config, simulation)
    assert load_run(config, grid=None).train.data.data_dir == config["data-dir"]  # deployment: the nodes' data
