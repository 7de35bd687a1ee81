"""The rollback point of a rank's federated state: what a failed sync (or catch-up) restores.

Per sync fragment, as of its last `commit`: this rank's local shards and the inner optimizer's state of them and the
outer state (global shards, the rule's state, error-feedback residuals, when the sync keeps them); and the trainer's
clock (step and schedule, through callables: nothing here knows the trainer).

The host copies live in buffers kept from commit to commit (pinned on CUDA machines, plain memory otherwise). On
CUDA a commit copies on a side stream without blocking the host: the side stream waits for the work queued so far,
and the main stream waits (on the device) for an event recorded after the copies before its next kernels, which may
overwrite what is being copied; `restore()` waits for that event before it reads them. `restore()` writes into the
existing device tensors (shards, moments, outer state) rather than allocating new ones.
`restore()` puts every fragment back and the clock to the newest commit (the local steps since are undone; the data
stream goes on with fresh batches).

A commit may be held `pending` (an overlapped sync's merge, which the members confirm only at their next exchange):
it goes to a second set of buffers of that fragment, allocated the first time, and `confirm()` makes every pending
commit the rollback point at once; `restore()` returns to the confirmed one. At most a fragment or two are pending
at a time (the merges since the last exchange), so the second set costs a fragment's share of the copy, not the
model's. `restore_optimizer(i)` serves a member left out for non-finite values: it adopts
the others' mean, and its moments, which may hold the same NaN, go back to the last commit.
"""

from __future__ import annotations

from contextlib import nullcontext
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
        self._pending: dict[int, tuple[list[torch.Tensor], list[dict[str, Any] | None], dict[str, Any] | None]] = {}
        """Per fragment with a pending commit: its shards, moments and outer state as of that commit."""
        self._pending_clock: dict[str, Any] = {}
        self._spare: dict[int, tuple[list[torch.Tensor], list[dict[str, Any] | None], dict[str, Any] | None]] = {}
        """Buffers a confirmed or dropped pending commit left, reused by the next pending commit of the fragment."""
        devices = {local_shard(p).device for params, _, _ in self._parts for p in params}
        cuda = [d for d in devices if d.type == "cuda"]
        self._stream = torch.cuda.Stream(cuda[0]) if cuda else None
        """The side stream of the commits' copies (CUDA only)."""
        self._copied: torch.cuda.Event | None = None
        """Recorded on the side stream after the last commit's copies."""

    def _host_like(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self._pin)

    def _host_copy(self, value: Any, previous: Any) -> Any:
        """A host copy of `value` (a tensor, or a dict or list of them), in `previous`'s buffers where they fit."""
        if isinstance(value, torch.Tensor):  # scalars too (a fused AdamW's step on the device): no host sync
            fits = isinstance(previous, torch.Tensor) and previous.shape == value.shape and \
                previous.dtype == value.dtype
            buffer = previous if fits else self._host_like(value)
            buffer.copy_(value, non_blocking=True)
            return buffer
        if isinstance(value, dict):
            old = previous if isinstance(previous, dict) else {}
            return {k: self._host_copy(v, old.get(k)) for k, v in value.items()}
        if isinstance(value, list):
            old = previous if isinstance(previous, list) and len(previous) == len(value) else [None] * len(value)
            return [self._host_copy(v, o) for v, o in zip(value, old)]
        return value

    def _wait_for_copies(self) -> None:
        """Block the host until the last commit's copies are done (before they are read)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    @torch.no_grad()
    def commit(self, fragment: int | None = None, *, pending: bool = False) -> None:
        """Make the current state (of one fragment, or all) and clock what `restore()` returns to; `pending`: only
        once `confirm()` is called (a commit of all drops every pending one)."""
        if fragment is None and pending:
            raise ValueError("a pending commit is of one fragment")
        side = self._stream
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(side.device))  # what was queued so far is what is kept
        with torch.cuda.stream(side) if side is not None else nullcontext():
            for i, (params, sync, confirmed) in enumerate(self._parts):
                if fragment is not None and i != fragment:
                    continue
                if pending:
                    saved, moments, outer = self._pending.pop(i, None) or self._spare.pop(i, None) or (
                        [self._host_like(local_shard(p)) for p in params], [None] * len(params), None)
                else:
                    saved, moments, outer = confirmed, self._moments[i], self._outer[i]
                    if i in self._pending:  # older than this commit
                        self._spare[i] = self._pending.pop(i)
                for j, (param, copy) in enumerate(zip(params, saved)):
                    copy.copy_(local_shard(param), non_blocking=True)
                    moments[j] = self._save_state(self.optimizer.state.get(param), moments[j])
                if sync is not None and sync.keeps and sync.captured:
                    outer = self._host_copy(sync.state_dict(), outer)
                if pending:
                    self._pending[i] = (saved, moments, outer)
                else:
                    self._outer[i] = outer
        if side is not None:
            self._copied = side.record_event()
            torch.cuda.current_stream(side.device).wait_event(self._copied)  # later kernels may overwrite sources
        if pending:
            self._pending_clock = self._clock_of()
            return
        self._clock = self._clock_of()
        if fragment is None:
            self._drop_pending()

    def confirm(self) -> None:
        """Every pending commit becomes the rollback point of its fragment (no copy: the buffers trade places)."""
        for i, (saved, moments, outer) in self._pending.items():
            params, sync, confirmed = self._parts[i]
            self._spare[i] = (confirmed, self._moments[i], self._outer[i])
            self._parts[i] = (params, sync, saved)
            self._moments[i], self._outer[i] = moments, outer
        if self._pending:
            self._clock = self._pending_clock
        self._pending.clear()

    @property
    def pending(self) -> list[int]:
        """The fragments with a pending commit."""
        return sorted(self._pending)

    def _drop_pending(self) -> None:
        self._spare.update(self._pending)
        self._pending.clear()

    @torch.no_grad()
    def restore(self) -> None:
        """Put back every fragment's state as of its last confirmed commit, and the clock as of the newest one; pending
        commits are dropped."""
        self._wait_for_copies()
        self._drop_pending()
        for i, ((params, sync, saved), outer) in enumerate(zip(self._parts, self._outer)):
            for param, copy in zip(params, saved):
                local_shard(param).copy_(copy, non_blocking=True)
            self.restore_optimizer(i)
            if outer is not None and sync is not None:
                sync.load_state_dict(_into(outer, sync.state_dict(), local_shard(params[0]).device))
        if self._clock:
            self._set_clock(self._clock)

    @torch.no_grad()
    def restore_optimizer(self, fragment: int) -> None:
        """Put back the inner optimizer's state of fragment `fragment`'s parameters as of its last commit."""
        self._wait_for_copies()
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
                elif value.dim() == 0:  # where the optimizer keeps it: the parameter's device if fused or capturable
                    device = current[key].device if key in current else self._scalar_device(param)
                    current[key] = value.to(device, copy=True)
                else:
                    if key not in current:
                        current[key] = torch.empty_like(param, dtype=value.dtype)
                    local_shard(current[key]).copy_(value, non_blocking=True)

    def _scalar_device(self, param: torch.Tensor) -> torch.device:
        """Where the optimizer keeps a new scalar state (a step count) of `param`."""
        group = next(g for g in self.optimizer.param_groups if any(p is param for p in g["params"]))
        on_device = group.get("fused") or group.get("capturable")
        return local_shard(param).device if on_device else torch.device("cpu")

    def _save_state(self, state: dict[str, Any] | None, previous: dict[str, Any] | None) -> dict[str, Any] | None:
        """A host copy of one parameter's optimizer state, reusing `previous`'s buffers where they fit."""
        if not state:
            return None
        return {key: self._host_copy(local_shard(value), (previous or {}).get(key))
                if isinstance(value, torch.Tensor) else value for key, value in state.items()}


def _into(saved: Any, live: Any, device: torch.device) -> Any:
    """`saved` (a nested host state) written into `live` (the sync's state now): in place where `live` holds a tensor
    of the same shape and dtype, a new tensor on `device` where it holds none (e.g. a bucket's residual that did not
    exist yet). Returns the state to load."""
    if isinstance(saved, torch.Tensor):
        if isinstance(live, torch.Tensor) and live.shape == saved.shape and live.dtype == saved.dtype:
            live.copy_(saved, non_blocking=True)
            return live
        return saved.to(device, copy=True)
    if isinstance(saved, dict):
        old = live if isinstance(live, dict) else {}
        return {k: _into(v, old.get(k), device) for k, v in saved.items()}
    if isinstance(saved, list):
        old = live if isinstance(live, list) and len(live) == len(saved) else [None] * len(saved)
        return [_into(v, o, device) for v, o in zip(saved, old)]
    return saved
