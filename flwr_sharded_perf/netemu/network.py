"""The emulated network: what gets built from a cluster description (`EmuTopology`), and the network and its ranks
inside the isolated runner (`Fabric`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from flwr_sharded_perf.netemu.isolation import RANK_ENV, EmulationError, _die_with_parent, in_isolated_runner
from flwr_sharded.parallel.traffic import NETDEV_ENV

SUBNET = "10.77"
MAX_SHAPED_BPS = 5e9
"""Highest tbf rate accepted: unshaped veths between namespaces reach about 7 Gbit/s on this kind of machine."""
MIN_SHAPED_BPS = 1e6
MAX_NODES = 64
MAX_GROUPS = 32
RANKS_PER_CORE = 8
"""At most this many ranks per CPU core: beyond it a run measures the scheduler, not the network."""


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
        shaped = [f"{what} {_rate(bps)}" for what, bps in (("node links", self.inter_node_bps),
                                                            ("group uplinks", self.inter_group_bps)) if bps]
        return (f"{self.name}: {self.groups} group(s) x {self.nodes_per_group} node(s) x {self.ranks_per_node} rank(s) "
                f"= {self.world_size} ranks; {', '.join(shaped) or 'no shaping'}; intra-node: loopback")

    @classmethod
    def from_cluster(cls, cluster: Any) -> EmuTopology:
        """From a planner `Cluster` (see `flwr_sharded_perf.cluster.load_cluster`)."""
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
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return 0.0
    return next((float(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:")), 0.0)


def load_topology(path: str | os.PathLike) -> EmuTopology:
    """Read a cluster YAML with the planner's loader and turn it into an emulated topology (validated, fit-checked)."""
    from flwr_sharded_perf.cluster import load_cluster

    topo = EmuTopology.from_cluster(load_cluster(path))
    topo.check_fits()
    return topo


def topology_dict(t: EmuTopology) -> dict[str, Any]:
    out = asdict(t)
    out["groups"] = t.groups
    out["world_size"] = t.world_size
    return out


NODE_IFACE = "eth0"


def _tbf(dev: str, bps: float, netns: str | None = None) -> list[str]:
    """tc adding a tbf root qdisc: 100 ms of queue, a burst of 2 ms of traffic, at least 96 KiB (a GSO packet's)."""
    burst = max(96 * 1024, int(bps / 8 * 0.002))
    return ["tc", *(["-n", netns] if netns else []), "qdisc", "add", "dev", dev, "root", "tbf", "rate",
            f"{int(bps)}bit", "burst", str(burst), "latency", "100ms"]


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
        if not in_isolated_runner():
            raise EmulationError("Fabric must be built inside run_isolated() (private namespaces); see "
                                 "flwr_sharded_perf.netemu")
        try:
            self.build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def _run(self, *cmd: str) -> None:
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            message = result.stderr.strip()
            hint = ""
            if "tbf" in cmd and ("unknown" in message.lower() or "not supported" in message.lower()):
                hint = " (this kernel lacks the tbf qdisc, sch_tbf)"
            raise EmulationError(f"`{' '.join(cmd)}` failed: {message}{hint}")

    def _veth(self, name: str, peer: str, *peer_args: str) -> None:
        self._run("ip", "link", "add", name, "mtu", str(self.mtu), "type", "veth", "peer", "name", peer, "mtu",
                  str(self.mtu), *peer_args)

    def build(self) -> None:
        t = self.topology
        self._run("ip", "link", "set", "lo", "up")
        if t.groups > 1:
            self._run("ip", "link", "add", "fbtop", "type", "bridge")
            self._run("ip", "link", "set", "fbtop", "up")
        for g in range(t.groups):
            self._run("ip", "link", "add", f"fbg{g}", "type", "bridge")
            self._run("ip", "link", "set", f"fbg{g}", "mtu", str(self.mtu), "up")
            if t.groups > 1:
                self._veth(f"up{g}", f"dn{g}")
                self._run("ip", "link", "set", f"up{g}", "master", f"fbg{g}", "up")
                self._run("ip", "link", "set", f"dn{g}", "master", "fbtop", "up")
                for dev in ((f"up{g}", f"dn{g}") if t.inter_group_bps else ()):
                    self._run(*_tbf(dev, t.inter_group_bps))
        for k in range(t.nodes):
            ns = t.netns(k)
            self._run("ip", "netns", "add", ns)
            self.built.append(ns)
            self._veth(f"vn{k}", NODE_IFACE, "netns", ns)
            self._run("ip", "link", "set", f"vn{k}", "master", f"fbg{t.group_of_node(k)}", "up")
            self._run("ip", "-n", ns, "link", "set", "lo", "up")
            self._run("ip", "-n", ns, "addr", "add", f"{t.node_ip(k)}/16", "dev", NODE_IFACE)
            self._run("ip", "-n", ns, "link", "set", NODE_IFACE, "up")
            if t.inter_node_bps:
                self._run(*_tbf(f"vn{k}", t.inter_node_bps))
                self._run(*_tbf(NODE_IFACE, t.inter_node_bps, netns=ns))
        self._wait_bridges()

    def _wait_bridges(self, timeout: float = 10.0) -> None:
        """Bridge ports start in the listening state for a moment; wait until node 0 reaches every node."""
        t = self.topology
        deadline = time.monotonic() + timeout
        for k in range(1, t.nodes):
            while subprocess.run(["ip", "netns", "exec", t.netns(0), sys.executable, "-c", _REACH, t.node_ip(k)],
                                 capture_output=True).returncode != 0:
                if time.monotonic() > deadline:
                    raise EmulationError(f"node 0 cannot reach node {k} ({t.node_ip(k)}) through the emulated "
                                         f"bridges after {timeout} s")
                time.sleep(0.1)

    def set_uplink(self, group: int, up: bool) -> None:
        """Cut (`up=False`) or restore group `group`'s uplink: while it is down every packet between that group's
        nodes and the others' is lost and nothing is told to either side, as when a site's link fails; their
        connections stay open."""
        if self.topology.groups < 2 or not 0 <= group < self.topology.groups:
            raise EmulationError(f"{self.topology.describe()} has no uplink of group {group}")
        self._run("ip", "link", "set", f"up{group}", "up" if up else "down")

    def teardown(self) -> None:
        """Kill launched processes and delete namespaces and bridges (the kernel would do it at exit anyway)."""
        self.kill_all()
        links = [f"{name}{g}" for g in range(self.topology.groups) for name in ("fbg", "up")] + ["fbtop"]
        for cmd in [["netns", "del", ns] for ns in reversed(self.built)] + [["link", "del", x] for x in links]:
            subprocess.run(["ip", *cmd], capture_output=True)
        self.built.clear()

    def spawn(self, node: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              stdout: Any = None, stderr: Any = None) -> subprocess.Popen:
        """Start `argv` in node `node`'s namespace, in its own session, killed with its parent."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.topology.netns(node), *argv],
                                env={**os.environ, **(env or {})}, stdout=stdout, stderr=stderr,
                                start_new_session=True, preexec_fn=_die_with_parent)
        self._procs.append(proc)
        return proc

    def kill_all(self) -> None:
        for proc in (p for p in self._procs if p.poll() is None):
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
        return {"RANK": str(rank), "WORLD_SIZE": str(world or t.world_size), "LOCAL_RANK": str(rank % t.ranks_per_node),
                "LOCAL_WORLD_SIZE": str(t.ranks_per_node), "GROUP_RANK": str(t.node_of(rank)),
                "MASTER_ADDR": t.node_ip(0), "MASTER_PORT": str(port or self._port),
                "GLOO_SOCKET_IFNAME": NODE_IFACE, "OMP_NUM_THREADS": "1", RANK_ENV: str(rank),
                NETDEV_ENV: f"fabric=/proc/{os.getpid()}/net/dev"}

    def run_ranks(self, argv: Callable[[int], Sequence[str]] | Sequence[str], *, world: int | None = None,
                  env: Mapping[str, str] | None = None, timeout: float = 600.0,
                  log_dir: str | os.PathLike | None = None) -> list[RankResult]:
        """Run one process per rank (on node r // ranks_per_node), output in `log_dir`, and wait for all; a failure or
        the timeout kills every rank and raises RankFailure naming the first failing rank, with its stderr's end."""
        t = self.topology
        world = world or t.world_size
        if world > t.world_size:
            raise EmulationError(f"{world} ranks do not fit {t.describe()}")
        self._port += 1
        tmp = tempfile.TemporaryDirectory(prefix="flwr-netemu-") if log_dir is None else None
        log_dir = Path(tmp.name if tmp else log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        procs: list[tuple[int, subprocess.Popen, Any, Any]] = []
        try:
            for rank in range(world):
                out, err = open(log_dir / f"rank{rank}.out", "w"), open(log_dir / f"rank{rank}.err", "w")
                proc = self.spawn(t.node_of(rank), argv(rank) if callable(argv) else argv, stdout=out, stderr=err,
                                  env={**(env or {}), **self.rank_env(rank, world, self._port)})
                procs.append((rank, proc, out, err))
            deadline = time.monotonic() + timeout
            while True:
                codes = [p.poll() for _, p, _, _ in procs]
                failed = next(((r, c) for (r, *_), c in zip(procs, codes) if c not in (None, 0)), None)
                if failed or all(c == 0 for c in codes) or time.monotonic() > deadline:
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
            for _, _, out, err in procs:
                out.close()
                err.close()
            return [RankResult(rank, proc.returncode, (log_dir / f"rank{rank}.out").read_text(),
                               (log_dir / f"rank{rank}.err").read_text()) for rank, proc, _, _ in procs]
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
