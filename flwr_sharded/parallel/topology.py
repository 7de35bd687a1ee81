"""The F x R x S process mesh: federation, replication and sharding dimensions, from `init_device_mesh`."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from flwr_sharded.errors import ConfigError

MESH_DIMS = ("fed", "rep", "shard")


class MeshLayout(Protocol):
    """What the mesh is built from: the method's name, F, R, S and the backend (`flwr_sharded.config.ParallelConfig`
    is one; it is validated before a mesh is built)."""

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
    own_fed_group: dist.ProcessGroup | None = None
    """The federation group when it spans the world (R = S = 1): a group of its own, not the default group that the
    mesh hands out then, so that an overlapped sync's thread never shares a group with the main thread's
    collectives (the metrics' all-reduces)."""

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


def check_world_size(config: MeshLayout, world_size: int) -> None:
    """ConfigError unless `world_size` processes make the F x R x S mesh."""
    ranks = config.federations * config.replicas * config.shards
    if world_size != ranks:
        raise ConfigError(f"world size {world_size} != F*R*S = {config.federations}*{config.replicas}*"
                          f"{config.shards} = {ranks}; launch {ranks} processes or change federations/replicas/shards")


def init_topology(config: MeshLayout, timeout_s: float = 600.0) -> Topology:
    """Start the default process group (NCCL on GPUs, gloo on CPU) and build the (F, R, S) mesh.

    Expects the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) and a validated layout
    (`flwr_sharded.config.validate_parallel`); checks that the world makes the mesh.
    """
    device = device_type()
    if not dist.is_initialized():
        import os

        check_world_size(config, int(os.environ.get("WORLD_SIZE", "1")))
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        backend = backend_for(device) if config.backend == "auto" else config.backend
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    else:
        check_world_size(config, dist.get_world_size())
    mesh = init_device_mesh(device, (config.federations, config.replicas, config.shards), mesh_dim_names=MESH_DIMS)
    own = None
    if config.federations > 1 and config.replicas * config.shards == 1:  # every rank calls new_group, in this order
        own = dist.new_group(list(range(dist.get_world_size())))
    return Topology(mesh=mesh, config=config, group_mesh=mesh["rep", "shard"]._flatten("group"), own_fed_group=own)
