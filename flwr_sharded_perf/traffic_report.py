"""Measured traffic of a training run (`train --measure-traffic`: `flwr_sharded.parallel.traffic.TrafficProbe`'s
files) next to the cost model's."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from flwr_sharded.parallel.traffic import ALL_PHASES, PHASES
from flwr_sharded.parallel.sites import SiteLayout
from flwr_sharded_perf.costmodel import Units
from flwr_sharded_perf.placement import TIERS, Placement, traffic

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
            uplinks: list[str] | None = None, wire_ratio: float = 1.0, fragments: int = 1,
            sites: SiteLayout | None = None, stage_ratio: float | None = None) -> TierComparison:
    """Measured (collectives, and wire) against predicted bytes per tier for one run (`fragments`: its fragments;
    `sites`, `stage_ratio`: a two-level sync's, `placement.rank_traffic`'s; None: the flat ring)."""
    steps = probes[0]["windows"]["step"]
    syncs = probes[0]["windows"]["sync"] / fragments  # whole-model syncs: one per fragment's sync of each
    per_rank = traffic(method, placement, units, A=A, backend=backend, reshard_root=reshard_root, wire_ratio=wire_ratio,
                       sites=sites, stage_ratio=stage_ratio)
    predicted = {phase: {tier: sum(getattr(t, phase)[tier] for t in per_rank) * count for tier in TIERS}
                 for phase, count in (("step", steps), ("sync", syncs))}  # placement.traffic summed over ranks
    wire = wire_tiers(probes, ranks_per_node, uplinks or []) if ranks_per_node and any(p["netdev"] for p in probes) \
        else None
    return TierComparison(predicted=predicted, collectives=collective_tiers(probes, placement, backend), wire=wire,
                          steps=steps, syncs=syncs)

