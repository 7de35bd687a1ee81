"""The wire registry: every list of wire dtypes derives from it, and it loads without torch."""

from __future__ import annotations

import re
import subprocess
import sys
import typing

import pytest

from tests.multiproc import REPO


def test_the_option_the_8_bit_wires_and_the_bytes_derive_from_the_registry():
    from flwr_sharded.config import ParallelConfig
    from flwr_sharded.parallel.wire import QUANTIZED, SYNC_DTYPE_BYTES, WIRES, SyncDtype
    from flwr_sharded.schema import options

    names = tuple(WIRES)
    assert names[:4] == ("float32", "bfloat16", "int8", "float8_e4m3fn") and "float8_e5m2" in names
    assert typing.get_args(SyncDtype) == names == tuple(SYNC_DTYPE_BYTES)
    sync_dtype = next(o for o in options(ParallelConfig) if o.path[-1] == "sync_dtype")
    assert tuple(sync_dtype.choices) == names
    assert QUANTIZED == tuple(n for n, w in WIRES.items() if w.error_feedback) == ("int8", "float8_e4m3fn",
                                                                                    "float8_e5m2", "int4",
                                                                                    "float4_e2m1", "int2")
    assert [n for n, w in WIRES.items() if not w.delta] == ["float32"]


def test_the_sync_dtype_docstring_names_exactly_the_registered_wires():
    from flwr_sharded.config import ParallelConfig
    from flwr_sharded.parallel.wire import WIRES
    from flwr_sharded.schema import options

    doc = next(o for o in options(ParallelConfig) if o.path[-1] == "sync_dtype").doc
    named = set(re.findall(r"\b(?:b?float\d+\w*|u?int\d+)\b", doc))
    assert named == set(WIRES), named ^ set(WIRES)


def test_a_wire_is_registered_once_and_unknown_dtypes_are_named():
    from flwr_sharded.parallel.wire import WIRES, register_wire, wire_of

    with pytest.raises(ValueError, match="registered twice"):
        register_wire(type(WIRES["int8"]))
    assert wire_of("torch.bfloat16") is WIRES["bfloat16"]
    with pytest.raises(ValueError, match="float16 is not a wire dtype.*float32, bfloat16, int8"):
        wire_of("float16")


@pytest.mark.dist
def test_the_registry_loads_without_torch():
    code = ("import sys; import flwr_sharded.parallel.wire as w, flwr_sharded.config; "
            "print(len(w.WIRES), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(REPO), "PATH": ""})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[1] == "False", out.stdout


def test_check_wire_dtype_allows_int8_everywhere_and_fp8_where_the_device_casts_it(monkeypatch):
    import torch

    from flwr_sharded.errors import ConfigError
    from flwr_sharded.parallel import wire

    assert wire.check_wire_dtype("int8", "cpu") == torch.int8
    assert wire.check_wire_dtype("float8_e4m3fn", "cpu") == torch.float8_e4m3fn  # torch >= 2.1 casts to e4m3 on CPU
    assert wire.check_wire_dtype("int4", "cpu") == torch.int4  # torch's placeholder dtype names the format
    assert wire.check_wire_dtype("float4_e2m1", "cpu") == torch.float4_e2m1fn_x2  # decoded through a table: anywhere
    assert wire.check_wire_dtype("int2", "cpu") == torch.int2
    with pytest.raises(ConfigError, match=r"--sync-dtype float16 is not a quantized wire dtype.*int8, float8_e4m3fn"):
        wire.check_wire_dtype("float16", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, ok in (((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert wire.check_wire_dtype("int8", "cuda:0") == torch.int8
        if ok:
            assert wire.check_wire_dtype("float8_e4m3fn", "cuda:0") == torch.float8_e4m3fn
        else:
            with pytest.raises(ConfigError, match=r"--sync-dtype float8_e4m3fn needs .*capability >= 8.9.*: "
                                                  r"int8, int4, float4_e2m1, int2$"):
                wire.check_wire_dtype("float8_e4m3fn", "cuda:0")
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: (_ for _ in ()).throw(RuntimeError("no e4m3")))
    with pytest.raises(ConfigError, match="on cpu: int8, int4, float4_e2m1, int2$"):  # a CPU that cannot cast to e4m3
        wire.check_wire_dtype("float8_e4m3fn", "cpu")
