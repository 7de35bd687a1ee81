"""A run config's `package.module:Class` values are checked against the ServerApp's allow-list (the app's own
package, flwr_sharded, `FLWR_SHARDED_ALLOWED_IMPORTS`) before anything is imported: a refused module's code never
runs on the ServerApp's machine."""

from __future__ import annotations

import sys

import pytest

from flwr_sharded.errors import ConfigError
from flwr_sharded.flower.run_config import FlowerRun
from flwr_sharded.flower.server.app import load_run, strategy_class
from flwr_sharded.flower.server.app import ALLOWED_IMPORTS_ENV
from flwr_sharded.flower.server.server_path_strategy import ServerShardFedAvg
from tests.flower.procs import APP

SIDE_EFFECT = '''
import os
open(os.environ["H21_IMPORTED"], "a").write(__name__ + "\\n")
from flwr_sharded.flower.server.strategy import DecentralizedFedAvg
from flwr_sharded.parallel.rules import FedAvg


class Strategy(DecentralizedFedAvg):
    pass


class Rule(FedAvg):
    pass
'''


@pytest.fixture
def side_effect(tmp_path, monkeypatch):
    """An importable module `h21_side_effect` that appends its name to a file when imported; the file's path."""
    (tmp_path / "h21_side_effect.py").write_text(SIDE_EFFECT)
    marker = tmp_path / "imported"
    monkeypatch.setenv("H21_IMPORTED", str(marker))
    monkeypatch.delenv(ALLOWED_IMPORTS_ENV, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "h21_side_effect", raising=False)
    return marker


@pytest.mark.parametrize("key, value", [("strategy", "h21_side_effect:Strategy"), ("outer", "h21_side_effect:Rule")])
def test_a_module_outside_the_allow_list_is_refused_before_it_is_imported(side_effect, key, value, monkeypatch):
    with pytest.raises(ConfigError, match=rf"run config '{key}' '{value}': .*llama_fl_hsdp.*"
                                          rf"{ALLOWED_IMPORTS_ENV}=h21_side_effect"):
        load_run({key: value}, app_package="llama_fl_hsdp")
    with pytest.raises(ConfigError, match=ALLOWED_IMPORTS_ENV):  # the class's own look-up checks too
        strategy_class(FlowerRun.from_run_config({"strategy": "h21_side_effect:Strategy"}), app_package="app")
    assert not side_effect.exists() and "h21_side_effect" not in sys.modules

    monkeypatch.setenv(ALLOWED_IMPORTS_ENV, "otherlab, h21_side_effect")  # the operator's setting, not the run's
    run = load_run({key: value}, app_package="llama_fl_hsdp")
    if key == "strategy":
        assert strategy_class(run).__name__ == "Strategy"
    assert side_effect.read_text() == "h21_side_effect\n"


def test_the_apps_own_modules_and_flwr_sharded_s_need_no_permission(monkeypatch):
    monkeypatch.delenv(ALLOWED_IMPORTS_ENV, raising=False)
    monkeypatch.syspath_prepend(str(APP))  # as Flower puts the shipped app on the ServerApp's path
    run = load_run({"strategy": "llama_fl_hsdp.strategies.fedprox:FedProxShards"}, app_package="llama_fl_hsdp")
    assert strategy_class(run, app_package="llama_fl_hsdp").__name__ == "FedProxShards"
    with pytest.raises(ConfigError, match="'strategy'.*FLWR_SHARDED_ALLOWED_IMPORTS"):  # another app's package
        load_run({"strategy": "llama_fl_hsdp.strategies.fedprox:FedProxShards"}, app_package="other_app")
    own = load_run({"strategy": "flwr_sharded.flower.server.server_path_strategy:ServerShardFedAvg"})
    assert strategy_class(own) is ServerShardFedAvg
    for bad in ("no_colon", "a.b:", "a..b:C", "a.b:C.D"):
        with pytest.raises(ConfigError, match=f"'strategy' '{bad}' must be package.module:Class"):
            load_run({"strategy": bad})
