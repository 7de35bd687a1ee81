"""An emulated tiered cluster on one Linux machine: network namespaces, bridges and tbf-shaped veth links.

A cluster description (the planner's YAML: `gpus_per_node`, `nodes`, `nodes_per_group`, `bandwidth`) becomes:

- one network namespace per node (`fsn<k>`), holding that node's ranks; ranks of one node talk over the namespace's
  own loopback, unshaped (the emulator's "NVLink");
- a fabric: the runner's own network namespace, with one bridge per node group (`fbg<g>`, the group switch) and a
  top bridge (`fbtop`);
- per node a veth pair `eth0` (in the node, address 10.77.<g>.<n+1>/16) <-> `vn<k>` (on its group bridge), shaped
  with tbf at the inter-node bandwidth on both directions;
- per group a veth pair `up<g>` (on the group bridge) <-> `dn<g>` (on the top bridge), shaped with tbf at the
  inter-group bandwidth on both directions (only with more than one group).

Everything runs inside `unshare --net --mount --pid --fork --kill-child` with a private tmpfs on /run (where
`ip netns` keeps its files): when the runner exits, even after a crash or SIGKILL, the kernel removes every
namespace, interface, qdisc and process it made. `run_isolated` re-executes a command that way; `Fabric` builds the
network inside and launches ranks (`RANK`, `WORLD_SIZE`, `MASTER_ADDR` = rank 0's node, `GLOO_SOCKET_IFNAME=eth0`).

Latency is not emulated (the kernel has no netem); `latency` in the description is ignored here.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from flwr_sharded.errors import ConfigError

INSIDE_ENV = "FLWR_SHARDED_NETEMU_INSIDE"
"""Set (to the outer process id) in the re-executed runner: it runs in the private namespaces."""
TOOLS = {"unshare": "util-linux", "ip": "iproute2", "tc": "iproute2"}
"""Commands the emulator needs, and the package that provides each."""
SUBNET = "10.77"
NODE_IFACE = "eth0"
MAX_SHAPED_BPS = 5e9
"""Highest tbf rate accepted: unshaped veths between namespaces reach about 7 Gbit/s on this kind of machine."""
MIN_SHAPED_BPS = 1e6
MAX_NODES = 64
MAX_GROUPS = 32
RANKS_PER_CORE = 8
"""At most this many ranks per CPU core: beyond it a run measures the scheduler, not the network."""


class EmulationError(ConfigError):
    """The emulated cluster cannot be built or run here; the message names the problem."""


# ---------------------------------------------------------------------------------------------------------------------
# Description.


@dataclass(frozen=True)
class EmuTopology:
    """What gets built: groups x nodes per group x ranks per node, and the tbf rates of the two shaped tiers."""

    name: str
    ranks_per_node: int
    nodes: int
    nodes_per_group: int
    inter_node_bps: float | None
    """tbf rate of every node link (both directions); None: unshaped (no inter-node traffic, or not limited)."""
    inter_group_bps: float | None
    """tbf rate of every group uplink (both directions); None with a single group."""
    memory_per_rank: float = 0.0
    """Bytes of RAM one rank may use (the description's `gpu_memory`), for the fit check."""
    notes: tuple[str, ...] = ()
    """What the description asks for that the emulation does not do (latency, intra-node bandwidth)."""

    @property
    def groups(self) -> int:
        return self.nodes // self.nodes_per_group

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def group_of_node(self, node: int) -> int:
        return node // self.nodes_per_group

    def netns(self, node: int) -> str:
        return f"fsn{node}"

    def node_ip(self, node: int) -> str:
        return f"{SUBNET}.{self.group_of_node(node)}.{node % self.nodes_per_group + 1}"

    def uplinks(self) -> list[str]:
        """Fabric interfaces whose tx counts the bytes leaving each group."""
        return [f"up{g}" for g in range(self.groups)] if self.groups > 1 else []

    def describe(self) -> str:
        shaped = []
        if self.inter_node_bps:
            shaped.append(f"node links {_rate(self.inter_node_bps)}")
        if self.inter_group_bps:
            shaped.append(f"group uplinks {_rate(self.inter_group_bps)}")
        return (f"{self.name}: {self.groups} group(s) x {self.nodes_per_group} node(s) x {self.ranks_per_node} rank(s) "
                f"= {self.world_size} ranks; {', '.join(shaped) or 'no shaping'}; intra-node: loopback")

    @classmethod
    def from_cluster(cls, cluster: Any) -> EmuTopology:
        """From a planner `Cluster` (see `flwr_sharded.perf.planner.load_cluster`)."""
        where = f"cluster {cluster.name}"
        if cluster.backend != "gloo":
            raise EmulationError(f"{where}: the emulation runs CPU processes on gloo; set 'backend: gloo' (got "
                                 f"{cluster.backend!r}) so that the cost model counts what gloo sends")
        nodes_per_group = cluster.nodes_per_group or cluster.nodes
        if cluster.nodes % nodes_per_group:
            raise EmulationError(f"{where}: 'nodes' ({cluster.nodes}) must be a multiple of 'nodes_per_group' "
                                 f"({nodes_per_group}) to build equal groups")
        groups = cluster.nodes // nodes_per_group
        inter_node = cluster.bandwidth.get("inter_node") if nodes_per_group > 1 or groups > 1 else None
        inter_group = cluster.bandwidth.get("inter_group") if groups > 1 else None
        if groups > 1 and inter_node is None:
            inter_node = None  # node links unshaped: only the group uplinks limit
        notes = []
        if any(cluster.latency.values()):
            notes.append("latency is not emulated (no netem in this kernel): only bandwidth is")
        if cluster.gpus_per_node > 1:
            notes.append("intra-node traffic uses each namespace's loopback, unshaped (about 7.5 Gbit/s here); "
                         f"bandwidth.intra_node ({_rate(cluster.bandwidth.get('intra_node', 0))}) is not enforced")
        return cls(name=cluster.name, ranks_per_node=cluster.gpus_per_node, nodes=cluster.nodes,
                   nodes_per_group=nodes_per_group, inter_node_bps=inter_node, inter_group_bps=inter_group,
                   memory_per_rank=cluster.gpu_memory, notes=tuple(notes))

    def check_fits(self, *, cpus: int | None = None, mem_available: float | None = None) -> None:
        """Raise EmulationError unless this topology can be emulated on this machine."""
        cpus = cpus or os.cpu_count() or 1
        mem_available = _mem_available() if mem_available is None else mem_available
        if self.nodes > MAX_NODES:
            raise EmulationError(f"{self.name}: {self.nodes} nodes do not fit the emulator (at most {MAX_NODES} "
                                 f"node namespaces)")
        if self.groups > MAX_GROUPS:
            raise EmulationError(f"{self.name}: {self.groups} node groups do not fit the emulator (at most "
                                 f"{MAX_GROUPS})")
        if self.nodes_per_group > 250:
            raise EmulationError(f"{self.name}: {self.nodes_per_group} nodes per group exceed the /24 per group "
                                 f"the emulator addresses (at most 250)")
        if self.world_size > RANKS_PER_CORE * cpus:
            raise EmulationError(f"{self.name}: {self.world_size} ranks do not fit this machine's {cpus} CPU "
                                 f"core(s) (at most {RANKS_PER_CORE} per core, {RANKS_PER_CORE * cpus}); use fewer "
                                 f"'nodes' or 'gpus_per_node'")
        need = self.world_size * self.memory_per_rank
        if mem_available and need > mem_available:
            raise EmulationError(f"{self.name}: {self.world_size} ranks x gpu_memory {self.memory_per_rank / 1e9:.3g} "
                                 f"GB = {need / 1e9:.3g} GB do not fit the {mem_available / 1e9:.3g} GB of memory "
                                 f"available; lower 'gpu_memory' (memory per rank) or the number of ranks")
        for tier, rate in (("inter_node", self.inter_node_bps), ("inter_group", self.inter_group_bps)):
            if rate is None:
                continue
            if rate > MAX_SHAPED_BPS:
                raise EmulationError(f"{self.name}: bandwidth.{tier} {_rate(rate)} is more than this machine's "
                                     f"veths carry (at most {_rate(MAX_SHAPED_BPS)} can be emulated)")
            if rate < MIN_SHAPED_BPS:
                raise EmulationError(f"{self.name}: bandwidth.{tier} {_rate(rate)} is below "
                                     f"{_rate(MIN_SHAPED_BPS)}, too slow to emulate a training run")


def _rate(bps: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.4g} {unit}"
    return f"{bps:g} bit/s"


def _mem_available() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 0.0


def load_topology(path: str | os.PathLike) -> EmuTopology:
    """Read a cluster YAML with the planner's loader and turn it into an emulated topology (validated, fit-checked)."""
    from flwr_sharded.perf.planner import load_cluster

    topo = EmuTopology.from_cluster(load_cluster(path))
    topo.check_fits()
    return topo


# ---------------------------------------------------------------------------------------------------------------------
# Preconditions and the isolated re-execution.


def check_host(tools: Sequence[str] = tuple(TOOLS)) -> dict[str, str]:
    """Raise EmulationError unless we are root and every tool is on PATH; return {tool: path}."""
    if os.geteuid() != 0:
        raise EmulationError("the network emulation needs root (it creates network namespaces, bridges and tc "
                             f"qdiscs inside `unshare --net`); running as uid {os.geteuid()}: rerun with sudo")
    found, missing = {}, []
    for tool in tools:
        path = shutil.which(tool)
        if path is None:
            missing.append(f"`{tool}` (package {TOOLS.get(tool, tool)})")
        else:
            found[tool] = path
    if missing:
        raise EmulationError(f"the network emulation needs {', '.join(missing)}, not found on PATH "
                             f"({os.environ.get('PATH', '')})")
    if not Path("/proc/self/ns/net").exists():
        raise EmulationError("this kernel has no network namespaces (/proc/self/ns/net is missing)")
    return found


def inside() -> bool:
    """True in the runner that `run_isolated` started (private network, mount and pid namespaces)."""
    return bool(os.environ.get(INSIDE_ENV)) and os.getpid() == 1


def run_isolated(argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float | None = None,
                 capture: bool = False) -> subprocess.CompletedProcess:
    """Run `argv` as pid 1 of fresh network, mount and pid namespaces (needs root; see `check_host`).

    The command sees `inside()` true and should call `enter_private_run()` first. When it exits, or this process is
    killed, the kernel tears down everything made inside. Returns the completed process (output captured if
    `capture`); a timeout kills it and raises TimeoutError.
    """
    tools = check_host()
    cmd = [tools["unshare"], "--net", "--mount", "--pid", "--fork", "--kill-child", "--", *argv]
    full_env = {**os.environ, **(env or {}), INSIDE_ENV: str(os.getpid())}
    # `unshare` dies with this process (PR_SET_PDEATHSIG) and takes pid 1 of the namespaces with it (--kill-child):
    # the kernel then kills every process inside and frees the namespaces.
    proc = subprocess.Popen(cmd, env=full_env, start_new_session=True, text=True, preexec_fn=_die_with_parent,
                            stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        raise TimeoutError(f"the emulated run did not finish within {timeout} s and was killed"
                           + (f"\n{(err or '')[-3000:]}" if capture else ""))
    except BaseException:
        _kill_group(proc)
        proc.wait()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


_libc = None


def _mount(source: str, target: str, fstype: str, flags: int = 0, data: str = "") -> None:
    """mount(2) directly: the `mount` command would create /run/mount (libmount's utab) on the host first."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.mount(source.encode(), target.encode(), fstype.encode(), ctypes.c_ulong(flags),
                   data.encode() if data else None) != 0:
        err = ctypes.get_errno()
        raise EmulationError(f"mount {fstype} on {target} failed: {os.strerror(err)}")


MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8


def enter_private_run() -> None:
    """In the isolated runner: a private tmpfs on /run (for `ip netns`) and a /proc of the new pid namespace."""
    if not inside():
        raise EmulationError("enter_private_run() must run inside run_isolated() (pid 1 of a new pid namespace)")
    _mount("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=755")
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    # pid 1 ignores signals it has no handler for: turn SIGTERM into an exception so `finally` blocks run.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGHUP, _raise_interrupt)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def host_leftovers() -> dict[str, list[str]]:
    """What an emulation could leave on the host if isolation failed: its namespaces, interfaces and processes."""
    out: dict[str, list[str]] = {"netns": [], "links": [], "processes": []}
    netns_dir = Path("/run/netns")
    if netns_dir.is_dir():
        out["netns"] = sorted(p.name for p in netns_dir.iterdir() if p.name.startswith("fsn"))
    try:
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        links = ""
    for line in links.splitlines():
        parts = line.split(":")
        name = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        if name.startswith(("fbg", "fbtop")) or (name[:2] in ("vn", "up", "dn") and name[2:].isdigit()):
            out["links"].append(name)
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if INSIDE_ENV.encode() in environ or b"FLWR_SHARDED_NETEMU_RANK=" in environ:
            out["processes"].append(proc.name)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The fabric, inside the runner.


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
                                  + _tail(log_dir / f"rank{rank}.err"))
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

    # ----- counters ---------------------------------------------------------------------------------------------
    def counters(self) -> dict[str, dict[str, dict[str, int]]]:
        """Interface counters: {"fabric": {...}, "node<k>": {...}} from `ip -s -j link`."""
        out = {"fabric": _ip_stats([])}
        for k in range(self.topology.nodes):
            out[f"node{k}"] = _ip_stats(["-n", self.topology.netns(k)])
        return out


_REACH = ("import socket, sys\n"
          "s = socket.socket(); s.settimeout(0.5)\n"
          "try:\n    s.connect((sys.argv[1], 9))\nexcept ConnectionRefusedError:\n    sys.exit(0)\n"
          "except OSError:\n    sys.exit(1)\n")
"""Reachability probe without ping: a refused TCP connection means the peer answered."""


def _ip_stats(prefix: list[str]) -> dict[str, dict[str, int]]:
    result = subprocess.run(["ip", *prefix, "-s", "-j", "link", "show"], capture_output=True, text=True)
    out = {}
    for link in json.loads(result.stdout or "[]"):
        stats = link.get("stats64") or link.get("stats") or {}
        out[link["ifname"]] = {"tx_bytes": stats.get("tx", {}).get("bytes", 0),
                               "rx_bytes": stats.get("rx", {}).get("bytes", 0)}
    return out


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        text = path.read_text()
    except OSError:
        return ""
    return f"\n--- end of {path.name} ---\n{text[-chars:]}" if text.strip() else ""


def _die_with_parent() -> None:
    """preexec: SIGKILL this process when the runner dies (PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    except Exception:  # noqa: BLE001 - best effort; the pid namespace kills it anyway
        pass


# ---------------------------------------------------------------------------------------------------------------------
# A throughput probe (used by the tests and `bench exec --check`).

_THROUGHPUT = r"""
import socket, sys, time
mode, host, port, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if mode == "recv":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((host, port)); s.listen(1)
    print("ready", flush=True)
    c, _ = s.accept(); got = 0
    while True:
        b = c.recv(1 << 20)
        if not b:
            break
        got += len(b)
    c.sendall(b"k"); print(got, flush=True)
else:
    for _ in range(100):
        try:
            c = socket.create_connection((host, port)); break
        except OSError:
            time.sleep(0.05)
    buf = b"x" * (1 << 16); sent = 0; t = time.perf_counter()
    while sent < n:
        c.sendall(buf[: min(len(buf), n - sent)]); sent += min(len(buf), n - sent)
    c.shutdown(socket.SHUT_WR); c.recv(1)
    print(time.perf_counter() - t, flush=True)
"""


def measure_transfer(fabric: Fabric, src_node: int, dst_node: int, nbytes: int, port: int = 5201) -> float:
    """Seconds to send `nbytes` over TCP from one node to another through the emulated links."""
    t = fabric.topology
    recv = fabric.spawn(dst_node, [sys.executable, "-c", _THROUGHPUT, "recv", t.node_ip(dst_node), str(port),
                                   str(nbytes)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        recv.stdout.readline()  # "ready"
        send = fabric.spawn(src_node, [sys.executable, "-c", _THROUGHPUT, "send", t.node_ip(dst_node), str(port),
                                       str(nbytes)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = send.communicate(timeout=max(60.0, nbytes * 8 / 1e6))
        if send.returncode != 0:
            raise EmulationError(f"transfer node {src_node} -> {dst_node} failed: {err.decode()[-500:]}")
        return float(out.decode().strip().splitlines()[-1])
    finally:
        fabric.kill_all()


def topology_dict(t: EmuTopology) -> dict[str, Any]:
    out = asdict(t)
    out["groups"] = t.groups
    out["world_size"] = t.world_size
    return out
