"""Which parts of its shards a rank averages with which ranks of the other groups, when groups shard differently.

FSDP2 shards dim 0: of a parameter of n rows, shard s of S holds rows [s c, (s + 1) c), c = ceil(n / S) (the last
ones may hold fewer, or none). The common refinement of all groups' cuts splits a parameter into pieces that each lie
in one shard of every group; a piece's owners (that shard index in each group) average it among themselves,
exchanging only the overlapping rows, and no model is gathered. Pieces with the same owners, of any parameter, form
one channel (one process group, one set of buckets). Equal groups give one channel per shard index: the plain
shard-to-shard sync. Pure Python: the static engine, a Flower round's strategy and the cost model share it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from math import prod
from typing import Sequence

Owners = tuple[int, ...]
"""A channel's key: the shard index of its owner in each group, in group order."""


def shard_rows(rows: int, shards: int, index: int) -> tuple[int, int]:
    """Rows [start, end) of a parameter of `rows` rows that shard `index` of `shards` holds (FSDP2's chunking)."""
    chunk = -(-rows // shards) if rows else 0
    start = min(index * chunk, rows)
    return start, min(start + chunk, rows)


def owner_of(row: int, rows: int, shards: int) -> int:
    """The shard index that holds `row` of a parameter of `rows` rows sharded `shards` ways."""
    return row // -(-rows // shards)


@dataclass(frozen=True)
class Piece:
    """Rows [start, end) of parameter `param`, held by shard `owners[g]` of every group g."""

    param: int
    start: int
    end: int
    owners: Owners


def pieces_of(rows: int, layouts: Sequence[int]) -> list[tuple[int, int, Owners]]:
    """The common refinement of the groups' cuts of one parameter of `rows` rows: (start, end, owners) in row order."""
    cuts = {0, rows}
    for shards in layouts:
        cuts.update(shard_rows(rows, shards, s)[0] for s in range(shards))
    bounds = sorted(c for c in cuts if c <= rows)
    return [(a, b, tuple(owner_of(a, rows, shards) for shards in layouts)) for a, b in zip(bounds, bounds[1:])]


@dataclass(frozen=True)
class SyncPlan:
    """The pieces of a model's parameters under groups that shard it `layouts[g]` ways each.

    Args:
        layouts: each group's sharding degree S, in member order.
        shapes: every parameter's global shape, in the order every group syncs them.
    """

    layouts: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not self.layouts or min(self.layouts) < 1:
            raise ValueError(f"a sync plan needs groups of at least one shard, got {list(self.layouts)}")

    @property
    def equal(self) -> bool:
        """Whether every group shards alike (one channel per shard index: the plain shard-to-shard sync)."""
        return len(set(self.layouts)) == 1

    def pieces(self) -> list[Piece]:
        """Every parameter's pieces, parameter by parameter, in row order."""
        return list(self._pieces)

    @cached_property
    def _pieces(self) -> tuple[Piece, ...]:
        return tuple(Piece(i, a, b, owners) for i, shape in enumerate(self.shapes)
                     for a, b, owners in pieces_of(rows_of(shape), self.layouts))

    def channels(self) -> list[Owners]:
        """The distinct owner tuples in the one order every rank runs its channels in (a common order of blocking
        collectives cannot deadlock): rounds of channels sharing no owner (they run at once), each sorted. Sorting
        alone would chain every channel behind the one before when cuts do not nest (S = 2 and 3)."""
        return list(self._channels)

    @cached_property
    def _channels(self) -> tuple[Owners, ...]:
        rounds: list[list[Owners]] = []
        for key in sorted({p.owners for p in self._pieces}):
            free = next((r for r, keys in enumerate(rounds)
                         if all(all(a != b for a, b in zip(key, other)) for other in keys)), len(rounds))
            if free == len(rounds):
                rounds.append([])
            rounds[free].append(key)
        return tuple(key for keys in rounds for key in keys)

    def channels_of(self, group: int, shard: int) -> list[Owners]:
        """The channels shard `shard` of group `group` takes part in, in the common order."""
        return [c for c in self.channels() if c[group] == shard]

    def local_ranges(self, group: int, shard: int) -> dict[Owners, list[tuple[int, int, int]]]:
        """Per channel of this rank: (param, first element, end element) ranges of its local shards, in order."""
        out: dict[Owners, list[tuple[int, int, int]]] = {}
        for p in self._pieces:
            if p.owners[group] != shard or p.end == p.start:
                continue
            row = row_numel(self.shapes[p.param])
            first = shard_rows(rows_of(self.shapes[p.param]), self.layouts[group], shard)[0]
            out.setdefault(p.owners, []).append((p.param, (p.start - first) * row, (p.end - first) * row))
        return {c: out[c] for c in self.channels() if c in out}

    def describe(self, owners: Owners, names: Sequence[str], dtypes: Sequence[str]) -> list[str]:
        """What channel `owners` syncs, piece by piece (every member of the channel must describe it alike)."""
        return [f"{names[p.param]}|{tuple(self.shapes[p.param])}|{dtypes[p.param]}|rows {p.start}:{p.end}|groups "
                f"S={list(self.layouts)}" for p in self._pieces if p.owners == owners]

    def expected_numel(self, param: int, group: int, shard: int) -> int:
        """Elements of parameter `param` that shard `shard` of group `group` holds."""
        shape = self.shapes[param]
        start, end = shard_rows(rows_of(shape), self.layouts[group], shard)
        return (end - start) * row_numel(shape)

    def elements(self) -> int:
        """Elements of the model (every piece counted once)."""
        return sum(prod(shape) for shape in self.shapes)

    def shard_elements(self, group: int, shard: int) -> int:
        """Elements shard `shard` of group `group` holds."""
        return sum(self.expected_numel(i, group, shard) for i in range(len(self.shapes)))


@dataclass(frozen=True)
class Seat:
    """Where a rank sits in a federation of groups that shard differently."""

    layouts: tuple[int, ...]
    """Every group's sharding degree S, in member order."""
    group: int
    """This rank's group (its member index)."""
    shard: int
    """This rank's shard index in its group."""

    def __post_init__(self) -> None:
        if not 0 <= self.group < len(self.layouts) or not 0 <= self.shard < self.layouts[self.group]:
            raise ValueError(f"shard {self.shard} of group {self.group} is not a seat of groups S={list(self.layouts)}")


def rows_of(shape: Sequence[int]) -> int:
    """Rows of the dimension FSDP2 shards (a scalar counts as one row)."""
    return int(shape[0]) if len(shape) else 1


def row_numel(shape: Sequence[int]) -> int:
    """Elements in one row of that dimension."""
    return prod(int(d) for d in shape[1:]) if len(shape) else 1


def channel_ranks(owners: Owners, bases: Sequence[int]) -> list[int]:
    """Global ranks of a channel's owners: replica 0 of group g is ranks bases[g] .. bases[g] + S_g - 1."""
    return [base + s for base, s in zip(bases, owners)]


__all__ = ["Owners", "Piece", "Seat", "SyncPlan", "channel_ranks", "owner_of", "pieces_of", "row_numel", "rows_of",
           "shard_rows"]
