"""Measured traffic of a training run (`train --measure-traffic`: a `TrafficProbe`) next to the cost model's."""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from flwr_sharded.perf.costmodel import Units
from flwr_sharded.perf.placement import TIERS, Placement, traffic

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
    """One rank's collectives by optimizer steps, shard syncs and the rest, and interface counters, over its loop."""

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
        from flwr_sharded.parallel.traffic import TrafficMeter

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

    @contextlib.contextmanager
    def window(self, phase: str, count: bool = True) -> Iterator[None]:
        """Count the body under `phase` ("step" or "sync"); `count=False`: its collectives, not as a window."""
        self.start()
        i0 = len(self._meter.records) if self._meter is not None else 0
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start
            self.windows[phase] += int(count)
            if self._meter is not None:
                self._spans.append((phase, i0, len(self._meter.records)))

    def wrap(self, phase: str, fn: Callable[..., Any], count: bool = True) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with self.window(phase, count):
                return fn(*args, **kwargs)

        return wrapped

    def attach(self, trainer: Any, loop: Any) -> None:
        """Measure `trainer.step` (one optimizer step) and the shard syncs of its `SyncLoop` from now on: a window
        per fragment sync on every rank (the merge: the reduction, the commit, the replicas' broadcast), and the
        collectives of starting an overlapped one and of its communication thread under "sync" too."""
        trainer.step = self.wrap("step", trainer.step)
        loop._merge = self.wrap("sync", loop._merge)
        loop._start = self.wrap("sync", loop._start, count=False)

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


def load_probes(directory: str | os.PathLike) -> list[dict[str, Any]]:
    """The `rank<N>.json` files of a `--measure-traffic` directory, in rank order."""
    files = sorted(Path(directory).glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    if not files:
        raise FileNotFoundError(f"no rank*.json traffic files in {directory}")
    return [json.loads(p.read_text()) for p in files]


def ring_bytes_sent(op: str, payload: float, n: int, backend: str = "gloo") -> float:
    """Bytes one rank sends for one ring collective of `payload` bytes (the meter's) over n ranks."""
    share = (n - 1) / max(n, 1)
    factors = {"all_gather_single": share, "all_gather_into_tensor": share, "all_gather": n - 1,
               "reduce_scatter_single": share * (2.0 if backend == "gloo" else 1.0), "all_reduce": 2.0 * share,
               "broadcast": 1.0, "send": 1.0}
    factors["reduce_scatter_tensor"] = factors["reduce_scatter_single"]
    if op not in factors:
        raise ValueError(f"no ring accounting for collective {op!r}")
    return payload * factors[op] if n >= 2 else 0.0


def sending_records(probes: list[dict[str, Any]]) -> Iterator[tuple[int, dict[str, Any], int]]:
    """(rank, record, the next rank of its group) of every record in which the rank sends (not a broadcast's last)."""
    for probe in probes:
        rank = probe["rank"]
        for rec in probe["collectives"]:
            ranks, n = rec["ranks"], len(rec["ranks"])
            if rank in ranks and n >= 2 and not (rec["op"] == "broadcast" and ranks.index(rank) == n - 1):
                yield rank, rec, ranks[(ranks.index(rank) + 1) % n]


def collective_tiers(probes: list[dict[str, Any]], placement: Placement,
                     backend: str = "gloo") -> dict[str, dict[str, float]]:
    """Bytes sent per phase and tier, summed over ranks; ops without a ring rule under "unmapped" (payload bytes)."""
    out = {p: dict.fromkeys((*TIERS, "unmapped"), 0.0) for p in ALL_PHASES}
    for rank, rec, peer in sending_records(probes):
        try:  # linear in the payload: all calls at once
            out[rec["phase"]][placement.link_tier(rank, peer)] += ring_bytes_sent(rec["op"], rec["bytes"],
                                                                                   len(rec["ranks"]), backend)
        except ValueError:
            out[rec["phase"]]["unmapped"] += rec["bytes"]
    return out


def wire_tiers(probes: list[dict[str, Any]], ranks_per_node: int, uplinks: list[str],
               fabric_label: str = "fabric", node_iface: str = "eth0") -> dict[str, float]:
    """Bytes on the emulated wire per tier over the loop: tx of `lo`, of the `uplinks`, of `node_iface` less them."""
    out = dict.fromkeys(TIERS, 0.0)
    for probe in (p for p in probes if p["rank"] % ranks_per_node == 0):
        node = probe["netdev"].get("self", {})
        out["intra_node"] += node.get("lo", {}).get("tx_bytes", 0)
        out["inter_node"] += node.get(node_iface, {}).get("tx_bytes", 0)
        fabric = probe["netdev"].get(fabric_label)
        if fabric is not None:
            out["inter_group"] += sum(fabric.get(u, {}).get("tx_bytes", 0) for u in uplinks)
    out["inter_node"] -= out["inter_group"]
    return out


@dataclass
class TierComparison:
    """Predicted and measured bytes of one run per tier: collectives per phase, and the wire over the loop."""

    predicted: dict[str, dict[str, float]]
    """phase (step, sync) -> tier -> bytes, from the cost model."""
    collectives: dict[str, dict[str, float]]
    """phase (step, sync, other) -> tier -> bytes, from the recorded collectives."""
    wire: dict[str, float] | None
    """tier -> bytes on the interfaces over the whole loop (steps, syncs, evaluation, logging)."""
    steps: int
    syncs: float

    def predicted_total(self) -> dict[str, float]:
        return {t: sum(self.predicted[p][t] for p in PHASES) for t in TIERS}

    def measured_total(self, phases: tuple[str, ...] = PHASES) -> dict[str, float]:
        return {t: sum(self.collectives[p][t] for p in phases) for t in TIERS}

    def error(self, tier: str) -> float | None:
        """(measured - predicted) / predicted over steps and syncs; None when both are 0."""
        pred, meas = self.predicted_total()[tier], self.measured_total()[tier]
        return (meas - pred) / pred if pred else None if meas == 0 else float("inf")

    def max_error(self) -> float:
        return max((abs(e) for t in TIERS if (e := self.error(t)) is not None), default=0.0)

    def wire_ratio(self, tier: str) -> float | None:
        """Wire bytes / collective bytes over the same span (steps, syncs and the rest); None without data."""
        meas = self.measured_total(ALL_PHASES)[tier]
        return self.wire[tier] / meas if self.wire is not None and meas > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "syncs": self.syncs, "predicted": self.predicted,
                "collectives": self.collectives, "wire": self.wire,
                "error": {t: self.error(t) for t in TIERS}, "wire_ratio": {t: self.wire_ratio(t) for t in TIERS}}


def compare(probes: list[dict[str, Any]], method: str, placement: Placement, units: Units, *, A: int,
            backend: str = "gloo", reshard_root: bool = True, ranks_per_node: int | None = None,
            uplinks: list[str] | None = None, wire_ratio: float = 1.0, fragments: int = 1) -> TierComparison:
    """Measured (collectives, and wire) against predicted bytes per tier for one run (`fragments`: its fragments)."""
    steps = probes[0]["windows"]["step"]
    syncs = probes[0]["windows"]["sync"] / fragments  # whole-model syncs: one per fragment's sync of each
    per_rank = traffic(method, placement, units, A=A, backend=backend, reshard_root=reshard_root, wire_ratio=wire_ratio)
    predicted = {phase: {tier: sum(getattr(t, phase)[tier] for t in per_rank) * count for tier in TIERS}
                 for phase, count in (("step", steps), ("sync", syncs))}  # placement.traffic summed over ranks
    wire = wire_tiers(probes, ranks_per_node, uplinks or []) if ranks_per_node and any(p["netdev"] for p in probes) \
        else None
    return TierComparison(predicted=predicted, collectives=collective_tiers(probes, placement, backend), wire=wire,
                          steps=steps, syncs=syncs)

