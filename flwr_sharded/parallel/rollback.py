"""The rollback point of a rank's federated state: what a failed sync (or catch-up) restores.

One object owns the "last adopted sync" of every sync fragment: this rank's local shards and the inner optimizer's
state of their parameters (on the host, pinned on CUDA machines), the fragment's outer state (the global shards, the
outer rule's state and error-feedback residuals, when the sync keeps them), and the trainer's step and learning-rate
schedule. `commit(i)` after fragment i's sync is adopted (`commit()`: all of them), `restore()` when a sync fails on
any member: every fragment goes back to its last commit, and the step and schedule to those of the newest commit (the
local steps since are undone; the data stream goes on with fresh batches). `restore_optimizer(i)` puts back only the
optimizer state: a member left out of a sync for non-finite values adopts the others' mean, and its moments, which
may hold the same NaN, are those of the last commit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from flwr_sharded.parallel.sync import ShardSync, local_shard

if TYPE_CHECKING:
    from flwr_sharded.training.trainer import Trainer


class RollbackPoint:
    """A trainer's shards, optimizer state and outer state, fragment by fragment, and its step and schedule, as of
    their last `commit`."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        shard_sync = trainer.shard_sync
        parts: list[tuple[list[torch.Tensor], ShardSync | None]] = (
            [(list(trainer.model.parameters()), None)] if shard_sync is None else
            [(sync.params, sync) for sync in shard_sync.fragments])
        self._pin = torch.cuda.is_available()
        self._parts = [(params, sync, [self._host_like(local_shard(p)) for p in params]) for params, sync in parts]
        self._outer: list[dict[str, Any] | None] = [None] * len(parts)
        self._moments: list[list[dict[str, Any] | None]] = [[None] * len(params) for params, _ in parts]
        """Per fragment and parameter: its optimizer state at the commit (tensors: this rank's local values on the
        host), or None where the optimizer had none yet."""
        self._clock: dict[str, Any] = {}

    def _host_like(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self._pin)

    @torch.no_grad()
    def commit(self, fragment: int | None = None) -> None:
        """Make the current shards, optimizer and outer state (of one fragment, or all) and the current step and
        schedule the ones `restore()` returns to."""
        t = self.trainer
        for i, (params, sync, saved) in enumerate(self._parts):
            if fragment is not None and i != fragment:
                continue
            for j, (param, copy) in enumerate(zip(params, saved)):
                copy.copy_(local_shard(param))
                self._moments[i][j] = self._save_state(t.optimizer.state.get(param), self._moments[i][j])
            if sync is not None and sync.keeps_global and sync.has_outer_state:
                self._outer[i] = _to(sync.outer_state_dict(), "cpu")
        self._clock = {"step": t.step_count, "scheduler": t.scheduler.state_dict()}

    @torch.no_grad()
    def restore(self) -> None:
        """Put back every fragment's shards, optimizer and outer state of its last commit, and the step and
        learning-rate schedule of the newest commit."""
        t = self.trainer
        for i, ((params, sync, saved), outer) in enumerate(zip(self._parts, self._outer)):
            for param, copy in zip(params, saved):
                local_shard(param).copy_(copy)
            self.restore_optimizer(i)
            if outer is not None and sync is not None:
                sync.load_outer_state_dict(_to(outer, local_shard(params[0]).device))
        if self._clock:
            t.step_count = self._clock["step"]
            t.scheduler.load_state_dict(self._clock["scheduler"])
            for group, lr in zip(t.optimizer.param_groups, t.scheduler.get_last_lr()):
                group["lr"] = lr

    @torch.no_grad()
    def restore_optimizer(self, fragment: int) -> None:
        """Put back the inner optimizer's state of fragment `fragment`'s parameters as of its last commit."""
        state = self.trainer.optimizer.state
        params, _, _ = self._parts[fragment]
        for param, saved in zip(params, self._moments[fragment]):
            if saved is None:
                state.pop(param, None)  # the optimizer had no state then: it starts afresh at the next step
                continue
            current = state.setdefault(param, {})
            for key, value in saved.items():
                if not isinstance(value, torch.Tensor):
                    current[key] = value
                elif value.dim() == 0:
                    current[key] = value.to(current[key].device if key in current else "cpu", copy=True)
                else:
                    if key not in current:
                        current[key] = torch.empty_like(param, dtype=value.dtype)
                    local_shard(current[key]).copy_(value)

    def _save_state(self, state: dict[str, Any] | None, previous: dict[str, Any] | None) -> dict[str, Any] | None:
        """A host copy of one parameter's optimizer state, reusing `previous`'s buffers where they fit."""
        if not state:
            return None
        out: dict[str, Any] = {}
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                out[key] = value
                continue
            local = local_shard(value)
            if local.dim() == 0:
                out[key] = local.detach().to("cpu", copy=True)
                continue
            old = (previous or {}).get(key)
            fits = isinstance(old, torch.Tensor) and old.shape == local.shape and old.dtype == local.dtype
            buffer = old if fits else self._host_like(local)
            buffer.copy_(local)
            out[key] = buffer
        return out


def _to(state: Any, device: torch.device | str) -> Any:
    """A copy of a nested outer state with every tensor on `device`."""
    if isinstance(state, torch.Tensor):
        return state.to(device, copy=True)
    if isinstance(state, dict):
        return {k: _to(v, device) for k, v in state.items()}
    if isinstance(state, list):
        return [_to(v, device) for v in state]
    return state
