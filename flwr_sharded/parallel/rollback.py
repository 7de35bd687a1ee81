"""The rollback point of a rank's federated state: what a failed sync (or catch-up) restores.

One object owns the "last adopted sync": this rank's local shards (on the host, pinned on CUDA machines) and the
shard sync's outer state (the global shards and the outer rule's state, when the sync keeps them). `commit()` after
every adopted sync, `restore()` when a sync fails on any rank of the group; the shards between are the local steps
since the last commit.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flwr_sharded.parallel.sync import ShardSync, local_shard


class RollbackPoint:
    """This rank's shards and outer state as of the last `commit()`."""

    def __init__(self, model: nn.Module, shard_sync: ShardSync | None) -> None:
        self.params = list(model.parameters())
        self.shard_sync = shard_sync
        pin = torch.cuda.is_available()
        self._shards = [torch.empty(local_shard(p).shape, dtype=local_shard(p).dtype, device="cpu", pin_memory=pin)
                        for p in self.params]
        self._outer: dict[str, Any] | None = None

    @torch.no_grad()
    def commit(self) -> None:
        """Make the current shards and outer state the ones a later `restore()` returns to."""
        for param, saved in zip(self.params, self._shards):
            saved.copy_(local_shard(param))
        sync = self.shard_sync
        if sync is not None and sync.keeps_global and sync.has_outer_state:
            self._outer = _to(sync.outer_state_dict(), "cpu")

    @torch.no_grad()
    def restore(self) -> None:
        """Put back the shards and outer state of the last commit."""
        for param, saved in zip(self.params, self._shards):
            local_shard(param).copy_(saved)
        if self._outer is not None and self.shard_sync is not None:
            device = local_shard(self.params[0]).device
            self.shard_sync.load_outer_state_dict(_to(self._outer, device))


def _to(state: Any, device: torch.device | str) -> Any:
    """A copy of a nested outer state with every tensor on `device`."""
    if isinstance(state, torch.Tensor):
        return state.to(device, copy=True)
    if isinstance(state, dict):
        return {k: _to(v, device) for k, v in state.items()}
    if isinstance(state, list):
        return [_to(v, device) for v in state]
    return state
