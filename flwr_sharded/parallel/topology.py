"""The F x R x S process mesh: federation, replication and sharding dimensions, from `init_device_mesh`; or, when the
groups shard differently (`group-shards`), each group's own R x S_g mesh and the channels its shards are averaged
over (`flwr_sharded.parallel.sync_plan`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from flwr_sharded.errors import ConfigError
from flwr_sharded.parallel.alignment import ShardAlignmentError
from flwr_sharded.parallel.collectives import configure_nccl_watchdog, group_options
from flwr_sharded.parallel.sync_plan import Owners, Seat, SyncPlan, channel_ranks
from flwr_sharded.parallel.torch_compat import device_mesh, flatten

MESH_DIMS = ("fed", "rep", "shard")


class MeshLayout(Protocol):
    """What the mesh is built from: method, F, R, S, backend (a validated `flwr_sharded.config.ParallelConfig`)."""

    method: str
    federations: int
    replicas: int
    shards: int
    backend: str


def device_type() -> str:
    """'cuda' when GPUs are present (NCCL), else 'cpu' (gloo): one code path for both."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def coords(rank: int, replicas: int, shards: int) -> tuple[int, int, int]:
    """Rank -> (f, r, s) for the row-major (F, R, S) mesh with shard innermost."""
    return rank // (replicas * shards), (rank // shards) % replicas, rank % shards


@dataclass
class Topology:
    """This rank's place in the (fed, rep, shard) mesh and the process groups it needs."""

    mesh: DeviceMesh
    """The 3-D mesh with dims ("fed", "rep", "shard")."""
    config: MeshLayout
    """The layout the mesh was built from."""
    group_mesh: DeviceMesh
    """All ranks of this federation group as one flattened dimension (group-wide reductions, checkpoints)."""
    timeout: timedelta
    """Every process group's timeout (the run's `--timeout`): a group made later (`new_group`) takes it too."""
    own_fed_group: dist.ProcessGroup | None = None
    """The federation group when it spans the world (R = S = 1), as a group of its own rather than the mesh's default
    group: an overlapped sync's thread must not share a group with the main thread's collectives (the metrics')."""

    @property
    def fed_index(self) -> int:
        return self.mesh.get_local_rank("fed")

    @property
    def replica_index(self) -> int:
        return self.mesh.get_local_rank("rep")

    @property
    def shard_index(self) -> int:
        return self.mesh.get_local_rank("shard")

    @property
    def group_world(self) -> int:
        """Ranks in one federation group (R * S)."""
        return self.config.replicas * self.config.shards

    @property
    def group_rank(self) -> int:
        """This rank's index inside its federation group."""
        return self.replica_index * self.config.shards + self.shard_index

    @property
    def dp_index(self) -> int:
        """Global data-parallel index f*R*S + r*S + s (equal to the global rank)."""
        return self.fed_index * self.group_world + self.group_rank

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 shards on: ("rep", "shard") for HSDP, ("shard",) otherwise."""
        if self.config.replicas > 1:
            return self.mesh["rep", "shard"]
        return self.mesh["shard"]

    @property
    def group_pg(self) -> dist.ProcessGroup:
        """Process group of all ranks of this federation group."""
        return self.group_mesh.get_group()

    @property
    def fed_group(self) -> dist.ProcessGroup | None:
        """Ranks holding the same (r, s) in every federation group; None when F == 1."""
        if self.config.federations == 1:
            return None
        return self.own_fed_group or self.mesh.get_group("fed")

    @property
    def rep_group(self) -> dist.ProcessGroup | None:
        """Ranks holding the same (f, s) in every replica; None when R == 1."""
        return self.mesh.get_group("rep") if self.config.replicas > 1 else None

    def describe(self) -> str:
        p = self.config
        ranks = p.federations * self.group_world
        return f"{p.method}: F={p.federations} x R={p.replicas} x S={p.shards} = {ranks} ranks"

    # ----- what the federation's code asks of either kind of topology ----------------------------------------
    seat: Seat | None = None
    """Where this rank sits among groups that shard differently; None here (every group shards alike)."""

    @property
    def group_worlds(self) -> list[int]:
        """Every federation group's ranks."""
        return [self.group_world] * self.config.federations

    def group_ranks(self, f: int) -> list[int]:
        """The global ranks of federation group f."""
        return list(range(f * self.group_world, (f + 1) * self.group_world))

    def sync_groups(self, shapes: Sequence[tuple[int, ...]]) -> dist.ProcessGroup | None:
        """The process group(s) a shard sync of parameters of these global shapes runs over (collective over the
        world: call it on every rank): the mesh's "fed" group."""
        return self.fed_group

    @property
    def leaders(self) -> dist.ProcessGroup | None:
        """A group of one rank per federation group (its vote of a commit); None: each shard index votes."""
        return None


def check_world_size(config: MeshLayout, world_size: int) -> None:
    """ConfigError unless `world_size` processes make the F x R x S mesh."""
    ranks = config.federations * config.replicas * config.shards
    if world_size != ranks:
        raise ConfigError(f"world size {world_size} != F*R*S = {config.federations}*{config.replicas}*"
                          f"{config.shards} = {ranks}; launch {ranks} processes or change federations/replicas/shards")


def _start_world(config: MeshLayout, ranks: int, timeout: timedelta, recoverable: bool) -> str:
    """Start the default process group unless running (NCCL's process-wide variables set first:
    `configure_nccl_watchdog`); ConfigError unless it has `ranks` processes; the device type."""
    device = device_type()
    if not dist.is_initialized():
        size = int(os.environ.get("WORLD_SIZE", "1"))
        if size != ranks:
            raise ConfigError(f"world size {size} != the layout's {ranks} ranks; launch {ranks} processes or change "
                              f"federations/replicas/shards/group-shards")
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        backend = backend_for(device) if config.backend == "auto" else config.backend
        configure_nccl_watchdog(timeout, recoverable=recoverable)
        dist.init_process_group(backend, timeout=timeout)
    elif dist.get_world_size() != ranks:
        raise ConfigError(f"world size {dist.get_world_size()} != {ranks} ranks of the layout")
    return device


def init_topology(config: MeshLayout, timeout_s: float = 600.0, *,
                  recoverable: bool = False) -> Topology | GroupsTopology:
    """Start the default process group (NCCL on GPUs, gloo on CPU) and build the (F, R, S) mesh, or each group's mesh
    when they shard differently (`init_groups_topology`); every group they make has the timeout `timeout_s`.
    `recoverable`: a failed NCCL collective must raise rather than end the process (a Flower group, whose
    federation groups are rebuilt every round). Expects the torchrun environment and a validated layout
    (`flwr_sharded.validation.validate_parallel`); checks that the world makes the mesh."""
    timeout = timedelta(seconds=timeout_s)
    layouts = tuple(getattr(config, "layouts", ()) or (config.shards,) * config.federations)
    if len(set(layouts)) > 1:
        return init_groups_topology(config, layouts, timeout_s, recoverable=recoverable)
    check_world_size(config, dist.get_world_size() if dist.is_initialized() else
                     int(os.environ.get("WORLD_SIZE", "1")))
    device = _start_world(config, config.federations * config.replicas * config.shards, timeout, recoverable)
    backend = dist.get_backend()  # the world's, whatever `config.backend` said; options of its own for each dimension
    mesh = device_mesh(device, (config.federations, config.replicas, config.shards), MESH_DIMS,
                       group_options(backend, timeout))
    own = None
    if config.federations > 1 and config.replicas * config.shards == 1:  # every rank calls new_group, in this order
        own = dist.new_group(list(range(dist.get_world_size())), timeout=timeout)
    group_mesh = flatten(mesh["rep", "shard"], "group", group_options(backend, timeout))
    return Topology(mesh=mesh, config=config, group_mesh=group_mesh, timeout=timeout, own_fed_group=own)


@dataclass
class GroupsTopology:
    """This rank's place in a federation of groups that shard differently (S_g per group, R for all): its group's
    own (rep, shard) mesh, and the channels its shards are averaged over, one process group each."""

    mesh: DeviceMesh
    """This group's mesh: ("rep", "shard") for R > 1, else ("shard",)."""
    config: MeshLayout
    layouts: tuple[int, ...]
    """Every group's S, in member order."""
    fed_index: int
    group_pg: dist.ProcessGroup
    """All ranks of this federation group."""
    leaders: dist.ProcessGroup
    """Rank 0 of every group (the members' commit vote)."""
    timeout: timedelta
    """Every process group's timeout (the run's `--timeout`), the channels' too."""
    channels: dict[Owners, dist.ProcessGroup] = field(default_factory=dict)
    """The channels' process groups made so far (`sync_groups`)."""

    @property
    def replicas(self) -> int:
        return self.config.replicas

    @property
    def replica_index(self) -> int:
        return self.mesh.get_local_rank("rep") if self.replicas > 1 else 0

    @property
    def shard_index(self) -> int:
        return self.mesh.get_local_rank("shard")

    @property
    def group_world(self) -> int:
        return self.replicas * self.layouts[self.fed_index]

    @property
    def group_worlds(self) -> list[int]:
        return [self.replicas * s for s in self.layouts]

    @property
    def group_rank(self) -> int:
        return self.replica_index * self.layouts[self.fed_index] + self.shard_index

    def base(self, f: int) -> int:
        """Group f's first global rank."""
        return sum(self.group_worlds[:f])

    def group_ranks(self, f: int) -> list[int]:
        return list(range(self.base(f), self.base(f) + self.group_worlds[f]))

    @property
    def dp_index(self) -> int:
        return self.base(self.fed_index) + self.group_rank

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        return self.mesh

    @property
    def rep_group(self) -> dist.ProcessGroup | None:
        return self.mesh.get_group("rep") if self.replicas > 1 else None

    @property
    def fed_group(self) -> None:
        """No one group holds a shard index of every group: the sync runs over channels (`sync_groups`)."""
        return None

    @property
    def seat(self) -> Seat:
        return Seat(self.layouts, self.fed_index, self.shard_index)

    def sync_groups(self, shapes: Sequence[tuple[int, ...]]) -> dict[Owners, dist.ProcessGroup]:
        """Every channel's process group for parameters of these global shapes (replica 0 of each owner), made on
        every rank in the plan's order (collective over the world: call it on every rank)."""
        shapes = [tuple(int(d) for d in shape) for shape in shapes]
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (self.fed_index, shapes))  # before any group: a mismatch would hang them
        for f, theirs in everyone:
            if theirs != shapes:
                first = next((i for i, (a, b) in enumerate(zip(shapes, theirs)) if a != b), min(len(shapes),
                                                                                              len(theirs)))
                mine = shapes[first] if first < len(shapes) else "none"
                other = theirs[first] if first < len(theirs) else "none"
                raise ShardAlignmentError(
                    f"federation groups {self.fed_index} and {f} build different models: parameter #{first} has "
                    f"shape {mine} in group {self.fed_index} and {other} in group {f} ({len(shapes)} and "
                    f"{len(theirs)} parameters); every group must train the same model")
        bases = [self.base(f) for f in range(len(self.layouts))]
        for owners in SyncPlan(self.layouts, tuple(shapes)).channels():
            if owners not in self.channels:
                self.channels[owners] = dist.new_group(channel_ranks(owners, bases), timeout=self.timeout)
        return self.channels

    def describe(self) -> str:
        sizes = ", ".join(f"S={s}" for s in self.layouts)
        return (f"{self.config.method}: {len(self.layouts)} groups of R={self.replicas} x ({sizes}) = "
                f"{sum(self.group_worlds)} ranks")


def init_groups_topology(config: MeshLayout, layouts: tuple[int, ...], timeout_s: float = 600.0, *,
                         recoverable: bool = False) -> GroupsTopology:
    """Start the world of R x sum(S_g) ranks, group after group, and build this rank's group mesh; every rank makes
    every group's process groups, in the same order, each with the timeout `timeout_s`."""
    R = config.replicas
    timeout = timedelta(seconds=timeout_s)
    device = _start_world(config, R * sum(layouts), timeout, recoverable)
    rank = dist.get_rank()
    bases = [R * sum(layouts[:f]) for f in range(len(layouts))]
    fed = max(f for f, base in enumerate(bases) if base <= rank)
    r, s = divmod(rank - bases[fed], layouts[fed])
    own: dict[str, object] = {}
    for f, S in enumerate(layouts):
        grid = torch.arange(bases[f], bases[f] + R * S).view(R, S)
        whole = dist.new_group(grid.flatten().tolist(), timeout=timeout)
        reps = [dist.new_group(grid[:, j].tolist(), timeout=timeout) for j in range(S)] if R > 1 else []
        shards = [dist.new_group(grid[i].tolist(), timeout=timeout) for i in range(R)]
        if f == fed:
            own = {"grid": grid, "whole": whole, "rep": reps[s] if reps else None, "shard": shards[r]}
    leaders = dist.new_group(bases, timeout=timeout)
    if R > 1:
        mesh = DeviceMesh.from_group([own["rep"], own["shard"]], device, mesh=own["grid"],
                                     mesh_dim_names=("rep", "shard"))
    else:
        mesh = DeviceMesh.from_group(own["shard"], device, mesh=own["grid"][0], mesh_dim_names=("shard",))
    return GroupsTopology(mesh=mesh, config=config, layouts=layouts, fed_index=fed, group_pg=own["whole"],
                          leaders=leaders, timeout=timeout)
