"""One verdict of a fault check, on both paths: who is at fault, why, and which check found it.

The decentralised sync's admission (`flwr_sharded.parallel.admission`), the weight check both paths share
(`flwr_sharded.parallel.contribution`), the server path's per-chunk exclusions
(`flwr_sharded.flower.server.aggregation`) and the strikes that bench a group (`flwr_sharded.flower.server.membership`)
all speak `Verdict`.
A new fault check returns Verdicts of a new `kind` (added to `KINDS`). Pure Python (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable

WEIGHT = "weight"
"""The reported weight is not a finite number > 0, or not the tokens the round allows (`check_weight`)."""
NOT_FINITE = "not-finite"
"""Its values (or the mean they give) are NaN or infinite."""
MAGNITUDE = "magnitude"
"""Its largest |value| in a chunk is far above the others' (the server path's outlier test)."""
OVERFLOW = "overflow"
"""With it, the fp32 sums of a chunk would overflow."""
DROPPED = "dropped"
"""It did not answer a round (no reply, an error, a timeout)."""
NAMED = "named"
"""Most other members of the round named it at fault (absent, failed its part of a sync, left out of one)."""
KINDS = (WEIGHT, NOT_FINITE, MAGNITUDE, OVERFLOW, DROPPED, NAMED)


@dataclass(frozen=True)
class Verdict:
    """A member found at fault by one check."""

    member: Hashable
    """Who: an index in the federation group (decentralised sync), a reply's source or a node id (server)."""
    reason: str
    """Why, as a sentence for a log line (the log line names the member)."""
    kind: str
    """Which check (`KINDS`)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"verdict kind must be one of {', '.join(KINDS)}, got {self.kind!r}")


def reasons(verdicts: Iterable[Verdict]) -> dict:
    """member -> reason, in the verdicts' order (the first verdict on a member wins)."""
    out: dict = {}
    for v in verdicts:
        out.setdefault(v.member, v.reason)
    return out


__all__ = ["DROPPED", "KINDS", "MAGNITUDE", "NAMED", "NOT_FINITE", "OVERFLOW", "WEIGHT", "Verdict", "reasons"]
