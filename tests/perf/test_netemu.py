"""The emulated network: shaping is real, nothing is left behind (after success, a failing rank or a killed runner),
and bad input fails with a clear error before anything is built."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from flwr_sharded_perf.cluster import cluster_from_dict
from flwr_sharded_perf.netemu.isolation import EmulationError, check_host, host_leftovers
from flwr_sharded_perf.netemu.network import EmuTopology, Fabric

from tests import REPO
from tests.multiproc import CAN_EMULATE, needs_emulation


BASE = {"name": "t", "gpus_per_node": 1, "nodes": 4, "nodes_per_group": 2, "gpu_memory": "1GB",
        "flops_per_gpu": "1GFLOPS", "backend": "gloo",
        "bandwidth": {"intra_node": "7.5Gbit", "inter_node": "200Mbit", "inter_group": "20Mbit"}}


def write_cluster(tmp_path: Path, name: str = "c.yaml", **changes) -> Path:
    data = {**BASE, **changes}
    data = {k: v for k, v in data.items() if v is not None}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flwr_sharded.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, **(env or {})})


def host_state() -> dict[str, object]:
    """What the emulator must not leave on the host: namespaces, interfaces, qdiscs, its processes, /run files."""
    def run(*cmd: str) -> str:
        return subprocess.run(cmd, capture_output=True, text=True).stdout

    left = host_leftovers()
    return {"netns": run("ip", "netns", "list"),
            "links": sorted(line.split(":")[1].strip() for line in run("ip", "-o", "link").splitlines()),
            "qdiscs": run("tc", "qdisc", "show"), "run": sorted({"netns", "mount"} & set(os.listdir("/run"))),
            "emulator_links": left["links"], "emulator_processes": left["processes"]}


def assert_clean(before: dict[str, object], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        after = host_state()
        if after == before and not after["emulator_processes"]:
            return
        if time.monotonic() > deadline:
            assert after == before
            assert not after["emulator_processes"]
        time.sleep(0.3)


# ---------------------------------------------------------------------------------------------------------------------
# Description and fit checks (no root needed).


def test_topology_from_cluster_description():
    topo = EmuTopology.from_cluster(cluster_from_dict({**BASE, "gpus_per_node": 2}))
    assert (topo.groups, topo.nodes_per_group, topo.ranks_per_node, topo.world_size) == (2, 2, 2, 8)
    assert (topo.inter_node_bps, topo.inter_group_bps) == (200e6, 20e6)
    assert [topo.node_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [topo.node_ip(k) for k in range(4)] == ["10.77.0.1", "10.77.0.2", "10.77.1.1", "10.77.1.2"]
    assert topo.uplinks() == ["up0", "up1"]
    assert any("intra-node" in n for n in topo.notes)
    flat = EmuTopology.from_cluster(cluster_from_dict({**BASE, "nodes_per_group": None,
                                                       "bandwidth": {"inter_node": "1Gbit"}}))
    assert (flat.groups, flat.inter_group_bps, flat.uplinks()) == (1, None, [])


@pytest.mark.parametrize("changes, words", [
    ({"nodes": 4, "gpus_per_node": 8}, ["32 ranks", "2 CPU core"]),
    ({"gpu_memory": "50GB", "gpus_per_node": 2}, ["gpu_memory", "do not fit", "memory"]),
    ({"bandwidth": {"intra_node": "1Tbit", "inter_node": "40Gbit", "inter_group": "1Gbit"}},
     ["bandwidth.inter_node", "40 Gbit/s"]),
    ({"bandwidth": {"intra_node": "1Tbit", "inter_node": "1Gbit", "inter_group": "10kbit"}},
     ["bandwidth.inter_group", "too slow"]),
    ({"nodes": 200, "nodes_per_group": 100}, ["200 nodes", "at most 64"]),
])
def test_topology_that_does_not_fit(changes, words):
    topo = EmuTopology.from_cluster(cluster_from_dict({**BASE, **changes}))
    with pytest.raises(EmulationError) as err:
        topo.check_fits(cpus=2, mem_available=24e9)
    for word in words:
        assert word in str(err.value)


def test_backend_and_groups_must_suit_the_emulation():
    with pytest.raises(EmulationError, match="backend: gloo"):
        EmuTopology.from_cluster(cluster_from_dict({**BASE, "backend": "nccl"}))
    with pytest.raises(EmulationError, match="multiple of 'nodes_per_group'"):
        EmuTopology.from_cluster(cluster_from_dict({**BASE, "nodes": 5}))


@pytest.mark.dist
def test_not_root_is_a_clear_error(monkeypatch, tmp_path, capsys):
    from flwr_sharded.cli import main

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(EmulationError, match="needs root"):
        check_host()
    assert main(["bench", "check", "--cluster", str(write_cluster(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert "needs root" in err and "uid 1000" in err


def test_missing_tool_is_named(monkeypatch, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("unshare", "tc"):  # `ip` is missing
        real = shutil.which(tool)
        (bin_dir / tool).symlink_to(real or "/bin/true")
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    with pytest.raises(EmulationError) as err:
        check_host()
    assert "`ip` (package iproute2)" in str(err.value)
    assert "`tc`" not in str(err.value) and "`unshare`" not in str(err.value)


@pytest.mark.dist
def test_missing_tool_through_the_cli(tmp_path):
    before = host_state() if CAN_EMULATE else None
    result = cli("bench", "check", "--cluster", str(write_cluster(tmp_path)), env={"PATH": str(tmp_path)})
    assert result.returncode == 2
    if os.geteuid() == 0:
        assert "not found on PATH" in result.stderr and "`ip`" in result.stderr
    else:
        assert "needs root" in result.stderr
    if before is not None:
        assert_clean(before)


@pytest.mark.dist
@pytest.mark.parametrize("content, words", [
    ("gpus_per_node: 2\nnodes: 2\n", ["'bandwidth'"]),
    ("nodes: [1\n", ["not valid YAML"]),
    (yaml.safe_dump({**BASE, "bandwidth": {"inter_node": "fast"}}), ["bandwidth.inter_node", "fast"]),
    (yaml.safe_dump({**BASE, "gpus_per_node": 16, "nodes": 16}), ["256 ranks", "CPU core"]),
    (yaml.safe_dump({**BASE, "backend": "nccl"}), ["backend: gloo"]),
])
def test_bad_cluster_file_through_the_cli(tmp_path, content, words):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    every = (["bench", "check", "--cluster", str(path)], ["bench", "--cluster", str(path), "--quick"],
             ["bench", "exec", "--cluster", str(path), "--", "true"])
    # the three sub-commands load the file through one function: each is checked on the first case
    for args in every if "'bandwidth'" in words else every[:1]:
        result = cli(*args)
        assert result.returncode == 2, result.stderr
        assert "error:" in result.stderr
        for word in words:
            assert word in result.stderr, result.stderr


@pytest.mark.dist
def test_missing_cluster_file(tmp_path):
    result = cli("bench", "check", "--cluster", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2 and "cannot read" in result.stderr


# ---------------------------------------------------------------------------------------------------------------------
# The emulation itself (root).


@pytest.mark.dist
@needs_emulation
@pytest.mark.timeout(120)
def test_shaping_is_real_and_nothing_is_left(tmp_path):
    before = host_state()
    result = cli("bench", "check", "--cluster", str(write_cluster(tmp_path)), "--json", "--seconds", "0.4")
    assert result.returncode == 0, result.stderr
    links = {r["tier"]: r for r in json.loads(result.stdout)["links"]}
    assert set(links) == {"inter_node", "inter_group"}
    for tier, r in links.items():
        floor = r["bytes"] * 8 / r["configured_bps"]
        # a transfer takes at least bytes / bandwidth (less the tbf burst: 96 KiB), and gets most of the rate
        assert r["seconds"] >= 0.9 * floor, (tier, r)
        assert 0.7 <= r["ratio"] <= 1.05, (tier, r)
    assert links["inter_group"]["measured_bps"] < links["inter_node"]["measured_bps"] / 5
    assert_clean(before)


@pytest.mark.dist
@needs_emulation
@pytest.mark.timeout(120)
def test_failing_rank_kills_the_others_and_leaves_nothing(tmp_path):
    before = host_state()
    script = ("import os, sys, time\n"
              "if os.environ['RANK'] == '2':\n    time.sleep(1); sys.exit(3)\n"
              "time.sleep(300)\n")
    start = time.monotonic()
    result = cli("bench", "exec", "--cluster", str(write_cluster(tmp_path)), "--", sys.executable, "-c", script)
    assert result.returncode == 1
    assert time.monotonic() - start < 60
    assert "rank 2 (node 2) exited with code 3" in result.stderr
    assert_clean(before)


@pytest.mark.dist
@needs_emulation
@pytest.mark.timeout(120)
def test_ranks_see_their_node_and_rank_zero(tmp_path):
    script = ("import os, socket\n"
              "print(os.environ['RANK'], os.environ['MASTER_ADDR'], os.environ['GLOO_SOCKET_IFNAME'], "
              "sorted(i[1] for i in socket.if_nameindex()))\n")
    result = cli("bench", "exec", "--cluster", str(write_cluster(tmp_path, gpus_per_node=2)), "--nproc", "3", "--",
                 sys.executable, "-c", script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[:3] == ["0", "10.77.0.1", "eth0"]
    assert "['eth0', 'lo']" in result.stdout


@pytest.mark.dist
@needs_emulation
@pytest.mark.timeout(120)
def test_killed_runner_leaves_nothing(tmp_path):
    before = host_state()
    proc = subprocess.Popen([sys.executable, "-m", "flwr_sharded.cli", "bench", "exec", "--cluster",
                             str(write_cluster(tmp_path)), "--", sys.executable, "-c", "import time; time.sleep(300)"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while len(host_leftovers()["processes"]) < 4 + 1:  # 4 ranks and the runner
            assert time.monotonic() < deadline, "the emulated ranks did not start"
            assert proc.poll() is None
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)  # the outer process only: no cleanup code of ours runs
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_clean(before, timeout=20)


@pytest.mark.dist
@needs_emulation
def test_fabric_refuses_to_build_outside_the_namespaces():
    topo = EmuTopology("x", ranks_per_node=1, nodes=2, nodes_per_group=1, inter_node_bps=None,
                       inter_group_bps=1e8)
    with pytest.raises(EmulationError, match="inside run_isolated"):
        with Fabric(topo):
            pass
