"""Measured traffic next to the cost model's prediction, per network tier.

Two measurements, both taken only while a rank runs an optimizer step or a shard sync (not during set-up,
evaluation or logging):

- **collectives** (`TrafficProbe`, switched on by `train.py --measure-traffic DIR`): a `TrafficMeter` records every
  collective this rank issues (op, process-group ranks, payload bytes). `collective_tiers` turns the records into
  bytes sent per tier with the same ring rules as `costmodel.rank_traffic`: a rank sends its share of a ring
  collective to the next rank of the group, an all-gather or reduce-scatter of D bytes over n ranks sends
  D (n-1)/n, an all-reduce 2 D (n-1)/n, and gloo's reduce-scatter, which runs an all-reduce, 2 D (n-1)/n as well.
- **wire** (`wire_tiers`): the interface byte counters of the emulated network (`/proc/<pid>/net/dev`): `lo` of each
  node namespace (intra-node), `eth0` of each node (everything leaving the node) and the group uplinks (everything
  leaving a node group). These include TCP/IP headers, acknowledgements and retransmissions.

`compare` puts both next to `costmodel.traffic` for the same placement, model units and number of steps and syncs.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from flwr_sharded.perf.costmodel import TIERS, Placement, Units, traffic

PHASES = ("step", "sync")
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
    """Counts one rank's collectives and interface bytes during optimizer steps and shard syncs only.

    `attach(trainer)` wraps the trainer's `step` and `sync` methods; `write(directory)` saves `rank<N>.json`.
    The first local rank of a node (LOCAL_RANK 0) snapshots its namespace's counters (`/proc/self/net/dev`), rank 0
    also the files named in `$FLWR_SHARDED_NETDEV`.
    """

    rank: int
    world_size: int
    local_rank: int = 0
    collectives: dict[tuple[str, str, tuple[int, ...]], list[int]] = field(default_factory=dict)
    """(phase, op, group ranks) -> [calls, payload bytes]."""
    netdev: dict[str, dict[str, dict[str, dict[str, int]]]] = field(default_factory=dict)
    """phase -> source ("self" or an extra label) -> interface -> counter deltas."""
    windows: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PHASES, 0))
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

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

    def _snapshot(self, sources: dict[str, str]) -> dict[str, dict[str, dict[str, int]]]:
        out = {}
        for label, path in sources.items():
            try:
                out[label] = read_netdev(path)
            except OSError:
                pass
        return out

    @contextlib.contextmanager
    def window(self, phase: str) -> Iterator[None]:
        """Count collectives and interface bytes while the body runs, under `phase`."""
        from flwr_sharded.parallel.traffic import TrafficMeter

        sources = self._sources()
        before = self._snapshot(sources)
        start = time.perf_counter()
        meter = TrafficMeter()
        try:
            with meter:
                yield
        finally:
            after = self._snapshot(sources)
            self.seconds[phase] += time.perf_counter() - start
            self.windows[phase] += 1
            for rec in meter.records:
                slot = self.collectives.setdefault((phase, rec.op, rec.ranks), [0, 0])
                slot[0] += 1
                slot[1] += rec.nbytes
            for label in after:
                if label in before:
                    _accumulate(self.netdev.setdefault(phase, {}).setdefault(label, {}),
                                _subtract(after[label], before[label]))

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with self.window(phase):
                return fn(*args, **kwargs)

        return wrapped

    def attach(self, trainer: Any) -> None:
        """Measure `trainer.step` (one optimizer step) and `trainer.sync` (one shard sync) from now on."""
        trainer.step = self.wrap("step", trainer.step)
        trainer.sync = self.wrap("sync", trainer.sync)

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world_size, "local_rank": self.local_rank,
                "windows": self.windows, "seconds": self.seconds,
                "collectives": [{"phase": p, "op": op, "ranks": list(ranks), "calls": c, "bytes": b}
                                for (p, op, ranks), (c, b) in sorted(self.collectives.items())],
                "netdev": self.netdev}

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


def sent_bytes(op: str, payload: float, n: int, backend: str = "gloo") -> float:
    """Bytes one rank sends for one ring collective of `payload` bytes (the meter's payload) over n ranks."""
    if n < 2:
        return 0.0
    if op in _GATHER_LIKE:
        return payload * (n - 1) / n
    if op in _REDUCE_SCATTER:
        return payload * (n - 1) / n * (2.0 if backend == "gloo" else 1.0)
    if op == "all_reduce":
        return 2.0 * payload * (n - 1) / n
    if op == "broadcast":
        return payload  # pipelined chain: every rank but the last forwards it once (the caller drops the last)
    raise ValueError(f"no ring accounting for collective {op!r}")


def collective_tiers(probes: list[dict[str, Any]], placement: Placement,
                     backend: str = "gloo") -> dict[str, dict[str, float]]:
    """Bytes sent per phase ("step", "sync") and tier, summed over ranks, from the probes' collective records.

    Each collective's bytes go to the tier of the link from the rank to the next one in its group (rank order).
    A broadcast counts for every rank but the last of its chain. Ops without a ring rule (e.g. the all_gather of
    the alignment check, which runs outside the measured windows) are reported under "other".
    """
    out = {p: dict.fromkeys((*TIERS, "other"), 0.0) for p in PHASES}
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
                nbytes = sent_bytes(op, rec["bytes"], n, backend)  # linear in the payload: all calls at once
            except ValueError:
                out[phase]["other"] += rec["bytes"]
                continue
            out[phase][placement.link_tier(rank, ranks[(i + 1) % n])] += nbytes
    return out


def wire_tiers(probes: list[dict[str, Any]], ranks_per_node: int, uplinks: list[str],
               fabric_label: str = "fabric", node_iface: str = "eth0") -> dict[str, dict[str, float]]:
    """Bytes on the emulated wire per phase and tier, from the interface counters the probes took.

    intra_node: `lo` of every node; inter_group: tx of the group uplinks (`uplinks`, in the fabric namespace, read
    by rank 0); inter_node: tx of every node's `node_iface` minus inter_group. Counters of a node are read by its
    first rank; wire bytes include TCP/IP headers and acknowledgements.
    """
    out = {p: dict.fromkeys(TIERS, 0.0) for p in PHASES}
    for probe in probes:
        if probe["rank"] % ranks_per_node:
            continue
        for phase, sources in probe["netdev"].items():
            node = sources.get("self", {})
            out[phase]["intra_node"] += node.get("lo", {}).get("tx_bytes", 0)
            out[phase]["inter_node"] += node.get(node_iface, {}).get("tx_bytes", 0)
            fabric = sources.get(fabric_label)
            if fabric is not None:
                out[phase]["inter_group"] += sum(fabric.get(u, {}).get("tx_bytes", 0) for u in uplinks)
    for phase in PHASES:
        out[phase]["inter_node"] -= out[phase]["inter_group"]
    return out


def predicted_tiers(method: str, placement: Placement, units: Units, *, A: int, steps: int, syncs: int,
                    backend: str = "gloo", reshard_root: bool = True) -> dict[str, dict[str, float]]:
    """`costmodel.traffic` summed over ranks: step bytes x steps and sync bytes x syncs, per tier."""
    out = {p: dict.fromkeys(TIERS, 0.0) for p in PHASES}
    for t in traffic(method, placement, units, A=A, backend=backend, reshard_root=reshard_root):
        for tier in TIERS:
            out["step"][tier] += t.step[tier] * steps
            out["sync"][tier] += t.sync[tier] * syncs
    return out


@dataclass
class TierComparison:
    """Predicted, per-collective measured and wire bytes of one run, per phase and tier."""

    predicted: dict[str, dict[str, float]]
    collectives: dict[str, dict[str, float]]
    wire: dict[str, dict[str, float]] | None
    steps: int
    syncs: int

    def total(self, which: str) -> dict[str, float]:
        table = getattr(self, which)
        if table is None:
            return {}
        return {t: sum(table[p][t] for p in PHASES) for t in TIERS}

    def error(self, tier: str) -> float | None:
        """Relative difference (measured collectives - predicted) / predicted over both phases; None if none."""
        pred, meas = self.total("predicted")[tier], self.total("collectives")[tier]
        if pred == 0:
            return None if meas == 0 else float("inf")
        return (meas - pred) / pred

    def max_error(self) -> float:
        errors = [abs(e) for t in TIERS if (e := self.error(t)) is not None]
        return max(errors, default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "syncs": self.syncs, "predicted": self.predicted,
                "collectives": self.collectives, "wire": self.wire,
                "error": {t: self.error(t) for t in TIERS}}


def compare(probes: list[dict[str, Any]], method: str, placement: Placement, units: Units, *, A: int,
            backend: str = "gloo", reshard_root: bool = True, ranks_per_node: int | None = None,
            uplinks: list[str] | None = None) -> TierComparison:
    """Measured (collectives, and wire when counters were taken) against predicted bytes per tier for one run."""
    steps = probes[0]["windows"]["step"]
    syncs = probes[0]["windows"]["sync"]
    predicted = predicted_tiers(method, placement, units, A=A, steps=steps, syncs=syncs, backend=backend,
                                reshard_root=reshard_root)
    measured = collective_tiers(probes, placement, backend)
    wire = None
    if ranks_per_node and any(p["netdev"] for p in probes):
        wire = wire_tiers(probes, ranks_per_node, uplinks or [])
    return TierComparison(predicted=predicted, collectives={p: {t: measured[p][t] for t in TIERS} for p in PHASES},
                          wire=wire, steps=steps, syncs=syncs)


def model_units(model_name: str, vocab_size: int, bytes_per_param: float = 4.0) -> Units:
    """FSDP2 units (blocks and root) of a preset, in bytes on the wire (fp32 on CPU: 4 bytes per parameter)."""
    from flwr_sharded.perf.planner import model_from_preset

    return model_from_preset(model_name, vocab_size).units(bytes_per_param)


def format_table(cmp: TierComparison, label: str = "") -> str:
    """Rows per tier: predicted MB, measured (collectives) MB and error, wire MB and wire/measured ratio."""
    pred, meas, wire = cmp.total("predicted"), cmp.total("collectives"), cmp.total("wire")
    lines = [f"{label:<10} {'tier':<12} {'predicted MB':>12} {'collectives MB':>14} {'error':>7} {'wire MB':>9} "
             f"{'wire/coll.':>10}"]
    for tier in TIERS:
        err = cmp.error(tier)
        err_s = "-" if err is None else f"{err:+.1%}"
        w = wire.get(tier) if wire else None
        ratio = f"{w / meas[tier]:.3f}" if w is not None and meas[tier] > 0 else "-"
        w_s = f"{w / 1e6:9.2f}" if w is not None else f"{'-':>9}"
        lines.append(f"{'':<10} {tier:<12} {pred[tier] / 1e6:12.2f} {meas[tier] / 1e6:14.2f} {err_s:>7} {w_s} "
                     f"{ratio:>10}")
    return "\n".join(lines)
