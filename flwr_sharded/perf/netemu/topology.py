"""What an emulated cluster is: groups x nodes x ranks and the tbf rates of its shaped tiers, from a cluster YAML,
checked against what this machine can emulate."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from flwr_sharded.errors import ConfigError

SUBNET = "10.77"
MAX_SHAPED_BPS = 5e9
"""Highest tbf rate accepted: unshaped veths between namespaces reach about 7 Gbit/s on this kind of machine."""
MIN_SHAPED_BPS = 1e6
MAX_NODES = 64
MAX_GROUPS = 32
RANKS_PER_CORE = 8
"""At most this many ranks per CPU core: beyond it a run measures the scheduler, not the network."""


class EmulationError(ConfigError):
    """The emulated cluster cannot be built or run here; the message names the problem."""


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
        """From a planner `Cluster` (see `flwr_sharded.perf.cluster.load_cluster`)."""
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
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 0.0


def load_topology(path: str | os.PathLike) -> EmuTopology:
    """Read a cluster YAML with the planner's loader and turn it into an emulated topology (validated, fit-checked)."""
    from flwr_sharded.perf.cluster import load_cluster

    topo = EmuTopology.from_cluster(load_cluster(path))
    topo.check_fits()
    return topo


def topology_dict(t: EmuTopology) -> dict[str, Any]:
    out = asdict(t)
    out["groups"] = t.groups
    out["world_size"] = t.world_size
    return out
