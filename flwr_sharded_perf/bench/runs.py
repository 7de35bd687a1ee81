"""The benchmark's runs: their layouts, syncs, labels and model units, and one run trained on the emulated cluster."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from flwr_sharded.config import METHODS
from flwr_sharded.errors import ConfigError
from flwr_sharded.parallel.sites import SiteLayout, why_not_two_level
from flwr_sharded.parallel.wire import sync_wire_ratio
from flwr_sharded_perf.costmodel import Units, check_layout
from flwr_sharded_perf.netemu.network import EmuTopology, Fabric, RankFailure
from flwr_sharded_perf.placement import Placement

VARIANT_RUNS = ("fl-fsdp-flat", "fl-fsdp-overlap", "fl-fsdp-int8", "fl-fsdp-overlap-int8",
                "fl-fsdp-overlap-int8-flat", "fl-fsdp-int4", "fl-fsdp-overlap-int4",
                "fl-fsdp-int2", "fl-fsdp-overlap-int2", "fl-fsdp-topk", "fl-fsdp-overlap-topk")
"""Runs of the FL+FSDP layout with another sync: a key ending in -flat syncs as the key before it over the flat ring of
every member (where the cluster's sites make the others two-level); overlapped (the run's dtype); the int8, int4 and
int2 wires and the top-k sync (`sync_variant`'s recipe), all with error feedback; each of them overlapped too."""
WIRE_BYTES_TARGETS = {"int8": 0.27, "int4": 0.14, "int2": 0.07, "topk": 0.04}
"""The most cross-group bytes per sync each variant's wire may send, as a fraction of the fp32 sync's."""
UNEQUAL_RUNS = ("equal", "unequal", "unequal-slow", "unequal-slow-speed")
"""The equal federation (as many groups of their mean S), the unequal one, and the unequal one with a slow group,
with equal local steps per sync (`--group-steps equal`) and with `--group-steps speed`."""
UNEQUAL_LABELS = {"equal": "equal federation", "unequal": "unequal federation",
                  "unequal-slow": "unequal, slow group, equal A",
                  "unequal-slow-speed": "unequal, slow group, --group-steps speed"}
LABELS = {"fsdp": "FSDP", "hsdp": "HSDP", "fl-fsdp": "FL+FSDP", "fl-hsdp": "FL+HSDP", "no-sync": "FL+FSDP no-sync",
          "fl-fsdp-flat": "FL+FSDP flat ring", "fl-fsdp-overlap-int8-flat": "FL+FSDP overlapped int8, flat ring",
          "fl-fsdp-overlap": "FL+FSDP overlapped", "fl-fsdp-int8": "FL+FSDP int8",
          "fl-fsdp-overlap-int8": "FL+FSDP overlapped int8", "fl-fsdp-int4": "FL+FSDP int4",
          "fl-fsdp-overlap-int4": "FL+FSDP overlapped int4", "fl-fsdp-int2": "FL+FSDP int2",
          "fl-fsdp-overlap-int2": "FL+FSDP overlapped int2", "fl-fsdp-topk": "FL+FSDP top-k",
          "fl-fsdp-overlap-topk": "FL+FSDP overlapped top-k"}


@dataclass(frozen=True)
class BenchLayout:
    """One method's (F, R, S) on the emulated cluster, or each FL group's own S (`group_shards`; S is then 0)."""

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
        shards = f"({','.join(map(str, self.group_shards))})" if self.group_shards else self.S
        return f"{self.F}x{self.R}x{shards}"

    def sites(self, ranks_per_node: int, nodes_per_site: int) -> SiteLayout:
        """The site of each FL group on the emulated cluster: the cluster group (the nodes behind one uplink) of its
        first rank."""
        return SiteLayout(tuple(str(ranks[0] // ranks_per_node // nodes_per_site) for ranks in self.group_ranks()))

    def train_args(self, A: int, sync: SyncVariant | None = None, sites: SiteLayout | None = None) -> list[str]:
        """The trainer's layout and sync options; `sites`: sync in two levels where they make two (FL methods)."""
        fl, sync = self.method.startswith("fl-"), sync or SyncVariant()
        shape = (["--group-shards", ",".join(map(str, self.group_shards))] if self.group_shards else
                 ["--federations", str(self.F), "--shards", str(self.S)])
        two_level = (fl and not sync.flat and sites is not None and not self.group_shards  # the runtime's conditions
                     and why_not_two_level(sites.sites, self.F, restart_residual=sync.restart == "residual") is None)
        return ["--method", self.method, *shape, "--replicas", str(self.R), "--aggregate-every", str(A if fl else 1),
                *(sync.train_args() if fl else []), *(["--sync-sites", ",".join(sites.sites)] if two_level else [])]


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
    restart: str = "global"
    """Where a group goes on from after a top-k sync (`--sync-restart`)."""
    dense_flush: bool = False
    """The run's last top-k sync sends every entry (`--sync-dense-flush`)."""
    error_decay: float | None = None
    """The top-k residual's decay (`--sync-error-decay`); None: the trainer's default."""
    flat: bool = False
    """The flat ring over every member even where the cluster's sites would make the sync two-level."""

    def train_args(self) -> list[str]:
        return ["--sync-dtype", self.dtype, "--sync-fragments", str(self.fragments), "--sync-delay", str(self.delay),
                "--sync-alpha", str(self.alpha),
                *([f"--{'' if self.carry else 'no-'}sync-carry"] if self.delay or self.carry else []),
                *(["--sync-error-feedback"] if self.error_feedback else []),
                *(["--sync-topk", f"{self.topk:g}"] if self.topk else []),
                *(["--sync-restart", self.restart] if self.restart != "global" else []),
                *(["--sync-dense-flush"] if self.dense_flush else []),
                *(["--sync-error-decay", f"{self.error_decay:g}"] if self.error_decay is not None else [])]

    def wire_ratio(self, groups: int, syncs: int) -> float:
        """Cross-group bytes per sync over the fp32 sync's, on average over `syncs` syncs (a dense flush's last one
        sends the dense wire's)."""
        sparse = sync_wire_ratio(self.dtype, self.topk, groups)
        if not (self.topk and self.dense_flush and syncs):
            return sparse
        return ((syncs - 1) * sparse + sync_wire_ratio(self.dtype)) / syncs

    def text(self) -> str:
        wire = (f"top-{self.topk * 100:g}% " if self.topk else "") + self.dtype + " + EF" * self.error_feedback + (
            ", restart at residual" if self.restart == "residual" else "") + ", dense flush" * self.dense_flush + (
            ", flat ring" * self.flat)
        if not (self.fragments > 1 or self.delay):
            return f"{wire}, blocking"
        return f"{wire}, N={self.fragments} tau={self.delay} alpha={self.alpha:g}" + " carry" * self.carry


def variant_wire(key: str) -> str | None:
    """The wire a variant run is named after (int8, int4, int2, topk), None for the run's own dtype."""
    wire = key.removesuffix("-flat").rsplit("-", 1)[-1]
    return wire if wire in WIRE_BYTES_TARGETS else None


def sync_variant(key: str, opts) -> SyncVariant:
    """The sync of run `key` under the benchmark's `--sync-*` options."""
    if key.endswith("-flat"):
        return dataclasses.replace(sync_variant(key.removesuffix("-flat"), opts), flat=True)
    overlap = dict(fragments=opts.sync_fragments, delay=opts.sync_delay, alpha=opts.sync_alpha,
                   carry=opts.sync_carry) if "overlap" in key else {}
    wire = variant_wire(key)
    if wire == "topk":
        return SyncVariant(dtype="int2", error_feedback=True, topk=opts.sync_topk, restart="residual",
                           dense_flush=True, error_decay=1.0, **overlap)
    return SyncVariant(dtype=wire, error_feedback=True, **overlap) if wire else SyncVariant(opts.sync_dtype, **overlap)


def default_layouts(topo: EmuTopology) -> dict[str, BenchLayout]:
    """The paper's pattern: shard in a node, replicate or federate nodes, FL+HSDP federates groups (or node halves)."""
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


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


PHASE_NAMES = ("forward", "backward", "optimizer", "sync")


def time_at(step: int, times: dict[int, float]) -> float:
    """Training time at `step` from the logged steps' `times`: the logged one, else prorated within the window that
    holds it (the run starts at step 0, time 0), else the last logged time."""
    if step in times:
        return times[step]
    before = max((s for s in times if s < step), default=0)
    after = min((s for s in times if s > step), default=None)
    start = times.get(before, 0.0)
    if after is None:
        return start
    return start + (times[after] - start) * (step - before) / (after - before)


def summarize_metrics(path: Path) -> dict[str, Any]:
    """Windows, curves and final perplexities from a run's JSON-lines metrics (rank 0). A curve's `time_s` is the
    training wall time up to its step: the sum of the logged windows' times, which hold the steps and the syncs they
    wait for and leave evaluation out (`StaticRun`)."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    config = next((r for r in records if r.get("kind") == "start"), {})
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    if not train:
        raise RuntimeError(f"{path}: no training windows logged")
    elapsed, prev_step, curve, times, windows = 0.0, 0, [], {}, []
    for r in train:
        n, prev_step = r["step"] - prev_step, r["step"]
        elapsed += r["step_s"] * n
        times[r["step"]] = elapsed
        curve.append({"step": r["step"], "time_s": elapsed, "loss": r["loss"], "ppl": r["ppl"]})
        windows.append({"steps": n, "step_s": r["step_s"], **{k: r.get(f"{k}_s", 0.0) for k in PHASE_NAMES}})
    eval_curve = [{"step": e["step"], "time_s": time_at(e["step"], times), "eval_ppl": e["eval_ppl"],
                   "eval_loss": e["eval_loss"]} for e in evals]
    return {"windows": windows, "syncs": train[-1].get("syncs", 0), "train": curve, "eval": eval_curve,
            "final": {"train_loss": train[-1]["loss"], "train_ppl": train[-1]["ppl"],
                      "eval_ppl": evals[-1]["eval_ppl"] if evals else None,
                      "eval_loss": evals[-1]["eval_loss"] if evals else None, "train_time_s": elapsed},
            "effective_batch": config.get("effective_batch"),
            "effective_batch_tokens": config.get("effective_batch_tokens"),
            "parameters": config.get("parameters")}


def step_stats(repeats: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Step time (median, mean, std, phase medians) over a run's repeats' windows, the warm-up windows left out."""
    steady = [w for windows in repeats for w in (windows[1:] or windows)]
    steps = sum(w["steps"] for w in steady)
    times = [w["step_s"] for w in steady]
    return {"step_s": _median(times), "step_s_mean": sum(w["step_s"] * w["steps"] for w in steady) / steps,
            "sync_s_mean": sum(w["sync"] * w["steps"] for w in steady) / steps,
            "step_s_std": statistics.pstdev(times) if len(times) > 1 else 0.0, "windows_used": len(steady),
            "phases": {k: _median([w[k] for w in steady]) for k in PHASE_NAMES},
            "phases_std": {k: statistics.pstdev([w[k] for w in steady]) if len(steady) > 1 else 0.0
                           for k in PHASE_NAMES}}


def run_training(fab: Fabric, layout: BenchLayout, opts: argparse.Namespace, *, A: int, steps: int,
                 sync: bool = True, label: str | None = None, log_every: int | None = None,
                 units: Units | None = None, work: Path, variant: SyncVariant | None = None,
                 extra_args: Sequence[str] = (), slow: str | None = None) -> dict[str, Any]:
    """Train one layout on the fabric (outputs under `work`); its summary, and with the model's `units` its measured
    and predicted traffic per tier. `variant`: how an FL layout syncs (default `--sync-dtype`, blocking); `slow`:
    GROUP:SECONDS, a group slowed down (`slow_train`). An FL run syncs in two levels where the cluster's sites make
    two (`BenchLayout.sites`) and the variant is not the flat ring; its traffic is predicted so."""
    from flwr_sharded_perf.traffic_report import compare, load_probes

    topo, label = fab.topology, label or layout.method
    run_dir = work / f"{label}-A{A}-{steps}"
    outputs, traffic_dir = run_dir / "run", run_dir / "traffic"
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(outputs, ignore_errors=True)
    variant = variant or SyncVariant(dtype=opts.sync_dtype)
    entry = ["flwr_sharded_perf.bench.slow_train", slow] if slow else ["flwr_sharded.train"]
    site_layout = layout.sites(topo.ranks_per_node, topo.nodes_per_group)
    train_args = layout.train_args(A, variant, site_layout if opts.sites == "cluster" else None)
    two_level = "--sync-sites" in train_args
    sites = site_layout if two_level else None
    argv = [sys.executable, "-m", *entry, *train_args, "--model", opts.model,
            "--seq-len", str(opts.seq_len), "--batch-size", str(opts.batch_size), "--steps", str(steps),
            "--lr", str(opts.lr), "--seed", str(opts.seed), "--log-every", str(log_every or A),
            "--eval-every", str(opts.eval_every), "--eval-blocks", str(opts.eval_blocks),
            "--data-dir", opts.data_dir, "--no-progress", "--run-dir", str(outputs), "--no-save-model",
            "--measure-traffic", str(traffic_dir), "--timeout", str(opts.collective_timeout),
            *([] if sync else ["--no-sync"]), *extra_args]
    for attempt in (1, 2):
        start, load_before = time.perf_counter(), os.getloadavg()[0]
        try:
            fab.run_ranks(argv, world=layout.world, timeout=opts.run_timeout, log_dir=run_dir / "logs")
            break
        except RankFailure as exc:  # a native abort (a signal) is run again once, and said; anything else stops
            if attempt == 2 or exc.code is None or exc.code >= 0:
                raise
            print(f"   {label}: {str(exc).splitlines()[0]}; running it again once")
            shutil.rmtree(outputs, ignore_errors=True)
            shutil.rmtree(traffic_dir, ignore_errors=True)
    wall, fl = time.perf_counter() - start, layout.method.startswith("fl-")
    summary = summarize_metrics(outputs / "metrics.jsonl")
    out = {"label": label, "method": layout.method, "layout": layout.text(), "F": layout.F, "R": layout.R,
           "S": layout.S, "A": A if fl else 1, "sync": sync, "steps": steps,
           "sync_sites": ",".join(site_layout.sites) if two_level else None,
           "sync_variant": dataclasses.asdict(variant) if fl else None, "wall_s": wall,
           "attempts": attempt, "run_dir": str(run_dir), "load_avg": [load_before, os.getloadavg()[0]], **summary,
           **step_stats([summary["windows"]]), "repeats": 1}
    if units is not None:
        placement = Placement(F=layout.F, R=layout.R, S=layout.S, gpus_per_node=topo.ranks_per_node,
                              nodes_per_group=topo.nodes_per_group)
        cmp = compare(load_probes(traffic_dir), layout.method, placement, units, A=out["A"], backend="gloo",
                      reshard_root=True, ranks_per_node=topo.ranks_per_node, uplinks=topo.uplinks(),
                      wire_ratio=variant.wire_ratio(layout.F, steps // out["A"]),  # over the fp32 units
                      fragments=variant.fragments, sites=sites,
                      stage_ratio=1.0 if sites is not None else None)  # the fp32 units are the sync's staging
        out.update(traffic=cmp.to_dict(), traffic_max_error=cmp.max_error())
    return out
