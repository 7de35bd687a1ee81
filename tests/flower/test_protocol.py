"""Run settings, message encoding and keys shared by the ClientApp and the groups (no processes, no torch)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flwr_sharded.errors import ConfigError
from flwr_sharded.flower import protocol as P


def test_client_side_modules_do_not_import_torch():
    app = Path(__file__).resolve().parents[2] / "apps" / "llama_fl_hsdp"
    code = (f"import sys; sys.path.insert(0, {str(app)!r}); import llama_fl_hsdp.client_app, "
            "flwr_sharded.flower.client, flwr_sharded.flower.protocol, flwr_sharded.flower.strategy; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_run_spec_from_run_config_and_back():
    spec = P.RunSpec.from_run_config({"num-server-rounds": 5, "syncs-per-round": 2, "aggregate-every": 3,
                                      "method": "fl-hsdp", "replicas": 2, "shards": 1, "lr": 1,
                                      "unrelated-key": "kept out"})
    assert (spec.rounds, spec.syncs_per_round, spec.aggregate_every, spec.lr) == (5, 2, 3, 1.0)
    assert spec.total_steps == 30 and spec.group_world == 2
    assert P.RunSpec.from_json(spec.to_json()) == spec
    spec.validate()
    cfg = spec.train_config_dict()
    assert cfg["steps"] == 30 and cfg["parallel"]["federations"] == 1 and cfg["parallel"]["replicas"] == 2


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
    ("max-train-blocks", {"max-train-blocks": -1}, [">= 0", "0: all"]),
    ("eval-blocks", {"eval-blocks": -1}, [">= 0"]),
    ("optimizer", {"optimizer": "adam"}, ["adamw, sgd"]),
    ("lr", {"lr": 0.0}, ["> 0"]),
    ("lr", {"lr": -1.0}, ["> 0"]),
    ("lr", {"lr": "fast"}, ["of type float"]),
    ("warmup", {"warmup": -0.5}, [">= 0"]),
    ("min-lr-ratio", {"min-lr-ratio": 1.5}, ["[0, 1]"]),
    ("weight-decay", {"weight-decay": -0.1}, [">= 0"]),
    ("grad-clip", {"grad-clip": -1.0}, [">= 0"]),
    ("bucket-mb", {"bucket-mb": 0.0}, ["> 0"]),
    ("reset-optimizer-state", {"reset-optimizer-state": "maybe"}, ["of type bool"]),
    ("outer", {"outer": "fedprox"}, ["fedavg, fedavgm, nesterov, fedadam, fedyogi, trimmed-mean"]),
    ("outer-lr", {"outer-lr": 0.5}, ["does not apply to outer fedavg", "fedavgm, nesterov, fedadam, fedyogi"]),
    ("outer-lr", {"outer": "nesterov", "outer-lr": -1.0}, ["> 0", "0 for the rule's default"]),
    ("outer-momentum", {"outer": "fedadam", "outer-momentum": 0.5}, ["does not apply", "fedavgm, nesterov"]),
    ("outer-momentum", {"outer": "nesterov", "outer-momentum": 1.5}, ["[0, 1)"]),
    ("aggregation", {"aggregation": "p2p"}, ["decentralized, server"]),
    ("facilities", {"facilities": "a,a,b"}, ["server"]),
    ("facilities", {"aggregation": "server", "facilities": "a,,b"}, ["non-empty"]),
    ("outer", {"aggregation": "server", "outer": "trimmed-mean"}, ["fedavg, fedavgm, nesterov, fedadam, fedyogi"]),
    ("checkpoint-every", {"checkpoint-every": 0}, [">= 1"]),
    ("resume", {"resume": True}, ["checkpoint-dir"]),
    ("facility-shards", {"facility-shards": "b=1", "partition": "iid-groups"}, ["server"]),
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
    """Every RunSpec field that can be wrong: a ConfigError naming the run-config key (with '-', as typed in
    `--run-config`, not a CLI option '--key') and what it accepts."""
    with pytest.raises(ConfigError) as info:
        P.RunSpec.from_run_config(run_config).validate()
    message = str(info.value)
    assert message.startswith("run config"), message
    assert re.search(rf"(?<![\w-]){re.escape(key)}(?![\w-])", message), f"{key!r} not named in: {message}"
    assert "--" not in message, message
    for word in words:
        assert word in message, message


def test_valid_outer_options_pass():
    P.RunSpec.from_run_config({"outer": "nesterov", "outer-lr": 0.5, "outer-momentum": 0.8}).validate()
    P.RunSpec.from_run_config({"outer": "fedadam", "outer-lr": 0.05}).validate()


def test_layout_mismatch_names_both_sides():
    spec = P.RunSpec(method="fl-fsdp", shards=4)
    layout = P.GroupLayout(method="fl-fsdp", replicas=1, shards=2, world=2)
    text = layout.mismatch(spec)
    assert "R=1 x S=4 = 4 ranks" in text and "S=2 = 2 ranks" in text
    assert P.GroupLayout("fl-fsdp", 1, 4, 4).mismatch(spec) == ""


def test_instructions_and_replies_round_trip():
    obj = P.instruction(P.TRAIN, {"syncs": 2, "members": ["1", "2"]})
    assert P.check_instruction(P.decode(P.encode(obj))) == (P.TRAIN, {"syncs": 2, "members": ["1", "2"]})
    with pytest.raises(P.ProtocolError):
        P.instruction("format-disk")
    with pytest.raises(P.ProtocolError):
        P.check_instruction({"version": 99, "verb": "train", "args": {}})
    with pytest.raises(P.ProtocolError):
        P.decode(b"\x80not json")


def test_authkey_files(tmp_path):
    key = P.write_authkey(tmp_path / "k")
    assert oct((tmp_path / "k").stat().st_mode & 0o777) == "0o600"
    assert P.read_authkey(tmp_path / "k") == key
    os.chmod(tmp_path / "k", 0o644)
    with pytest.raises(ConfigError, match="accessible by other users"):
        P.read_authkey(tmp_path / "k")
    with pytest.raises(ConfigError, match="does not exist"):
        P.read_authkey(tmp_path / "missing")


def test_addresses():
    assert P.parse_address("127.0.0.1:7100") == ("127.0.0.1", 7100)
    assert P.parse_address("[::1]:80") == ("::1", 80)
    assert P.format_address("::1", 80) == "[::1]:80"
    for bad in ("localhost", ":80", "host:port", "h:99999"):
        with pytest.raises(ConfigError):
            P.parse_address(bad)
