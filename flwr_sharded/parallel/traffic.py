"""Counting the collectives a rank issues (op, process-group members, payload bytes): `TrafficMeter` wraps the
`torch.distributed` functions while active, so it sees FSDP2's collectives, the shard sync's, and the quantized ring's
sends (`batch_isend_irecv`), without changing them."""

from __future__ import annotations

import functools
import inspect
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

# Collective name -> (index, keyword) of the argument holding the tensor whose size is the payload.
_COLLECTIVES = {
    "all_reduce": (0, "tensor"),
    "broadcast": (0, "tensor"),
    "all_gather_into_tensor": (0, "output_tensor"),  # output: the gathered size, the "D" of the cost model
    "reduce_scatter_tensor": (1, "input"),  # input: the full size
    # FSDP2 calls these since torch 2.13 (keywords for the reduce-scatter); the deprecated names above delegate to
    # them without going through the wrapped module attribute, so nothing is counted twice.
    "all_gather_single": (0, "output_tensor"),
    "reduce_scatter_single": (1, "input"),
    "all_gather": (1, "tensor"),
    "reduce_scatter": (1, "input_list"),
    "all_to_all_single": (1, "input"),
}


@dataclass(frozen=True)
class CommRecord:
    """One collective issued by this rank."""

    op: str
    """Collective name, e.g. "all_reduce"."""
    ranks: tuple[int, ...]
    """Global ranks of its process group."""
    nbytes: int
    """Payload bytes (the full buffer size D of the cost model)."""
    background: bool = field(default_factory=lambda: threading.current_thread() is not threading.main_thread())
    """Issued by a thread other than the main one (an overlapped sync's)."""


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


@dataclass
class TrafficMeter:
    """Context manager recording every collective this process issues while active."""

    records: list[CommRecord] = field(default_factory=list)
    _originals: dict[str, Callable[..., Any]] = field(default_factory=dict)

    def __enter__(self) -> "TrafficMeter":
        for name, (arg_index, keyword) in _COLLECTIVES.items():
            original = getattr(dist, name, None)
            if original is None:  # not in this torch version
                continue
            self._originals[name] = original
            setattr(dist, name, self._wrap(name, arg_index, keyword, original))
        self._originals["batch_isend_irecv"] = original = dist.batch_isend_irecv
        setattr(dist, "batch_isend_irecv", self._wrap_p2p(original))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    def _wrap(self, name: str, arg_index: int, keyword: str, original: Callable[..., Any]) -> Callable[..., Any]:
        try:
            signature: inspect.Signature | None = inspect.signature(original)
        except (TypeError, ValueError):
            signature = None

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            tensor = args[arg_index] if len(args) > arg_index else kwargs.get(keyword)
            if signature is not None:  # also finds a group passed positionally
                try:
                    bound = signature.bind_partial(*args, **kwargs).arguments
                    group, tensor = bound.get("group", group), bound.get(keyword, tensor)
                except TypeError:
                    pass
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(
                range(dist.get_world_size()))
            self.records.append(CommRecord(name, ranks, _nbytes(tensor)))
            return original(*args, **kwargs)

        return wrapper

    def _wrap_p2p(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """Point-to-point batches: each send is a record "send" with ranks (this rank, the peer); receives are the
        peers' sends."""

        @functools.wraps(original)
        def wrapper(ops: list[Any]) -> Any:
            me = dist.get_rank()
            for op in ops:
                if "send" in op.op.__name__:
                    self.records.append(CommRecord("send", (me, op.peer), _nbytes(op.tensor)))
            return original(ops)

        return wrapper

    def count(self, op: str | None = None) -> int:
        return sum(1 for rec in self.records if op is None or rec.op == op)
