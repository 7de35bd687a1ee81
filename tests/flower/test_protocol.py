"""The run's schema, the app's run config derived from it, and the messages between the ServerApp, the ClientApp
and the groups (no processes, no torch)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib

import pytest

from flwr_sharded import schema
from flwr_sharded.config import TrainConfig
from flwr_sharded.errors import ConfigError
from flwr_sharded.flower import endpoint as E
from flwr_sharded.flower import messages as M
from flwr_sharded.flower.run_config import ROUND_KEYS, FlowerRun, RoundOptions, app_config_toml

from tests import REPO

APP = REPO / "apps" / "llama_fl_hsdp"


@pytest.mark.dist
def test_client_side_modules_do_not_import_torch():
    code = (f"import sys; sys.path.insert(0, {str(APP)!r}); import llama_fl_hsdp.client_app, "
            "llama_fl_hsdp.server_app, flwr_sharded.flower.clientapp, flwr_sharded.flower.run_config, "
            "flwr_sharded.flower.server.strategy; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_run_from_run_config_and_back():
    run = FlowerRun.from_run_config({"num-server-rounds": 5, "syncs-per-round": 2, "aggregate-every": 3,
                                     "method": "fl-hsdp", "replicas": 2, "shards": 1, "lr": 1, "outer-lr": "",
                                     "tokenizer": ""})
    assert (run.federation.rounds, run.federation.syncs_per_round, run.train.parallel.aggregate_every) == (5, 2, 3)
    assert run.train.optim.lr == 1.0 and run.train.parallel.outer_lr is None and run.train.data.tokenizer is None
    assert run.total_steps == 30 and run.group_world == 2
    assert FlowerRun.from_json(run.to_json()) == run
    run.validate()
    cfg = run.group_config()
    assert cfg.steps == 30 and cfg.parallel.federations == 1 and cfg.parallel.replicas == 2


def test_the_app_config_is_generated_from_the_schema():
    """apps/llama_fl_hsdp/pyproject.toml holds exactly the generated block: every run-config key with the schema's
    default and summary (regenerate with `python -m flwr_sharded.flower.run_config --write ...`)."""
    text = (APP / "pyproject.toml").read_text()
    assert app_config_toml() in text, "the app's [tool.flwr.app.config] drifted from flwr_sharded/flower/run_config.py"
    table = tomllib.loads(text)["tool"]["flwr"]["app"]["config"]
    flat = {o.name: o for o in schema.options(FlowerRun) if o.flat}
    assert set(table) == set(flat)
    assert FlowerRun.from_run_config(table) == FlowerRun()  # the app's defaults are the schema's


def test_every_static_option_is_a_run_config_key_or_says_why_not():
    """Reachable from `flwr run --run-config` unless the schema gives the reason (shown in the docs)."""
    keys = {o.name for o in schema.options(FlowerRun) if o.flat}
    for o in schema.options(TrainConfig):
        assert o.name in keys or (o.not_flat and len(o.not_flat) > 10), o.name
    docs = (REPO / "docs" / "options.md").read_text()
    for o in schema.options(FlowerRun):
        assert f"`{o.name}`" in docs, f"docs/options.md lacks {o.name}"


# (the wrong key, run config, words the message must hold besides the key: allowed values or range). Not here: model,
# dataset, dataset-config, data-dir and tokenizer are checked by each group at hello (they need its files); any seed
# is valid.
BAD_RUN_CONFIGS = [
    ("method", {"method": "fl-bogus"}, ["fl-fsdp, fl-hsdp"]),
    ("method", {"method": "fsdp"}, ["fl-fsdp, fl-hsdp"]),
    ("method", {"method": 3}, ["of type str"]),
    ("replicas", {"replicas": 0}, [">= 1"]),
    ("replicas", {"replicas": 2}, ["must be 1", "fl-hsdp"]),
    ("shards", {"shards": 0}, [">= 1"]),
    ("shards", {"shards": "two"}, ["of type int"]),
    ("aggregate-every", {"aggregate-every": 0}, [">= 1"]),
    ("syncs-per-round", {"syncs-per-round": 0}, [">= 1"]),
    ("num-server-rounds", {"num-server-rounds": 0}, [">= 1"]),
    ("seq-len", {"seq-len": 0}, [">= 1"]),
    ("batch-size", {"batch-size": 0}, [">= 1"]),
    ("grad-accum", {"grad-accum": 0}, [">= 1"]),
    ("precision", {"precision": "fp16"}, ["auto, fp32, bf16"]),
    ("partition", {"partition": "random"}, ["iid, iid-groups, document"]),
    ("max-train-blocks", {"max-train-blocks": 0}, [">= 1"]),
    ("eval-blocks", {"eval-blocks": -1}, [">= 0"]),
    ("optimizer", {"optimizer": "adam"}, ["adamw, sgd"]),
    ("lr", {"lr": 0.0}, ["> 0"]),
    ("lr", {"lr": -1.0}, ["> 0"]),
    ("lr", {"lr": "fast"}, ["of type float"]),
    ("lr", {"lr": float("nan")}, ["finite"]),
    ("round-timeout", {"round-timeout": float("inf")}, ["finite"]),
    ("sync-timeout", {"sync-timeout": 0.0}, ["> 0"]),
    ("sync-timeout", {"sync-timeout": 1000.0}, ["below", "round-timeout"]),
    ("rendezvous-timeout", {"rendezvous-timeout": -5.0}, ["> 0"]),
    ("group-idle-timeout", {"group-idle-timeout": 600.0}, ["must exceed", "round-timeout", "hello-timeout"]),
    ("collect-interval", {"collect-interval": 0.0}, ["> 0"]),
    ("min-groups", {"min-groups": 3, "num-groups": 2}, ["num-groups"]),
    ("num-groups", {"num-groups": -1}, [">= 0"]),
    ("proximal-mu", {"proximal-mu": -0.1}, [">= 0"]),
    ("beta1", {"beta1": 1.0}, ["in [0, 1)"]),
    ("lrr", {"lrr": 0.1}, ["unknown key", "lr"]),
    ("checkpoint-every", {"checkpoint-every": 2}, ["unknown key"]),
    ("warmup", {"warmup": -0.5}, [">= 0"]),
    ("min-lr-ratio", {"min-lr-ratio": 1.5}, ["[0, 1]"]),
    ("weight-decay", {"weight-decay": -0.1}, [">= 0"]),
    ("grad-clip", {"grad-clip": -1.0}, [">= 0"]),
    ("bucket-mb", {"bucket-mb": 0.0}, ["> 0"]),
    ("reset-optimizer-state", {"reset-optimizer-state": "maybe"}, ["of type bool"]),
    ("outer", {"outer": "fedprox"}, ["fedavg, fedavgm, nesterov, fedadam, fedyogi, trimmed-mean"]),
    ("outer-lr", {"outer-lr": 0.5}, ["does not apply to 'outer' fedavg", "fedavgm, nesterov, fedadam, fedyogi"]),
    ("outer-lr", {"outer": "nesterov", "outer-lr": -1.0}, ["> 0"]),
    ("outer-momentum", {"outer": "fedadam", "outer-momentum": 0.5}, ["does not apply", "fedavgm, nesterov"]),
    ("outer-momentum", {"outer": "nesterov", "outer-momentum": 1.5}, ["[0, 1)"]),
    ("aggregation", {"aggregation": "p2p"}, ["decentralized, server"]),
    ("facilities", {"facilities": "a,,b"}, ["non-empty"]),
    ("facilities", {"aggregation": "server", "facilities": "a,,b"}, ["non-empty"]),
    ("outer", {"aggregation": "server", "outer": "trimmed-mean"}, ["fedavg, fedavgm, nesterov, fedadam, fedyogi"]),
    ("checkpoint-rounds", {"checkpoint-rounds": 0}, [">= 1"]),
    ("resume", {"resume": True}, ["checkpoint-dir"]),
    ("facility-shards", {"aggregation": "server", "facility-shards": "b=1"}, ["iid-groups", "document"]),
    ("facility-shards", {"aggregation": "server", "facility-shards": "b=0", "partition": "iid-groups"},
     ["facility=S", "S >= 1"]),
    ("facility-shards", {"aggregation": "server", "facility-shards": "b", "partition": "iid-groups"}, ["facility=S"]),
    ("server-buffer-mb", {"aggregation": "server", "server-buffer-mb": 0.0}, ["> 0"]),
    ("sync-dtype", {"sync-dtype": "float16"}, ["float32, bfloat16"]),
    ("sync-dtype", {"sync-dtype": "bfloat16", "outer": "trimmed-mean"}, ["trimmed-mean"]),
]


@pytest.mark.parametrize("key,run_config,words", BAD_RUN_CONFIGS,
                         ids=[" ".join(f"{k}={v}" for k, v in c.items()) for _, c, _ in BAD_RUN_CONFIGS])
def test_bad_run_config_is_a_clear_config_error(key, run_config, words):
    """Every run option that can be wrong: a ConfigError naming the run-config key (with '-', as typed in
    `--run-config`, not a CLI option '--key') and what it accepts."""
    with pytest.raises(ConfigError) as info:
        FlowerRun.from_run_config(run_config).validate()
    message = str(info.value)
    assert message.startswith("run config"), message
    assert re.search(rf"(?<![\w-]){re.escape(key)}(?![\w-])", message), f"{key!r} not named in: {message}"
    assert "--" not in message, message
    for word in words:
        assert word in message, message


def test_groups_of_different_sizes_may_sync_decentralised():
    """facility-shards on the decentralised path: the groups average their shards piece by piece."""
    run = FlowerRun.from_run_config({"facilities": "a,b", "facility-shards": "b=1", "shards": 2,
                                     "partition": "iid-groups"})
    run.validate()
    assert [run.for_group(i).train.parallel.shards for i in range(2)] == [2, 1]


def test_valid_outer_options_pass():
    FlowerRun.from_run_config({"outer": "nesterov", "outer-lr": 0.5, "outer-momentum": 0.8}).validate()
    FlowerRun.from_run_config({"outer": "fedadam", "outer-lr": 0.05}).validate()


def test_layout_mismatch_names_both_sides():
    run = FlowerRun.from_run_config({"method": "fl-fsdp", "shards": 4})
    layout = M.GroupLayout(method="fl-fsdp", replicas=1, shards=2, world=2)
    text = layout.mismatch(run)
    assert "R=1 x S=4 = 4 ranks" in text and "S=2 = 2 ranks" in text
    assert M.GroupLayout("fl-fsdp", 1, 4, 4).mismatch(run) == ""


def test_round_options_are_checked_and_nothing_else_passes():
    options = RoundOptions.from_config({"aggregate-every": 3, "lr": 0.01})
    assert options == RoundOptions(aggregate_every=3, lr=0.01)
    assert options.to_config() == {"aggregate-every": 3, "lr": 0.01}
    run = FlowerRun()
    resolved = options.for_run(run)
    assert (resolved.aggregate_every, resolved.lr) == (3, 0.01)
    assert (resolved.syncs_per_round, resolved.proximal_mu) == (run.federation.syncs_per_round,
                                                                run.train.optim.proximal_mu)
    with pytest.raises(ConfigError, match="'warmup' is not a round option"):
        RoundOptions.from_config({"warmup": 0.5})
    with pytest.raises(ConfigError, match="'aggregate-every' must be an integer >= 1"):
        RoundOptions.from_config({"aggregate-every": 0})
    assert set(ROUND_KEYS) <= {o.name for o in schema.options(FlowerRun)}


TRAIN = dict(server_round=2, job="run1/round2/7", members=["7", "9"], member_index=1, rendezvous_host="h",
             rendezvous_ports=[1, 2], prefix="run1/round2", rendezvous_timeout=5.0, sync_timeout=9.0,
             secret="s" * 64)


def test_train_arguments_round_trip_and_unknown_keys_are_refused():
    args = M.TrainArgs(**TRAIN, catch_up=True, round=RoundOptions(proximal_mu=0.01))
    config = args.to_config()
    assert config["member-index"] == 1 and config["proximal-mu"] == 0.01 and "round" not in config
    assert M.TrainArgs.from_config({**config, "timeout": 60.0}) == args  # the ClientApp's own keys are allowed
    with pytest.raises(M.ArgumentError, match="'my-key' is not known to this group"):
        M.TrainArgs.from_config({**config, "my-key": 1})
    with pytest.raises(M.ArgumentError, match="lacks members"):
        M.TrainArgs.from_config({k: v for k, v in config.items() if k != "members"})
    with pytest.raises(M.ArgumentError, match="member-index 5"):
        M.TrainArgs.from_config({**config, "member-index": 5})


@pytest.mark.parametrize("key,value,message", [
    ("member-index", "1", "'member-index' must be of type int"),
    ("member-index", -1, "'member-index' must be an integer >= 0"),
    ("rendezvous-ports", [1, 70000], "'rendezvous-ports' must be an integer in \\[1, 65535\\], got 70000"),
    ("members", "7,9", "'members' must be a list of str"),
    ("sync-timeout", 0.0, "'sync-timeout' must be > 0"),
    ("evaluate", "yes", "'evaluate' must be of type bool"),
    ("aggregate-every", 0, "'aggregate-every' must be an integer >= 1"),
    ("secret", "short", "'secret' must be a string of at least 32 characters"),
])
def test_train_arguments_are_checked_by_the_schema_naming_the_key(key, value, message):
    """Every train-config key is a schema option (the round options are the run's own, `same_as`): a mistyped or
    out-of-range value is refused naming the key, before the group does anything."""
    config = M.TrainArgs(**TRAIN).to_config()
    with pytest.raises(M.ArgumentError, match=message):
        M.TrainArgs.from_config({**config, key: value})


def test_instructions_and_replies_round_trip():
    obj = M.instruction(M.TRAIN, {"job": "j", "members": ["1", "2"]}, detach=True)
    assert obj["detach"] is True
    assert M.check_instruction(M.decode(M.encode(obj))) == (M.TRAIN, {"job": "j", "members": ["1", "2"]})
    with pytest.raises(M.ProtocolError):
        M.instruction("format-disk")
    with pytest.raises(M.ProtocolError):
        M.check_instruction({"version": 99, "verb": "train", "args": {}})
    with pytest.raises(M.ProtocolError):
        M.decode(b"\x80not json")


def test_authkey_files(tmp_path):
    key = E.write_authkey(tmp_path / "k")
    assert oct((tmp_path / "k").stat().st_mode & 0o777) == "0o600"
    assert E.read_authkey(tmp_path / "k") == key
    os.chmod(tmp_path / "k", 0o644)
    with pytest.raises(ConfigError, match="accessible by other users"):
        E.read_authkey(tmp_path / "k")
    with pytest.raises(ConfigError, match="does not exist"):
        E.read_authkey(tmp_path / "missing")


def test_addresses():
    assert E.parse_address("127.0.0.1:7100") == ("127.0.0.1", 7100)
    assert E.parse_address("[::1]:80") == ("::1", 80)
    assert E.format_address("::1", 80) == "[::1]:80"
    for bad in ("localhost", ":80", "host:port", "h:99999"):
        with pytest.raises(ConfigError):
            E.parse_address(bad)


def test_the_group_runtime_options_table_lists_every_flag():
    from flwr_sharded.flower.group.runtime import runtime_parser

    flags = {a for action in runtime_parser()._actions for a in action.option_strings
             if a.startswith("--") and a != "--help" and action.help != "==SUPPRESS=="}
    text = (REPO / "docs" / "flower.md").read_text()
    table = text[text.index("### Group runtime options"):text.index("## Run config and outputs")]
    documented = set(re.findall(r"`(--[a-z-]+)`", table))
    assert documented == flags
