"""The emulated network inside the isolated runner: node namespaces, bridges, tbf-shaped veths, and ranks run on it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from flwr_sharded.perf.netemu.isolation import _die_with_parent, inside
from flwr_sharded.perf.netemu.topology import EmulationError, EmuTopology

NODE_IFACE = "eth0"


def _tbf(dev: str, bps: float, netns: str | None = None) -> list[str]:
    """tc command adding a tbf root qdisc: burst of 2 ms of traffic, at least 96 KiB, and 100 ms of queue.

    The burst must exceed a 64 KiB GSO packet (veths pass them unsegmented); with a smaller one tbf splits them
    into MTU-sized packets, and the interface counters of that link then carry more header bytes than the others.
    """
    burst = max(96 * 1024, int(bps / 8 * 0.002))
    cmd = ["tc"] + (["-n", netns] if netns else []) + ["qdisc", "add", "dev", dev, "root", "tbf",
                                                       "rate", f"{int(bps)}bit", "burst", str(burst),
                                                       "latency", "100ms"]
    return cmd


@dataclass
class RankResult:
    rank: int
    returncode: int
    stdout: str
    stderr: str


class RankFailure(RuntimeError):
    """A rank of an emulated run failed or the run timed out; every rank was killed."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        """The failed rank's exit code (negative: killed by that signal); None for a timeout."""


@dataclass
class Fabric:
    """The emulated network of an `EmuTopology`; build with `with Fabric(topo) as fab:` inside the runner."""

    topology: EmuTopology
    mtu: int = 1500
    built: list[str] = field(default_factory=list)
    _port: int = 29400
    _procs: list[subprocess.Popen] = field(default_factory=list)

    def __enter__(self) -> Fabric:
        if not inside():
            raise EmulationError("Fabric must be built inside run_isolated() (private namespaces); see "
                                 "flwr_sharded.perf.netemu")
        try:
            self.build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    # ----- building ---------------------------------------------------------------------------------------------
    def _ip(self, *args: str) -> None:
        self._run(["ip", *args])

    def _run(self, cmd: list[str]) -> None:
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            message = result.stderr.strip()
            hint = ""
            if "tbf" in cmd and ("unknown" in message.lower() or "not supported" in message.lower()):
                hint = " (this kernel lacks the tbf qdisc, sch_tbf)"
            raise EmulationError(f"`{' '.join(cmd)}` failed: {message}{hint}")

    def build(self) -> None:
        t = self.topology
        self._ip("link", "set", "lo", "up")
        multi_group = t.groups > 1
        if multi_group:
            self._ip("link", "add", "fbtop", "type", "bridge")
            self._ip("link", "set", "fbtop", "up")
        for g in range(t.groups):
            br = f"fbg{g}"
            self._ip("link", "add", br, "type", "bridge")
            self._ip("link", "set", br, "mtu", str(self.mtu), "up")
            if multi_group:
                self._ip("link", "add", f"up{g}", "mtu", str(self.mtu), "type", "veth", "peer", "name", f"dn{g}",
                         "mtu", str(self.mtu))
                self._ip("link", "set", f"up{g}", "master", br, "up")
                self._ip("link", "set", f"dn{g}", "master", "fbtop", "up")
                if t.inter_group_bps:
                    self._run(_tbf(f"up{g}", t.inter_group_bps))
                    self._run(_tbf(f"dn{g}", t.inter_group_bps))
        for k in range(t.nodes):
            ns, g = t.netns(k), t.group_of_node(k)
            self._ip("netns", "add", ns)
            self.built.append(ns)
            self._ip("link", "add", f"vn{k}", "mtu", str(self.mtu), "type", "veth", "peer", "name", NODE_IFACE,
                     "mtu", str(self.mtu), "netns", ns)
            self._ip("link", "set", f"vn{k}", "master", f"fbg{g}", "up")
            self._ip("-n", ns, "link", "set", "lo", "up")
            self._ip("-n", ns, "addr", "add", f"{t.node_ip(k)}/16", "dev", NODE_IFACE)
            self._ip("-n", ns, "link", "set", NODE_IFACE, "up")
            if t.inter_node_bps:
                self._run(_tbf(f"vn{k}", t.inter_node_bps))
                self._run(_tbf(NODE_IFACE, t.inter_node_bps, netns=ns))
        self._wait_bridges()

    def _wait_bridges(self, timeout: float = 10.0) -> None:
        """Bridge ports start in the listening state for a moment; wait until node 0 reaches every node."""
        t = self.topology
        deadline = time.monotonic() + timeout
        for k in range(1, t.nodes):
            while True:
                ok = subprocess.run(["ip", "netns", "exec", t.netns(0), sys.executable, "-c",
                                     _REACH, t.node_ip(k)], capture_output=True).returncode == 0
                if ok:
                    break
                if time.monotonic() > deadline:
                    raise EmulationError(f"node 0 cannot reach node {k} ({t.node_ip(k)}) through the emulated "
                                         f"bridges after {timeout} s")
                time.sleep(0.1)

    def teardown(self) -> None:
        """Kill launched processes and delete namespaces and bridges (the kernel would do it at exit anyway)."""
        self.kill_all()
        for ns in reversed(self.built):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.built.clear()
        for g in range(self.topology.groups):
            subprocess.run(["ip", "link", "del", f"fbg{g}"], capture_output=True)
            subprocess.run(["ip", "link", "del", f"up{g}"], capture_output=True)
        subprocess.run(["ip", "link", "del", "fbtop"], capture_output=True)

    # ----- processes --------------------------------------------------------------------------------------------
    def spawn(self, node: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              stdout: Any = None, stderr: Any = None) -> subprocess.Popen:
        """Start `argv` in node `node`'s namespace, in its own session, killed with its parent."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.topology.netns(node), *argv],
                                env={**os.environ, **(env or {})}, stdout=stdout, stderr=stderr,
                                start_new_session=True, preexec_fn=_die_with_parent)
        self._procs.append(proc)
        return proc

    def kill_all(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()

    def rank_env(self, rank: int, world: int | None = None, port: int | None = None) -> dict[str, str]:
        t = self.topology
        world = world or t.world_size
        return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % t.ranks_per_node),
                "LOCAL_WORLD_SIZE": str(t.ranks_per_node), "GROUP_RANK": str(t.node_of(rank)),
                "MASTER_ADDR": t.node_ip(0), "MASTER_PORT": str(port or self._port),
                "GLOO_SOCKET_IFNAME": NODE_IFACE, "OMP_NUM_THREADS": "1", "FLWR_SHARDED_NETEMU_RANK": str(rank),
                "FLWR_SHARDED_NETDEV": f"fabric=/proc/{os.getpid()}/net/dev"}

    def run_ranks(self, argv: Callable[[int], Sequence[str]] | Sequence[str], *, world: int | None = None,
                  env: Mapping[str, str] | None = None, timeout: float = 600.0,
                  log_dir: str | os.PathLike | None = None) -> list[RankResult]:
        """Run one process per rank (rank r on node r // ranks_per_node) and wait for all of them.

        If a rank exits non-zero or the timeout passes, every rank is killed and RankFailure names the first failing
        rank with the end of its stderr. Output goes to files in `log_dir` (a temporary directory if None).
        """
        t = self.topology
        world = world or t.world_size
        if world > t.world_size:
            raise EmulationError(f"{world} ranks do not fit {t.describe()}")
        self._port += 1
        port = self._port
        tmp = None
        if log_dir is None:
            tmp = tempfile.TemporaryDirectory(prefix="flwr-netemu-")
            log_dir = tmp.name
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        procs: list[tuple[int, subprocess.Popen, Any, Any]] = []
        try:
            for rank in range(world):
                cmd = argv(rank) if callable(argv) else argv
                out = open(log_dir / f"rank{rank}.out", "w")
                err = open(log_dir / f"rank{rank}.err", "w")
                proc = self.spawn(t.node_of(rank), cmd, env={**(env or {}), **self.rank_env(rank, world, port)},
                                  stdout=out, stderr=err)
                procs.append((rank, proc, out, err))
            deadline = time.monotonic() + timeout
            failed: tuple[int, int] | None = None
            while True:
                codes = [p.poll() for _, p, _, _ in procs]
                bad = [(r, c) for (r, *_), c in zip(procs, codes) if c not in (None, 0)]
                if bad:
                    failed = bad[0]
                    break
                if all(c == 0 for c in codes):
                    break
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            if failed is None and any(p.poll() is None for _, p, _, _ in procs):
                self.kill_all()
                raise RankFailure(f"the emulated run did not finish within {timeout:g} s; all ranks killed"
                                  + _tail(log_dir / "rank0.err"))
            if failed is not None:
                time.sleep(0.5)  # let the others report their side
                self.kill_all()
                rank, code = failed
                raise RankFailure(f"rank {rank} (node {t.node_of(rank)}) exited with code {code}; all ranks killed"
                                  + _tail(log_dir / f"rank{rank}.err"), code=code)
            results = []
            for rank, proc, out, err in procs:
                out.close()
                err.close()
                results.append(RankResult(rank, proc.returncode, (log_dir / f"rank{rank}.out").read_text(),
                                          (log_dir / f"rank{rank}.err").read_text()))
            return results
        finally:
            self.kill_all()
            for _, _, out, err in procs:
                out.close()
                err.close()
            if tmp is not None:
                tmp.cleanup()


_REACH = ("import socket, sys\n"
          "s = socket.socket(); s.settimeout(0.5)\n"
          "try:\n    s.connect((sys.argv[1], 9))\nexcept ConnectionRefusedError:\n    sys.exit(0)\n"
          "except OSError:\n    sys.exit(1)\n")
"""Reachability probe without ping: a refused TCP connection means the peer answered."""


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        text = path.read_text()
    except OSError:
        return ""
    return f"\n--- end of {path.name} ---\n{text[-chars:]}" if text.strip() else ""
