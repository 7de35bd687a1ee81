"""Run settings, message encoding and keys shared by the ClientApp and the groups (no processes, no torch)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flwr_sharded.config import ConfigError
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


@pytest.mark.parametrize("override,message", [
    ({"method": "fl-bogus"}, "'method' must be one of fl-fsdp, fl-hsdp"),
    ({"method": "fsdp"}, "'method' must be one of"),
    ({"aggregate-every": 0}, "'aggregate-every' must be an integer >= 1"),
    ({"syncs-per-round": 0}, "'syncs-per-round' must be an integer >= 1"),
    ({"shards": 0}, "'shards' must be an integer >= 1"),
    ({"replicas": 2}, "fl-fsdp has no replication"),
    ({"lr": -1.0}, "lr must be > 0"),
])
def test_bad_run_config_is_a_clear_config_error(override, message):
    spec = P.RunSpec.from_run_config(override)
    with pytest.raises(ConfigError, match=message):
        spec.validate()


def test_wrong_types_are_rejected():
    with pytest.raises(ConfigError, match="'shards' must be of type int"):
        P.RunSpec.from_run_config({"shards": "two"})


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
