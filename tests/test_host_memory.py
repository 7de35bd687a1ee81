"""`flwr_sharded.host_memory`: freed buffers go back to the OS (glibc), a no-op elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests import REPO

glibc_only = pytest.mark.skipif(not (hasattr(os, "confstr") and (os.confstr("CS_GNU_LIBC_VERSION") or "")
                                     .startswith("glibc")), reason="glibc's allocator")

# In a fresh process: free one 8 MiB buffer (glibc's dynamic threshold rises to it), then 64 written 1 MiB buffers
# below a guard buffer that keeps them off the heap's top, and print the resident MiB they leave behind.
PROBE = """
import ctypes, sys
from flwr_sharded import host_memory
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096 / 2 ** 20
if sys.argv[1] == "pin":
    assert host_memory.pin_thresholds() == {"M_TRIM_THRESHOLD": True, "M_MMAP_THRESHOLD": True}
def written(n):
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    return p
libc.free(written(8 << 20))
base = rss()
chunks = [written(1 << 20) for _ in range(64)]
guard = written(512 << 10)
for c in chunks:
    libc.free(c)
if sys.argv[1] == "trim":
    host_memory.trim()
if sys.argv[1] == "period":
    host_memory.after_period()
print(rss() - base)
"""


def _left_resident_mib(mode: str, **env: str) -> float:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO), **env})
    assert done.returncode == 0, done.stderr
    return float(done.stdout)


@pytest.mark.dist
@glibc_only
def test_pinned_thresholds_and_trim_return_freed_buffers():
    assert _left_resident_mib("default") > 48  # what the entry points avoid: the freed 64 MiB stay resident
    assert _left_resident_mib("pin") < 4
    assert _left_resident_mib("trim") < 4
    assert _left_resident_mib("period") < 4  # what a sync period's end does


@pytest.mark.dist
@glibc_only
def test_the_environment_wins_over_the_pinned_threshold():
    code = ("from flwr_sharded import host_memory; "
            "print(sorted(host_memory.pin_thresholds().items()))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO), "MALLOC_MMAP_THRESHOLD_": "65536"})
    assert done.stdout.strip() == "[('M_MMAP_THRESHOLD', False), ('M_TRIM_THRESHOLD', True)]", done.stderr


def test_other_c_libraries_are_left_alone(monkeypatch, caplog):
    from flwr_sharded import host_memory

    host_memory._glibc.cache_clear()
    monkeypatch.setattr(os, "confstr", lambda name: "musl 1.2", raising=False)
    try:
        with caplog.at_level("DEBUG", logger="flwr_sharded.host_memory"):
            assert host_memory.pin_thresholds() == {} and host_memory.trim() is False
        assert "not glibc" in caplog.text
    finally:
        host_memory._glibc.cache_clear()


@pytest.mark.dist
def test_the_entry_points_pin_the_thresholds(monkeypatch, tmp_path):
    from flwr_sharded import host_memory, train

    calls = []
    monkeypatch.setattr(host_memory, "pin_thresholds", lambda: calls.append("train") or {})
    assert train.main(["--method", "fsdp", "--federations", "2", "--print-config"]) == 2  # refused, after pinning
    assert calls == ["train"]
    code = ("import runpy, sys; from flwr_sharded import host_memory as m; "
            "m.pin_thresholds = lambda: print('pinned', 'torch' in sys.modules, flush=True) or {}; "
            "m.no_flight_recorder = lambda: print('recorder off', 'torch' in sys.modules, flush=True) or True; "
            f"sys.argv = ['group', '--authkey-file', {str(tmp_path / 'missing')!r}]; "
            "runpy.run_module('flwr_sharded.flower.group', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["pinned False", "recorder off False"], (done.stdout, done.stderr[-2000:])


@pytest.mark.parametrize("preset", [None, "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"])
def test_the_flight_recorder_is_off_unless_the_environment_sizes_it(monkeypatch, preset):
    from flwr_sharded import host_memory

    for name in host_memory.FLIGHT_RECORDER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    if preset:
        monkeypatch.setenv(preset, "2000")
    assert host_memory.no_flight_recorder() is (preset is None)
    assert os.environ.get("TORCH_FR_BUFFER_SIZE") == ("0" if preset is None else "2000" if preset ==
                                                      "TORCH_FR_BUFFER_SIZE" else None)
