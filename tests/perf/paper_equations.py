"""The paper's Eqs. 1-5 literally (one message size M for every collective), and small builders and sums: the tests'
oracles for `flwr_sharded_perf.costmodel`, `placement` and `memory_model`."""

from __future__ import annotations

from flwr_sharded.errors import ConfigError
from flwr_sharded_perf.costmodel import (Units, _check_bandwidth, _check_bandwidths, all_gather_time, all_reduce_time,
                                         broadcast_time, check_layout, positive_int, reduce_scatter_time)
from flwr_sharded_perf.memory_model import MemoryBreakdown
from flwr_sharded_perf.placement import TIERS, Traffic


def comm_time(method: str, *, M: float, L: int, S: int, R: int = 1, F: int = 1, A: int = 1, B_S: float | None,
              B_R: float | None = None, B_F: float | None = None) -> float:
    """Seconds of communication per batch, Eqs. 1 (fsdp), 2 (hsdp), 4 (fl-fsdp) and 5 (fl-hsdp): M bits per
    collective, L sharded layers, B_S / B_R / B_F the bandwidths (bits/s) of the sharding, replication and federation
    groups. With F = 1 the FL terms vanish (as does Eq. 5's broadcast for R = 1)."""
    check_layout(method, S=S, R=R, F=F, A=A)
    _check_bandwidths(method, S, R, F, B_S, B_R, B_F)
    positive_int("L", L)
    if not M > 0:
        raise ConfigError(f"M (bits) must be positive, got {M!r}")
    t = (2 * all_gather_time(M, S, B_S) + reduce_scatter_time(M, S, B_S)) * L  # Eq. 1
    if method in ("hsdp", "fl-hsdp"):
        t += all_reduce_time(M, R, B_R) * L  # Eq. 2
    if method.startswith("fl-") and F > 1:
        t += all_reduce_time(M, F, B_F) * L / A  # Eq. 4
        if method == "fl-hsdp":
            t += broadcast_time(M, R, B_R) * L / A  # Eq. 5
    return t


def fl_comm_time(*, M: float, L: int, F: int, A: int = 1, B_F: float | None) -> float:
    """Eq. 3: plain decentralised FedAvg, one all-reduce per layer every A batches: C_AR(M, F) L / A."""
    for name, value in (("L", L), ("F", F), ("A", A)):
        positive_int(name, value)
    if not M > 0:
        raise ConfigError(f"M (bits) must be positive, got {M!r}")
    _check_bandwidth("B_F", B_F, F > 1, f"for F={F} > 1")
    return all_reduce_time(M, F, B_F) * L / A


def even_units(total_bytes: float, n: int, root: float = 0.0) -> Units:
    """`n` equal blocks holding `total_bytes`, plus a root unit of `root` bytes."""
    positive_int("number of units", n)
    return Units(blocks=(total_bytes / n,) * n, root=root)


def per_step(t: Traffic) -> dict[str, float]:
    """A rank's bytes per optimizer step with the sync amortised: step + sync / A, by tier."""
    return {tier: t.step[tier] + t.sync[tier] / t.A for tier in TIERS}


def states(m: MemoryBreakdown) -> float:
    """Parameters, gradients, optimizer and FL state: what stays between steps (and the gradients)."""
    return m.parameters + m.gradients + m.optimizer + m.sync + m.anchor
