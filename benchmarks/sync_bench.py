"""Shard-sync cost against a raw flat all-reduce of the same bytes and against one all-reduce per parameter.

    torchrun --nproc-per-node 4 benchmarks/sync_bench.py --federations 2 --shards 2 --layers 16 --hidden 64

Builds a Llama shape sharded with FSDP2 on an (F, 1, S) mesh, then times, interleaved and repeated:
  sync      ShardSync.sync (bucketed, token-weighted FedAvg over the federation group)
  flat      one all-reduce of one preallocated flat buffer holding as many bytes as the rank's shards
  per-param one all-reduce per local shard (what a naive implementation issues)
  sync-bf16, sync-int8, sync-int8-ef, sync-int4, sync-int4-ef   the same model's sync through a bf16, int8 or int4
            wire (weighted deltas from the global shards; with and without error feedback), shards moved a little
            between samples
  sync-topk-int8-ef   the top-k sync (`--sync-topk`, --sync-topk of each chunk, int8 values, error feedback)
  sync-unchecked, sync-int8-unchecked   sync and sync-int8 without the plausibility check of their result
            (`--sync-max-move 0`): what checking each bucket's move costs
  sync-median, sync-trimmed-mean   the robust rules (`--outer median`, `--outer trimmed-mean` with trim 1, which
            needs F >= 3): each bucket all-gathered from every group instead of all-reduced
and measures the peak extra memory the sync allocates (torch profiler memory events) against one bucket, for the
fedavg sync and each robust rule, and the bytes one sync of each of them sends on a ring (the traffic meter's
records, `flwr_sharded_perf.traffic_report.ring_bytes_sent`).
Rank 0 prints medians and ratios and writes them as JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from dataclasses import dataclass

import torch
import torch.distributed as dist

from flwr_sharded import schema, tool_options
from flwr_sharded.config import ParallelConfig
from flwr_sharded.schema import same_as
from flwr_sharded_perf.provenance import provenance


@dataclass
class SyncLayout:
    """The trainer's options the sync runs with."""

    federations: int = same_as(ParallelConfig, "federations", default=2)
    shards: int = same_as(ParallelConfig, "shards", default=2)
    bucket_mb: float = same_as(ParallelConfig, "bucket_mb")
    sync_topk: float = same_as(ParallelConfig, "sync_topk", default=0.02)
    """The top-k variant's fraction of each chunk (int8 values, error feedback)."""


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=schema.HelpFormatter)
    schema.add_arguments(p, SyncLayout)
    p.add_argument("--layers", type=int, default=16, help="transformer blocks of the model")
    p.add_argument("--hidden", type=int, default=64, help="width of the model")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary of the model")
    p.add_argument("--repeats", type=int, default=20, help="timed samples of each variant")
    p.add_argument("--out", default=None, help="write the results as JSON here (rank 0)")
    return tool_options.parse_args(p, SyncLayout)


def peak_extra_bytes(fn) -> int:
    """Peak of (bytes allocated - bytes freed) by torch while `fn` runs, from profiler memory events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    level = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        level += e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage  # net bytes, no double count
        peak = max(peak, level)
    return peak


def sent_by_one_call(fn, group) -> float:
    """Bytes this rank sends on a ring for the collectives of one call of `fn` (every collective of a sync runs
    over the federation group `group`), from the traffic meter's records."""
    from flwr_sharded.parallel.traffic import TrafficMeter
    from flwr_sharded_perf.traffic_report import ring_bytes_sent

    n = dist.get_world_size(group)
    with TrafficMeter() as meter:
        fn()
    return sum(ring_bytes_sent(r.op, r.nbytes, n) for r in meter.records)


def main() -> None:
    args = parse()
    from transformers import LlamaConfig, LlamaForCausalLM

    from flwr_sharded.config import ParallelConfig
    from flwr_sharded.parallel.sharding import apply_fsdp, mixed_precision_policy
    from flwr_sharded.training.models import transformer_blocks
    from flwr_sharded.parallel.alignment import local_shard
    from flwr_sharded.parallel.sync import ShardSync
    from flwr_sharded.parallel.wire import sync_wire
    from flwr_sharded.parallel.topology import init_topology

    topo = init_topology(ParallelConfig(method="fl-fsdp", federations=args.federations, shards=args.shards))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=args.hidden * 3,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    model = apply_fsdp(model, transformer_blocks(model), topo.fsdp_mesh,
                       mp_policy=mixed_precision_policy("fp32", "cpu"))
    sync = ShardSync(model.named_parameters(), fed_group=topo.fed_group, bucket_bytes=int(args.bucket_mb * 2**20))
    sync.check_alignment()
    shards = [local_shard(p) for p in model.parameters()]
    shard_bytes = sum(s.numel() * s.element_size() for s in shards)
    flat = torch.zeros(shard_bytes // 4, dtype=torch.float32)
    group = topo.fed_group

    def run_sync() -> None:
        sync.sync(weight=1.0 + topo.fed_index)

    def run_flat() -> None:
        dist.all_reduce(flat, group=group)

    def run_per_param() -> None:
        for s in shards:
            dist.all_reduce(s, group=group)

    weight = torch.ones(1, dtype=torch.float64)

    def run_flat_and_scalar() -> None:
        dist.all_reduce(weight, group=group)
        dist.all_reduce(flat, group=group)

    unchecked = ShardSync(model.named_parameters(), fed_group=topo.fed_group,
                          bucket_bytes=int(args.bucket_mb * 2**20), max_move=0.0)
    unchecked.check_alignment()
    # time in the member's own verdict (before the reduction) and in the result's check, the whole check: per sync
    # (a verdict opens a sync, each bucket's check adds to it)
    check_s: dict[str, list[float]] = {}

    from flwr_sharded.parallel import sync as sync_module
    from flwr_sharded.parallel.plausibility import MoveBound

    current: list[list[float] | None] = [None]  # the check times of the sync running now

    def timed(fn):  # noqa: ANN001, ANN202 - a check's own arguments
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            if current[0] is not None:
                current[0][-1] += time.perf_counter() - t0
            return out
        return wrapper

    for name in ("bucket_norms", "healthy", "all_finite"):  # the verdict before the reduction, a result's finiteness
        setattr(sync_module, name, timed(getattr(sync_module, name)))
    MoveBound.plausible = timed(MoveBound.plausible)  # a bucket's result, against this rank's values

    def timed_checks(name: str, instance: ShardSync) -> None:
        into, start = check_s.setdefault(name, []), instance.start

        def opening(*a, **k):  # noqa: ANN002, ANN003
            into.append(0.0)
            current[0] = into
            return start(*a, **k)

        instance.start = opening

    timed_checks("sync", sync)
    timed_checks("sync-unchecked", unchecked)
    runs = {"sync": run_sync, "sync-unchecked": lambda: unchecked.sync(weight=1.0 + topo.fed_index),
            "flat": run_flat, "per-param": run_per_param, "flat+scalar": run_flat_and_scalar}
    # the same model's sync through the reduced wires: each group's weighted delta from the global shards
    for name, dtype, feedback, max_move, topk in (("sync-bf16", "bfloat16", False, None, None),
                                                  ("sync-int8", "int8", False, None, None),
                                                  ("sync-int8-unchecked", "int8", False, 0.0, None),
                                                  ("sync-int8-ef", "int8", True, None, None),
                                                  ("sync-int4", "int4", False, None, None),
                                                  ("sync-int4-ef", "int4", True, None, None),
                                                  ("sync-topk-int8-ef", "int8", True, None, args.sync_topk)):
        checks = {} if max_move is None else {"max_move": max_move}
        wired = ShardSync(model.named_parameters(), fed_group=topo.fed_group,
                          bucket_bytes=int(args.bucket_mb * 2**20), wire=sync_wire(dtype, topk),
                          error_feedback=feedback, **checks)
        wired.check_alignment()
        wired.capture_global()
        if name in ("sync-int8", "sync-int8-unchecked"):
            timed_checks(name, wired)
        runs[name] = (lambda w: lambda: w.sync(weight=1.0 + topo.fed_index))(wired)
    from flwr_sharded.parallel.rules import make_rule

    robust = {"sync-median": lambda: make_rule("median")}
    if args.federations >= 3:
        robust["sync-trimmed-mean"] = lambda: make_rule("trimmed-mean", trim=1)
    for name, rule in robust.items():
        ruled = ShardSync(model.named_parameters(), fed_group=topo.fed_group,
                          bucket_bytes=int(args.bucket_mb * 2**20), rule=rule())
        ruled.check_alignment()
        runs[name] = (lambda r: lambda: r.sync(weight=1.0 + topo.fed_index))(ruled)
    noise = torch.Generator().manual_seed(topo.fed_index)
    times: dict[str, list[float]] = {k: [] for k in runs}
    def keep_scale(name: str) -> None:
        """Untimed, after per-param: its all-reduce sums; the mean keeps the model's scale (and its moves)."""
        if name == "per-param":
            with torch.no_grad():
                for s in shards:
                    s.div_(args.federations)

    for name, fn in runs.items():  # warm-up
        fn()
        keep_scale(name)
    for spent in check_s.values():
        spent.clear()  # the timed syncs' checks only
    for _ in range(args.repeats):
        for name, fn in runs.items():
            with torch.no_grad():  # untimed: the groups drift apart a little, so every delta is non-zero
                for s in shards:
                    s.add_(torch.randn(s.shape, generator=noise), alpha=1e-3)
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            keep_scale(name)
    check_per_sync = {k: statistics.median(v) for k, v in check_s.items()}
    # the slowest rank decides a collective's time: take the max over ranks of each sample
    stacked = torch.tensor([times[k] for k in runs], dtype=torch.float64)
    dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
    wires = ("sync-int8-ef", "sync-int4-ef", "sync-topk-int8-ef")
    sent = {name: sent_by_one_call(runs[name], group) for name in ("sync", *robust, *wires)}
    # a fresh ShardSync, so that its first sync allocates its bucket inside the measured window
    peak_of = {}
    for name, rule in {"sync": lambda: None, **robust}.items():
        fresh = ShardSync(model.named_parameters(), fed_group=topo.fed_group,
                          bucket_bytes=int(args.bucket_mb * 2**20), rule=rule())
        fresh.check_alignment()
        peak_of[name] = peak_extra_bytes(lambda: fresh.sync(weight=1.0))
    bucket = min(int(args.bucket_mb * 2**20), shard_bytes)
    peaks = torch.tensor(list(peak_of.values()), dtype=torch.int64)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    peak_of = dict(zip(peak_of, peaks.tolist()))
    if dist.get_rank() == 0:
        med = {k: statistics.median(stacked[i].tolist()) for i, k in enumerate(runs)}
        result = {
            "layout": topo.describe(), "param_tensors": len(shards), "shard_bytes_per_rank": shard_bytes,
            "buckets": len(sync.layout.buckets), "repeats": args.repeats,
            "median_s": med,
            "sync_over_flat": med["sync"] / med["flat"],
            "checked_over_unchecked": med["sync"] / med["sync-unchecked"],
            "check_s_per_sync": check_per_sync,  # rank 0's median time per sync in its verdict and the result's check
            "check_overhead_of_sync": (check_per_sync["sync"] - check_per_sync["sync-unchecked"]) / med["sync"],
            "int8_checked_over_unchecked": med["sync-int8"] / med["sync-int8-unchecked"],
            "int8_check_overhead_of_sync": (check_per_sync["sync-int8"] - check_per_sync["sync-int8-unchecked"])
            / med["sync-int8"],
            "per_param_over_sync": med["per-param"] / med["sync"],
            "int8_over_bf16_sync": med["sync-int8"] / med["sync-bf16"],
            "int8_ef_over_bf16_sync": med["sync-int8-ef"] / med["sync-bf16"],
            "int4_over_int8_sync": med["sync-int4"] / med["sync-int8"],
            "int4_ef_over_int8_ef_sync": med["sync-int4-ef"] / med["sync-int8-ef"],
            "topk_over_int8_ef_sync": med["sync-topk-int8-ef"] / med["sync-int8-ef"], "topk": args.sync_topk,
            "peak_extra_bytes": peak_of["sync"], "one_bucket_bytes": bucket,
            "peak_over_bucket": peak_of["sync"] / bucket,
            "robust": {name: {"median_s": med[name], "over_sync_s": med[name] / med["sync"],
                              "sent_bytes": sent[name], "sent_over_sync": sent[name] / sent["sync"],
                              "peak_extra_bytes": peak_of[name], "peak_over_bucket": peak_of[name] / bucket}
                       for name in robust},
            "sync_sent_bytes": sent["sync"],
            "wires_sent_over_fp32": {name: sent[name] / sent["sync"] for name in wires},
            "provenance": provenance(),
        }
        print(json.dumps(result, indent=2))
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(result, fh, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # torch 2.13: a process that ran the profiler after gloo collectives aborts in about 4 exits out of 10 while
    # tearing down ("terminate called without an active exception"), even after destroy_process_group. Everything
    # is written and flushed by now: leave without running static destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
