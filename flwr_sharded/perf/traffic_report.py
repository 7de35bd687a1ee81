"""Measured traffic next to the cost model's prediction, per network tier.

Two measurements of one training run (`train.py --measure-traffic DIR` attaches a `TrafficProbe` to the trainer):

- **collectives**: a `TrafficMeter` records every collective a rank issues over its training loop (op, process-group
  ranks, payload bytes), each filed under the optimizer step, the shard sync or the rest (evaluation, logging) it
  ran in. `collective_tiers` turns the records into bytes sent per tier with the same ring rules as
  `placement.rank_traffic`: a rank sends its share of a ring collective to the next rank of the group; an all-gather
  or reduce-scatter of D bytes over n ranks sends D (n-1)/n, an all-reduce 2 D (n-1)/n, and gloo's reduce-scatter,
  which runs an all-reduce, 2 D (n-1)/n as well; a broadcast is a chain.
- **wire** (`wire_tiers`): the interface byte counters of the emulated network (`/proc/<pid>/net/dev`) at the start
  and end of the loop: `lo` of each node namespace (intra-node), `eth0` of each node (everything leaving the node)
  and the group uplinks (everything leaving a node group). They include TCP/IP headers and acknowledgements.

`compare` puts both next to `placement.traffic` for the same placement, model units and number of steps and syncs.
"""

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
"""Extra `net/dev` files rank 0 snapshots around each window, as `label=path,label=path` (the emulator sets it to
the fabric namespace's `/proc/<pid>/net/dev`)."""


# ---------------------------------------------------------------------------------------------------------------------
# Interface counters.


def read_netdev(path: str | os.PathLike = "/proc/self/net/dev") -> dict[str, dict[str, int]]:
    """{interface: {"rx_bytes", "tx_bytes", "rx_packets", "tx_packets"}} from a `/proc/.../net/dev` file.

    `/proc/<pid>/net/dev` shows the network namespace of process `pid`, so one process can read the counters of
    another namespace through a process living in it.
    """
    out: dict[str, dict[str, int]] = {}
    with open(path) as fh:
        lines = fh.read().splitlines()[2:]
    for line in lines:
        name, _, rest = line.partition(":")
        values = [int(v) for v in rest.split()]
        if len(values) < 16:
            continue
        out[name.strip()] = {"rx_bytes": values[0], "rx_packets": values[1], "tx_bytes": values[8],
                             "tx_packets": values[9]}
    return out


def _subtract(after: dict[str, dict[str, int]], before: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {name: {k: v - before.get(name, {}).get(k, 0) for k, v in values.items()} for name, values in after.items()}


def _accumulate(total: dict[str, dict[str, int]], delta: dict[str, dict[str, int]]) -> None:
    for name, values in delta.items():
        slot = total.setdefault(name, {})
        for k, v in values.items():
            slot[k] = slot.get(k, 0) + v


# ---------------------------------------------------------------------------------------------------------------------
# The probe inside a training run.


@dataclass
class TrafficProbe:
    """Counts one rank's collectives and interface bytes over its training loop, split into optimizer steps,
    shard syncs and the rest (evaluation, logging).

    `attach(trainer)` wraps the trainer's `step` and `sync` methods: the first step starts the count; `finish()`
    (after the loop) stops it; `write(directory)` saves `rank<N>.json`. Interface counters are snapshotted at both
    ends, not per step: a node's ranks do not finish a collective at the same instant, so per-step deltas would
    lose bytes still in flight. The first local rank of a node (LOCAL_RANK 0) reads its namespace's counters
    (`/proc/self/net/dev`), rank 0 also the files named in `$FLWR_SHARDED_NETDEV`.
    """

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
    _phase: str | None = None

    @classmethod
    def from_env(cls) -> TrafficProbe:
        return cls(rank=int(os.environ.get("RANK", "0")), world_size=int(os.environ.get("WORLD_SIZE", "1")),
                   local_rank=int(os.environ.get("LOCAL_RANK", "0")))

    def _sources(self) -> dict[str, str]:
        sources: dict[str, str] = {}
        if self.local_rank == 0:
            sources["self"] = "/proc/self/net/dev"
        if self.rank == 0:
            for item in filter(None, os.environ.get(NETDEV_ENV, "").split(",")):
                label, _, path = item.partition("=")
                sources[label] = path
        return sources

    def _snapshot(self) -> dict[str, dict[str, dict[str, int]]]:
        out = {}
        for label, path in self._sources().items():
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
            for i in range(i0, i1):
                phase_of[i] = phase
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

    def attach(self, trainer: Any) -> None:
        """Measure `trainer.step` (one optimizer step) and the shard syncs from now on: a window per fragment sync
        on every rank (`OuterLoop.merge`: the reduction, the commit, the replicas' broadcast), and the collectives of
        starting an overlapped one (`OuterLoop.start`) and of its communication thread under "sync" too."""
        trainer.step = self.wrap("step", trainer.step)
        if trainer.outer is not None:
            trainer.outer.merge = self.wrap("sync", trainer.outer.merge)
            trainer.outer.start = self.wrap("sync", trainer.outer.start, count=False)

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


# ---------------------------------------------------------------------------------------------------------------------
# From records to bytes per tier.

_GATHER_LIKE = {"all_gather_single", "all_gather_into_tensor"}
_REDUCE_SCATTER = {"reduce_scatter_single", "reduce_scatter_tensor"}


def ring_bytes_sent(op: str, payload: float, n: int, backend: str = "gloo") -> float:
    """Bytes one rank sends for one ring collective of `payload` bytes (the meter's payload) over n ranks."""
    if n < 2:
        return 0.0
    if op in _GATHER_LIKE:
        return payload * (n - 1) / n
    if op == "all_gather":  # the list form (the sync's robust rules): the meter's payload is this rank's input
        return payload * (n - 1)
    if op in _REDUCE_SCATTER:
        return payload * (n - 1) / n * (2.0 if backend == "gloo" else 1.0)
    if op == "all_reduce":
        return 2.0 * payload * (n - 1) / n
    if op == "broadcast":
        return payload  # pipelined chain: every rank but the last forwards it once (the caller drops the last)
    if op == "send":
        return payload  # point to point: its record's ranks are (sender, receiver)
    raise ValueError(f"no ring accounting for collective {op!r}")


def collective_tiers(probes: list[dict[str, Any]], placement: Placement,
                     backend: str = "gloo") -> dict[str, dict[str, float]]:
    """Bytes sent per phase ("step", "sync", "other") and tier, summed over ranks, from the probes' records.

    Each collective's bytes go to the tier of the link from the rank to the next one in its group (rank order).
    A broadcast counts for every rank but the last of its chain. Ops without a ring rule are reported under the
    pseudo-tier "unmapped" (payload bytes).
    """
    out = {p: dict.fromkeys((*TIERS, "unmapped"), 0.0) for p in ALL_PHASES}
    for probe in probes:
        rank = probe["rank"]
        for rec in probe["collectives"]:
            ranks, op, phase = rec["ranks"], rec["op"], rec["phase"]
            n = len(ranks)
            if rank not in ranks or n < 2:
                continue
            i = ranks.index(rank)
            if op == "broadcast" and i == n - 1:
                continue
            try:
                nbytes = ring_bytes_sent(op, rec["bytes"], n, backend)  # linear in the payload: all calls at once
            except ValueError:
                out[phase]["unmapped"] += rec["bytes"]
                continue
            out[phase][placement.link_tier(rank, ranks[(i + 1) % n])] += nbytes
    return out


def wire_tiers(probes: list[dict[str, Any]], ranks_per_node: int, uplinks: list[str],
               fabric_label: str = "fabric", node_iface: str = "eth0") -> dict[str, float]:
    """Bytes on the emulated wire per tier over the training loop, from the interface counters the probes took.

    intra_node: tx of `lo` of every node; inter_group: tx of the group uplinks (`uplinks`, in the fabric namespace,
    read by rank 0); inter_node: tx of every node's `node_iface` minus inter_group. A node's counters are read by
    its first rank. Wire bytes include TCP/IP headers, acknowledgements and connection set-up.
    """
    out = dict.fromkeys(TIERS, 0.0)
    for probe in probes:
        if probe["rank"] % ranks_per_node:
            continue
        node = probe["netdev"].get("self", {})
        out["intra_node"] += node.get("lo", {}).get("tx_bytes", 0)
        out["inter_node"] += node.get(node_iface, {}).get("tx_bytes", 0)
        fabric = probe["netdev"].get(fabric_label)
        if fabric is not None:
            out["inter_group"] += sum(fabric.get(u, {}).get("tx_bytes", 0) for u in uplinks)
    out["inter_node"] -= out["inter_group"]
    return out


def predicted_tiers(method: str, placement: Placement, units: Units, *, A: int, steps: int, syncs: float,
                    backend: str = "gloo", reshard_root: bool = True,
                    wire_ratio: float = 1.0) -> dict[str, dict[str, float]]:
    """`placement.traffic` summed over ranks: step bytes x steps and sync bytes x syncs, per tier.

    `wire_ratio`: the sync all-reduce's bytes per parameter over the units' (0.5 for a bfloat16 sync of fp32 units).
    """
    out = {p: dict.fromkeys(TIERS, 0.0) for p in PHASES}
    for t in traffic(method, placement, units, A=A, backend=backend, reshard_root=reshard_root,
                     wire_ratio=wire_ratio):
        for tier in TIERS:
            out["step"][tier] += t.step[tier] * steps
            out["sync"][tier] += t.sync[tier] * syncs
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
        if pred == 0:
            return None if meas == 0 else float("inf")
        return (meas - pred) / pred

    def max_error(self) -> float:
        errors = [abs(e) for t in TIERS if (e := self.error(t)) is not None]
        return max(errors, default=0.0)

    def wire_ratio(self, tier: str) -> float | None:
        """Wire bytes / collective bytes over the same span (steps, syncs and the rest); None without data."""
        if self.wire is None:
            return None
        meas = self.measured_total(ALL_PHASES)[tier]
        return self.wire[tier] / meas if meas > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "syncs": self.syncs, "predicted": self.predicted,
                "collectives": self.collectives, "wire": self.wire,
                "error": {t: self.error(t) for t in TIERS}, "wire_ratio": {t: self.wire_ratio(t) for t in TIERS}}


def compare(probes: list[dict[str, Any]], method: str, placement: Placement, units: Units, *, A: int,
            backend: str = "gloo", reshard_root: bool = True, ranks_per_node: int | None = None,
            uplinks: list[str] | None = None, wire_ratio: float = 1.0, fragments: int = 1) -> TierComparison:
    """Measured (collectives, and wire when counters were taken) against predicted bytes per tier for one run.

    `wire_ratio`: as in `predicted_tiers` (the run's `--sync-dtype` bytes over the units' bytes per parameter).
    `fragments`: the run's `--sync-fragments` (each fragment's sync carries its share of the model).
    """
    steps = probes[0]["windows"]["step"]
    syncs = probes[0]["windows"]["sync"] / fragments  # whole-model syncs: one per fragment's sync of each
    predicted = predicted_tiers(method, placement, units, A=A, steps=steps, syncs=syncs, backend=backend,
                                reshard_root=reshard_root, wire_ratio=wire_ratio)
    wire = None
    if ranks_per_node and any(p["netdev"] for p in probes):
        wire = wire_tiers(probes, ranks_per_node, uplinks or [])
    return TierComparison(predicted=predicted, collectives=collective_tiers(probes, placement, backend), wire=wire,
                          steps=steps, syncs=syncs)


def model_units(model_name: str, vocab_size: int, bytes_per_param: float = 4.0) -> Units:
    """FSDP2 units (blocks and root) of a preset, in bytes on the wire (fp32 on CPU: 4 bytes per parameter)."""
    from flwr_sharded.perf.model_shape import model_from_preset

    return model_from_preset(model_name, vocab_size).units(bytes_per_param)

