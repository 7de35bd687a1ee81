"""The rollback point of a rank's federated state: what a failed sync (or catch-up) restores.

One object owns the "last adopted sync" of every sync fragment: this rank's local shards (on the host, pinned on
CUDA machines) and the fragment's outer state (the global shards, the outer rule's state and error-feedback
residuals, when the sync keeps them). `commit(i)` after fragment i's sync is adopted (`commit()`: all of them),
`restore()` when a sync fails on any rank of the group: every fragment goes back to its last commit. The shards in
between are the local steps since.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flwr_sharded.parallel.streaming import FragmentedSync
from flwr_sharded.parallel.sync import ShardSync, local_shard


class RollbackPoint:
    """This rank's shards and outer state, fragment by fragment, as of their last `commit`."""

    def __init__(self, model: nn.Module, shard_sync: FragmentedSync | None) -> None:
        parts: list[tuple[list[torch.Tensor], ShardSync | None]] = (
            [(list(model.parameters()), None)] if shard_sync is None else
            [(sync.params, sync) for sync in shard_sync.fragments])
        pin = torch.cuda.is_available()
        self._parts = [(params, sync, [torch.empty(local_shard(p).shape, dtype=local_shard(p).dtype, device="cpu",
                                                   pin_memory=pin) for p in params]) for params, sync in parts]
        self._outer: list[dict[str, Any] | None] = [None] * len(parts)

    @torch.no_grad()
    def commit(self, fragment: int | None = None) -> None:
        """Make the current shards and outer state (of one fragment, or all) the ones `restore()` returns to."""
        for i, (params, sync, saved) in enumerate(self._parts):
            if fragment is not None and i != fragment:
                continue
            for param, copy in zip(params, saved):
                copy.copy_(local_shard(param))
            if sync is not None and sync.keeps_global and sync.has_outer_state:
                self._outer[i] = _to(sync.outer_state_dict(), "cpu")

    @torch.no_grad()
    def restore(self) -> None:
        """Put back every fragment's shards and outer state of its last commit."""
        for (params, sync, saved), outer in zip(self._parts, self._outer):
            for param, copy in zip(params, saved):
                local_shard(param).copy_(copy)
            if outer is not None and sync is not None:
                sync.load_outer_state_dict(_to(outer, local_shard(params[0]).device))


def _to(state: Any, device: torch.device | str) -> Any:
    """A copy of a nested outer state with every tensor on `device`."""
    if isinstance(state, torch.Tensor):
        return state.to(device, copy=True)
    if isinstance(state, dict):
        return {k: _to(v, device) for k, v in state.items()}
    if isinstance(state, list):
        return [_to(v, device) for v in state]
    return state
