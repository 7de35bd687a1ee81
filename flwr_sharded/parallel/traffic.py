"""Counting the collectives a rank issues (op, process-group members, payload bytes): `TrafficMeter` wraps the
`torch.distributed` functions while active, so it sees FSDP2's collectives, the shard sync's, and the quantized ring's
sends (`batch_isend_irecv`), without changing them; `TrafficProbe` files them by optimizer steps and syncs for
`train --measure-traffic` (compared with the cost model by `flwr_sharded_perf.traffic_report`), in the windows that
`flwr_sharded.training.observer.TrafficWindows` opens and closes as the `SyncLoop` steps and syncs."""

from __future__ import annotations

import functools
import inspect
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

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
    if hasattr(value, "element_size"):  # a tensor
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
        import torch.distributed as dist  # the planner reads this module's phases without torch

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
        import torch.distributed as dist

        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    def _wrap(self, name: str, arg_index: int, keyword: str, original: Callable[..., Any]) -> Callable[..., Any]:
        import torch.distributed as dist

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
        import torch.distributed as dist

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


PHASES = ("step", "sync")
ALL_PHASES = (*PHASES, "other")
NETDEV_ENV = "FLWR_SHARDED_NETDEV"
"""Extra `net/dev` files rank 0 snapshots, as `label=path,label=path` (the emulator's fabric namespace's)."""


def read_netdev(path: str | os.PathLike = "/proc/self/net/dev") -> dict[str, dict[str, int]]:
    """{interface: {"rx_bytes", "tx_bytes", "rx_packets", "tx_packets"}} from a `/proc/<pid>/net/dev` file."""
    out: dict[str, dict[str, int]] = {}
    for line in Path(path).read_text().splitlines()[2:]:
        name, _, rest = line.partition(":")
        values = [int(v) for v in rest.split()]
        if len(values) >= 16:
            out[name.strip()] = {"rx_bytes": values[0], "rx_packets": values[1], "tx_bytes": values[8],
                                 "tx_packets": values[9]}
    return out


def _subtract(after: dict[str, dict[str, int]], before: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {name: {k: v - before.get(name, {}).get(k, 0) for k, v in values.items()} for name, values in after.items()}


@dataclass
class TrafficProbe:
    """One rank's collectives by optimizer steps, shard syncs and the rest, and interface counters, over its loop:
    the records of each window (`begin`, `end`) under its phase, those of an overlapped sync's thread under "sync"."""

    rank: int
    world_size: int
    local_rank: int = 0
    windows: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PHASES, 0))
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    _meter: Any = None
    _spans: list[tuple[str, int, int]] = field(default_factory=list)
    _start: dict[str, dict[str, dict[str, int]]] | None = None
    _netdev: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    _collectives: dict[tuple[str, str, tuple[int, ...]], list[int]] | None = None
    _window: tuple[str, bool, int, float] | None = None
    """The open window: (phase, counted, first record, start time)."""

    @classmethod
    def from_env(cls) -> TrafficProbe:
        return cls(rank=int(os.environ.get("RANK", "0")), world_size=int(os.environ.get("WORLD_SIZE", "1")),
                   local_rank=int(os.environ.get("LOCAL_RANK", "0")))

    def _snapshot(self) -> dict[str, dict[str, dict[str, int]]]:
        """The interface counters this rank reads: its namespace's on LOCAL_RANK 0, `NETDEV_ENV`'s on rank 0."""
        sources = {"self": "/proc/self/net/dev"} if self.local_rank == 0 else {}
        if self.rank == 0:
            sources.update(item.partition("=")[::2] for item in os.environ.get(NETDEV_ENV, "").split(",") if item)
        out = {}
        for label, path in sources.items():
            try:
                out[label] = read_netdev(path)
            except OSError:
                pass
        return out

    def start(self) -> None:
        """Start counting (called by the first window)."""
        if self._meter is None and self._collectives is None:
            self._start = self._snapshot()
            self._meter = TrafficMeter().__enter__()

    def finish(self) -> None:
        """Stop counting: snapshot the counters and file every record under its phase ("other" between windows)."""
        if self._meter is None:
            return
        end = self._snapshot()
        self._meter.__exit__(None, None, None)
        records, self._meter = self._meter.records, None
        phase_of = ["other"] * len(records)
        for phase, i0, i1 in self._spans:
            phase_of[i0:i1] = [phase] * (i1 - i0)
        self._collectives = {}
        for phase, rec in zip(phase_of, records):
            phase = "sync" if rec.background else phase  # an overlapped sync's thread, while steps run
            slot = self._collectives.setdefault((phase, rec.op, rec.ranks), [0, 0])
            slot[0] += 1
            slot[1] += rec.nbytes
        self._netdev = {label: _subtract(end[label], self._start[label]) for label in end if label in self._start}

    def begin(self, phase: str, count: bool = True) -> None:
        """Open a window of `phase` ("step" or "sync"), closed by `end`; `count=False`: its collectives and seconds,
        not as a window."""
        self.start()
        i0 = len(self._meter.records) if self._meter is not None else 0
        self._window = (phase, count, i0, time.perf_counter())

    def end(self) -> None:
        """Close the open window: its seconds, and its records filed under its phase."""
        phase, count, i0, start = self._window
        self._window = None
        self.seconds[phase] += time.perf_counter() - start
        self.windows[phase] += int(count)
        if self._meter is not None:
            self._spans.append((phase, i0, len(self._meter.records)))

    def to_dict(self) -> dict[str, Any]:
        self.finish()
        return {"rank": self.rank, "world_size": self.world_size, "local_rank": self.local_rank,
                "windows": self.windows, "seconds": self.seconds,
                "collectives": [{"phase": p, "op": op, "ranks": list(ranks), "calls": c, "bytes": b}
                                for (p, op, ranks), (c, b) in sorted((self._collectives or {}).items())],
                "netdev": self._netdev}

    def write(self, directory: str | os.PathLike) -> Path:
        path = Path(directory) / f"rank{self.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict()))
        return path
