"""The benchmark's runs: each method's (F, R, S) on the emulated cluster, how an FL run syncs, their labels, and the
bytes of the model's FSDP2 units."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from flwr_sharded.config import METHODS
from flwr_sharded.errors import ConfigError
from flwr_sharded.perf.costmodel import Units, check_layout
from flwr_sharded.perf.netemu.network import EmuTopology

VARIANT_RUNS = ("fl-fsdp-overlap", "fl-fsdp-int8", "fl-fsdp-overlap-int8", "fl-fsdp-int4", "fl-fsdp-overlap-int4",
                "fl-fsdp-topk", "fl-fsdp-overlap-topk")
"""Runs of the FL+FSDP layout with another sync: overlapped (the run's dtype); the int8 and int4 wires and the top-k
sync (int8 values), all with error feedback; each of them overlapped too."""
WIRE_BYTES_TARGETS = {"int8": 0.27, "int4": 0.14, "topk": 0.04}
"""The most cross-group bytes per sync each variant's wire may send, as a fraction of the fp32 sync's."""
LABELS = {"fsdp": "FSDP", "hsdp": "HSDP", "fl-fsdp": "FL+FSDP", "fl-hsdp": "FL+HSDP", "no-sync": "FL+FSDP no-sync",
          "fl-fsdp-overlap": "FL+FSDP overlapped", "fl-fsdp-int8": "FL+FSDP int8",
          "fl-fsdp-overlap-int8": "FL+FSDP overlapped int8", "fl-fsdp-int4": "FL+FSDP int4",
          "fl-fsdp-overlap-int4": "FL+FSDP overlapped int4", "fl-fsdp-topk": "FL+FSDP top-k",
          "fl-fsdp-overlap-topk": "FL+FSDP overlapped top-k"}


@dataclass(frozen=True)
class BenchLayout:
    """One method's (F, R, S) on the emulated cluster; `group_shards`: each FL group's own S instead (an unequal
    federation, `--group-shards`; F is their number and S is 0)."""

    method: str
    F: int
    R: int
    S: int
    group_shards: tuple[int, ...] = ()

    @classmethod
    def unequal(cls, method: str, R: int, group_shards: tuple[int, ...]) -> BenchLayout:
        """F groups of R x S_g ranks, one S_g per group."""
        return cls(method, len(group_shards), R, 0, tuple(group_shards))

    @property
    def shards_per_group(self) -> tuple[int, ...]:
        return self.group_shards or (self.S,) * self.F

    @property
    def world(self) -> int:
        return self.R * sum(self.shards_per_group)

    def group_ranks(self) -> list[range]:
        """Each FL group's global ranks (consecutive blocks of R x S_g ranks)."""
        ends = [self.R * sum(self.shards_per_group[:g + 1]) for g in range(self.F)]
        return [range(end - self.R * S, end) for end, S in zip(ends, self.shards_per_group)]

    def text(self) -> str:
        if self.group_shards:
            return f"{self.F}x{self.R}x({','.join(map(str, self.group_shards))})"
        return f"{self.F}x{self.R}x{self.S}"

    def train_args(self, A: int, sync: SyncVariant | None = None) -> list[str]:
        fl = self.method.startswith("fl-")
        shape = (["--group-shards", ",".join(map(str, self.group_shards))] if self.group_shards else
                 ["--federations", str(self.F), "--shards", str(self.S)])
        return ["--method", self.method, *shape, "--replicas", str(self.R), "--aggregate-every", str(A if fl else 1),
                *((sync or SyncVariant()).train_args() if fl else [])]


@dataclass(frozen=True)
class SyncVariant:
    """How an FL run syncs: wire dtype, fragments, overlap (`flwr-sharded train --sync-*`)."""

    dtype: str = "float32"
    fragments: int = 1
    delay: int = 0
    alpha: float = 0.0
    carry: bool = False
    """Keep the local steps taken while an overlapped sync travels; passed explicitly whenever `delay` > 0."""
    error_feedback: bool = False
    topk: float | None = None
    """The fraction of each chunk's delta entries sent (`--sync-topk`); None: dense."""

    def train_args(self) -> list[str]:
        return ["--sync-dtype", self.dtype, "--sync-fragments", str(self.fragments), "--sync-delay", str(self.delay),
                "--sync-alpha", str(self.alpha),
                *([f"--{'' if self.carry else 'no-'}sync-carry"] if self.delay or self.carry else []),
                *(["--sync-error-feedback"] if self.error_feedback else []),
                *(["--sync-topk", f"{self.topk:g}"] if self.topk else [])]

    def text(self) -> str:
        wire = (f"top-{self.topk * 100:g}% " if self.topk else "") + self.dtype + " + EF" * self.error_feedback
        if not (self.fragments > 1 or self.delay):
            return f"{wire}, blocking"
        return f"{wire}, N={self.fragments} tau={self.delay} alpha={self.alpha:g}" + " carry" * self.carry


def variant_wire(key: str) -> str | None:
    """The wire a variant run is named after (int8, int4, topk), None for the run's own dtype."""
    wire = key.rsplit("-", 1)[-1]
    return wire if wire in WIRE_BYTES_TARGETS else None


def sync_variant(key: str, opts) -> SyncVariant:
    """The sync of run `key` under the benchmark's options: `--sync-dtype`, the overlapped runs' `--sync-fragments`,
    `--sync-delay`, `--sync-alpha` and `--sync-carry`, the top-k runs' `--sync-topk`."""
    overlap = dict(fragments=opts.sync_fragments, delay=opts.sync_delay, alpha=opts.sync_alpha,
                   carry=opts.sync_carry) if "overlap" in key else {}
    wire = variant_wire(key)
    if wire == "topk":
        return SyncVariant(dtype="int8", error_feedback=True, topk=opts.sync_topk, **overlap)
    return SyncVariant(dtype=wire, error_feedback=True, **overlap) if wire else SyncVariant(dtype=opts.sync_dtype,
                                                                                           **overlap)


def default_layouts(topo: EmuTopology) -> dict[str, BenchLayout]:
    """The paper's pattern: shard inside a node; HSDP replicates over nodes; FL+FSDP federates nodes; FL+HSDP
    replicates over the nodes of a group and federates groups (or halves of the nodes with a single group)."""
    P, N, W = topo.ranks_per_node, topo.nodes, topo.world_size
    out = {"fsdp": BenchLayout("fsdp", 1, 1, W)}
    if N > 1:
        out["hsdp"] = BenchLayout("hsdp", 1, N, P)
        out["fl-fsdp"] = BenchLayout("fl-fsdp", N, 1, P)
    if topo.groups > 1 and topo.nodes_per_group > 1:
        out["fl-hsdp"] = BenchLayout("fl-hsdp", topo.groups, topo.nodes_per_group, P)
    elif N >= 4 and N % 2 == 0:
        out["fl-hsdp"] = BenchLayout("fl-hsdp", 2, N // 2, P)
    return out


def parse_layouts(text: str | None, topo: EmuTopology) -> dict[str, BenchLayout]:
    """`fsdp=1x1x8,fl-fsdp=4x1x2`: overrides of the default layouts (F x R x S)."""
    layouts = default_layouts(topo)
    for item in text.split(",") if text else ():
        method, _, dims = item.strip().partition("=")
        if method not in METHODS:
            raise ConfigError(f"--layouts: unknown method {method!r} in {item!r}; use {', '.join(METHODS)}")
        try:
            F, R, S = (int(x) for x in dims.lower().split("x"))
        except ValueError:
            raise ConfigError(f"--layouts: expected METHOD=FxRxS such as fl-fsdp=4x1x2, got {item!r}") from None
        check_layout(method, S=S, R=R, F=F)
        if method in ("hsdp", "fl-hsdp") and R < 2 or method.startswith("fl-") and F < 2:
            raise ConfigError(f"--layouts: {item} is not a {method} layout (needs "
                              f"{'R > 1' if 'hsdp' in method else ''}{' and ' if method == 'fl-hsdp' else ''}"
                              f"{'F > 1' if method.startswith('fl-') else ''})")
        layouts[method] = BenchLayout(method, F, R, S)
    for layout in layouts.values():
        if layout.world != topo.world_size:
            raise ConfigError(f"--layouts: {layout.method} {layout.text()} has {layout.world} ranks, the emulated "
                              f"cluster {topo.world_size}")
    return layouts


def model_units(model_name: str, vocab_size: int, seq_len: int, S: int, bytes_per_param: int = 4) -> Units:
    """Units of the model the engine builds, each parameter's dim 0 padded to a multiple of S (as FSDP2 does)."""
    from flwr_sharded.training.models import build_model, transformer_blocks

    model = build_model(model_name, vocab_size=vocab_size, max_seq_len=seq_len)

    def padded(params) -> float:
        total = 0
        for p in params:
            rows = p.shape[0] if p.dim() else 1
            total += math.ceil(rows / S) * S * (p.numel() // max(rows, 1))
        return float(total * bytes_per_param)

    blocks = transformer_blocks(model)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    return Units(blocks=tuple(padded(b.parameters()) for b in blocks),
                 root=padded(p for p in model.parameters() if id(p) not in in_blocks))


def vocab_size_of(data_dir: str) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(Path(data_dir) / "tokenizer"))
