"""Submitting a run is not code execution by default: a `module:Class` rule, a checkpoint directory and the final
model's directory are accepted by a group only where its node config allows them (`flwr_sharded.flower.node_policy`),
and refused before anything is imported or written otherwise."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from flwr_sharded.errors import ConfigError
from flwr_sharded.flower import messages as P
from flwr_sharded.flower.endpoint import GroupError
from flwr_sharded.flower.node_policy import NodePolicy
from flwr_sharded.flower.run_config import FlowerRun
from tests.flower.procs import start_groups
from tests.flower.test_group import client, spec
from tests.flower import test_strategy


task_identity = test_strategy.task_identity  # an autouse fixture: Flower messages need a run id


def _run(**flat) -> FlowerRun:
    return FlowerRun.from_run_config(flat)


@pytest.mark.dist
def test_a_deployment_node_allows_nothing_unless_its_config_says_so(tmp_path):
    strict = NodePolicy.from_node_config({"group-address": "127.0.0.1:7100"}, launched=False)
    assert strict == NodePolicy()
    with pytest.raises(ConfigError, match="'outer' 'evil:Rule' would import.*allow-custom-rules=true"):
        strict.check_run(_run(outer="evil:Rule"))
    with pytest.raises(ConfigError, match="'checkpoint-dir' '/x'.*allows no such directory.*allowed-checkpoint-root"):
        strict.check_run(_run(**{"checkpoint-dir": "/x"}))
    with pytest.raises(ConfigError, match="final model's directory.*allowed-save-root"):
        strict.check_run(_run(), save_dir="/somewhere/model")
    strict.check_run(_run(outer="nesterov"))  # built-in rules and no directories need nothing

    allowed = NodePolicy.from_node_config({"allow-custom-rules": True, "allowed-checkpoint-root": str(tmp_path),
                                           "allowed-save-root": str(tmp_path / "out")}, launched=False)
    allowed.check_run(_run(outer="evil:Rule", **{"checkpoint-dir": str(tmp_path / "ckpt")}),
                      save_dir=str(tmp_path / "out" / "run1" / "model"))
    with pytest.raises(ConfigError, match="is outside this node's allowed-checkpoint-root"):
        allowed.check_run(_run(**{"checkpoint-dir": str(tmp_path / ".." / "elsewhere")}))
    (tmp_path / "escape").symlink_to("/etc")  # a symlink inside the root that leads out of it
    with pytest.raises(ConfigError, match="'/etc/ckpt' is outside"):
        allowed.check_run(_run(**{"checkpoint-dir": str(tmp_path / "escape" / "ckpt")}))
    with pytest.raises(ConfigError, match="is outside this node's allowed-save-root"):
        allowed.check_run(_run(), save_dir=str(tmp_path / "model"))
    cwd = os.getcwd()
    try:  # a relative directory is where the group would write it: under its working directory
        os.chdir(tmp_path)
        allowed.check_run(_run(**{"checkpoint-dir": "ckpt"}))
        os.chdir("/")
        with pytest.raises(ConfigError, match="'/ckpt' is outside"):
            allowed.check_run(_run(**{"checkpoint-dir": "ckpt"}))
    finally:
        os.chdir(cwd)


@pytest.mark.dist
def test_a_launched_group_allows_everything_unless_the_node_config_restricts_it(tmp_path):
    assert NodePolicy.from_node_config({"partition-id": 0, "num-partitions": 2}, launched=True) == NodePolicy.open()
    NodePolicy.open().check_run(_run(outer="evil:Rule", **{"checkpoint-dir": "/anywhere"}), save_dir="/any/model")
    restricted = NodePolicy.from_node_config({"allowed-save-root": str(tmp_path)}, launched=True)
    assert restricted == NodePolicy(save_root=str(tmp_path))
    with pytest.raises(ConfigError, match="allow-custom-rules"):
        restricted.check_run(_run(outer="evil:Rule"))


@pytest.mark.parametrize("config,message", [
    ({"allow-custom-rules": "yes"}, "allow-custom-rules must be true or false, got 'yes'"),
    ({"allowed-checkpoint-root": "relative/dir"}, "allowed-checkpoint-root must be an absolute directory"),
    ({"allowed-save-root": 3}, "allowed-save-root must be an absolute directory"),
])
def test_bad_node_config_values_are_named(config, message):
    with pytest.raises(ConfigError, match=message):
        NodePolicy.from_node_config(config, launched=False)
    assert NodePolicy.from_node_config({"allow-custom-rules": "true"}, launched=False).custom_rules


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def call(self, verb: str, args: dict, timeout: float) -> dict:
        self.calls.append((verb, args))
        return {"compatible": True}


def _hello_args(node_config: dict) -> dict:
    from flwr.app import ConfigRecord, Message, RecordDict

    from flwr_sharded.flower.clientapp import _hello

    config = {"run": "{}", "save-dir": "/runs/r1/model", "partition-id": 0, "num-partitions": 1}
    message = Message(RecordDict({P.CONFIG: ConfigRecord(config)}), dst_node_id=1, message_type=P.MSG_HELLO)
    context = SimpleNamespace(node_config=node_config, run_id=1)
    recorder = _Recorder()
    _hello(message, context, config, recorder, None, 10.0)
    ((verb, args),) = recorder.calls
    assert verb == P.HELLO
    return args


def test_the_hello_carries_the_node_configs_policy_and_the_servers_save_dir():
    deployment = _hello_args({"group-address": "127.0.0.1:1", "group-authkey-file": "/k",
                              "allowed-save-root": "/runs"})
    assert deployment["save_dir"] == "/runs/r1/model"
    assert deployment["policy"] == {"allow-custom-rules": False, "allowed-checkpoint-root": "",
                                    "allowed-save-root": "/runs"}
    assert _hello_args({})["policy"] == NodePolicy.open().to_args()  # simulation: the group is launched here


EVIL = '''
import os
from pathlib import Path

Path(os.environ["FLWR_SHARDED_TEST_IMPORTED"]).write_text("imported")

from flwr_sharded.parallel.rules import FedAvg


class Rule(FedAvg):
    pass
'''


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_group_refuses_what_its_node_config_does_not_allow_before_importing_or_writing(procs, data_dir, tmp_path):
    modules, marker, allowed = tmp_path / "modules", tmp_path / "imported", tmp_path / "allowed"
    modules.mkdir()
    allowed.mkdir()
    (modules / "evil_rule.py").write_text(EVIL)
    env = {"PYTHONPATH": os.pathsep.join([str(modules), os.environ.get("PYTHONPATH", "")]),
           "FLWR_SHARDED_TEST_IMPORTED": str(marker)}
    ((_, address, key),) = start_groups(procs, [("g", {"shards": 1, "env": env})])
    c = client(address, key)
    strict = NodePolicy(save_root=str(allowed)).to_args()

    def hello(run: FlowerRun, policy: dict, **extra) -> dict:
        return c.call(P.HELLO, {"run": run.to_json(), "run_key": "t", "partition_id": 0, "num_partitions": 1,
                                "policy": policy, **extra}, timeout=120)

    refused = hello(spec(data_dir, shards=1, outer="evil_rule:Rule"), strict)
    assert not refused["compatible"] and "allow-custom-rules=true" in refused["error"], refused
    outside = tmp_path / "ckpt"
    refused = hello(spec(data_dir, shards=1, checkpoint_dir=str(outside)), strict)
    assert not refused["compatible"] and "allowed-checkpoint-root" in refused["error"], refused
    refused = hello(spec(data_dir, shards=1), strict, save_dir=str(tmp_path / "run" / "model"))
    assert not refused["compatible"] and "outside this node's allowed-save-root" in refused["error"], refused
    assert not marker.exists() and not outside.exists()  # nothing imported, nothing written
    assert not hello(spec(data_dir, shards=1), {"allow-custom-rules": "maybe"})["compatible"]

    permitted = {"allow-custom-rules": True, "allowed-checkpoint-root": str(allowed),
                 "allowed-save-root": str(allowed)}
    ok = hello(spec(data_dir, shards=1, outer="evil_rule:Rule", checkpoint_dir=str(allowed / "ckpt")), permitted,
               save_dir=str(allowed / "model"))
    assert ok["compatible"], ok["error"]
    assert marker.read_text() == "imported"  # the node allowed it, so the rule was imported and built
    with pytest.raises(GroupError, match="outside this node's allowed-save-root"):
        c.call(P.SAVE, {"directory": str(tmp_path / "model")}, timeout=60)
    assert not (tmp_path / "model").exists()
    assert Path(c.call(P.FINISH, {"save_dir": str(allowed / "model")}, timeout=120)["saved"]) == allowed / "model"
    assert (allowed / "model" / "config.json").is_file()
