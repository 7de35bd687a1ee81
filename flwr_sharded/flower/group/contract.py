"""What a round's steps (`round`, `channels`, `server_path_shards`) need of the group runtime they run on
(`RoundRuntime`, which `runtime.GroupRuntime` is), and how they refuse an instruction (`InstructionError`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from flwr_sharded.flower.group.options import GroupOptions
    from flwr_sharded.flower.run_config import FlowerRun
    from flwr_sharded.parallel.topology import Topology
    from flwr_sharded.training.sync_loop import SyncLoop


class InstructionError(Exception):
    """An instruction this group refuses, identically on every rank (checked before any collective)."""


class RoundRuntime(Protocol):
    """The group runtime as a round sees it: once a hello built the run, its trainer's sync loop and the run; the
    group's layout and control group; the counters a round adds to."""

    args: GroupOptions
    """The group's own options (its R, S and sync backend)."""
    run: FlowerRun
    """The run of the current trainer (this group's S)."""
    loop: SyncLoop
    """The trainer's sync loop (`loop.trainer`: the trainer)."""
    topo: Topology
    """This rank's place in the group (replica and shard index)."""
    rank: int
    world: int
    ctrl: ProcessGroup
    """The group's gloo control group."""
    pids: list[int]
    """Every rank's process id."""
    handoff_dir: str
    """The group's private hand-off directory (server path)."""
    syncs: int
    """Periods synced since the trainer was built."""
    tokens: int
    """Tokens trained since the trainer was built."""

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, over the control group."""
        ...

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj`, over the control group."""
        ...

    def checksums(self, *, optimizer: bool = False) -> list[float]:
        """Every rank's checksum of its local shards (or of its optimizer state)."""
        ...
