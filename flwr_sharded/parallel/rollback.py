"""The rollback point of a rank's federated state: what a failed sync (or catch-up) restores.

Per sync fragment, as of its last `commit`: this rank's local shards and the inner optimizer's state of them (on the
host, pinned on CUDA machines) and the outer state (global shards, the rule's state, error-feedback residuals, when
the sync keeps them); and the trainer's clock (step and schedule, through callables: nothing here knows the trainer).
`restore()` puts every fragment back and the clock to the newest commit (the local steps since are undone; the data
stream goes on with fresh batches). `restore_optimizer(i)` serves a member left out for non-finite values: it adopts
the others' mean, and its moments, which may hold the same NaN, go back to the last commit.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from flwr_sharded.parallel.alignment import local_shard
from flwr_sharded.parallel.global_state import GlobalState


class RollbackPoint:
    """Each fragment's shards, optimizer and outer state, and the clock, as of their last `commit`.

    Args:
        parts: per sync fragment, its parameters and its sync's global state (None: parameters without one).
        optimizer: the inner optimizer whose state of those parameters is kept.
        clock: returns the trainer's step and learning-rate schedule (a state dict), taken at each commit.
        set_clock: puts such a state back.
    """

    def __init__(self, parts: Sequence[tuple[Sequence[torch.Tensor], GlobalState | None]],
                 optimizer: torch.optim.Optimizer, *, clock: Callable[[], dict[str, Any]],
                 set_clock: Callable[[dict[str, Any]], None]) -> None:
        self.optimizer, self._clock_of, self._set_clock = optimizer, clock, set_clock
        self._pin = torch.cuda.is_available()
        self._parts = [(list(params), sync, [self._host_like(local_shard(p)) for p in params])
                       for params, sync in parts]
        self._outer: list[dict[str, Any] | None] = [None] * len(self._parts)
        self._moments: list[list[dict[str, Any] | None]] = [[None] * len(params) for params, _, _ in self._parts]
        """Per fragment and parameter: its optimizer state at the commit (tensors: this rank's local values on the
        host), or None where the optimizer had none yet."""
        self._clock: dict[str, Any] = {}

    def _host_like(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self._pin)

    @torch.no_grad()
    def commit(self, fragment: int | None = None) -> None:
        """Make the current state (of one fragment, or all) and clock what `restore()` returns to."""
        for i, (params, sync, saved) in enumerate(self._parts):
            if fragment is not None and i != fragment:
                continue
            for j, (param, copy) in enumerate(zip(params, saved)):
                copy.copy_(local_shard(param))
                self._moments[i][j] = self._save_state(self.optimizer.state.get(param), self._moments[i][j])
            if sync is not None and sync.keeps and sync.captured:
                self._outer[i] = _to(sync.state_dict(), "cpu")
        self._clock = self._clock_of()

    @torch.no_grad()
    def restore(self) -> None:
        """Put back every fragment's state as of its last commit, and the clock as of the newest commit."""
        for i, ((params, sync, saved), outer) in enumerate(zip(self._parts, self._outer)):
            for param, copy in zip(params, saved):
                local_shard(param).copy_(copy)
            self.restore_optimizer(i)
            if outer is not None and sync is not None:
                sync.load_state_dict(_to(outer, local_shard(params[0]).device))
        if self._clock:
            self._set_clock(self._clock)

    @torch.no_grad()
    def restore_optimizer(self, fragment: int) -> None:
        """Put back the inner optimizer's state of fragment `fragment`'s parameters as of its last commit."""
        state = self.optimizer.state
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
