"""8-bit quantized all-reduce against bf16 and fp32 all-reduces of the same flat fp32 tensor, on local gloo ranks.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/quantize_bench.py --mb 32

Each repeat times, interleaved, on the same fp32 tensor of --mb MB (refilled before every op, untimed):
  fp32       dist.all_reduce of the tensor
  bf16       cast into a reused bf16 buffer, all_reduce it, cast back into the tensor (fp32 in and out, as the
             shard sync's bf16 wire does)
  bf16_bare  all_reduce of a tensor that already is bf16 (no casts)
  int8       quantized_all_reduce with a reused Workspace
  int8_ef    the same with error feedback
  fp8        the same with float8_e4m3fn, where check_wire_dtype allows it on this device
and, to split the time, two parts of these on their own:
  int8_wire  only int8's communication (W - 1 ring steps, all_gather_single) of the same uint8 rows
  bf16_casts only the bf16 wire's two casts (fp32 -> bf16 -> fp32), no collective
An op's time is the slowest rank's (a barrier before each). Rank 0 prints one JSON line: medians in ms, ratios to
bf16, bytes one rank sends, the 1-minute load average before and after, and the torch profiler's top ops of the
int8 call (self CPU ms per call, averaged over --repeats calls), which shows where the time goes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as dist

from flwr_sharded_perf.provenance import provenance


def parse() -> argparse.Namespace:
    from flwr_sharded import schema
    from flwr_sharded.parallel.wire import QUANT_BLOCK

    p = argparse.ArgumentParser(description=__doc__, formatter_class=schema.HelpFormatter)
    p.add_argument("--mb", type=float, default=32.0, help="size of the fp32 tensor in MB")
    p.add_argument("--repeats", type=int, default=7, help="timed samples of each operation")
    p.add_argument("--block", type=int, default=QUANT_BLOCK, help="values per fp32 scale (the wire's)")
    p.add_argument("--out", default=None, help="also write the JSON line here (rank 0)")
    return p.parse_args()


def main() -> None:
    args = parse()
    from flwr_sharded.parallel.global_state import ErrorFeedback
    from flwr_sharded.parallel.ring import all_reduce_bytes, quantized_all_reduce
    from flwr_sharded.parallel.workspace import Workspace
    from flwr_sharded.parallel.torch_compat import all_gather_single
    from flwr_sharded.parallel.wire import check_wire_dtype

    load_before = os.getloadavg()[0]
    dist.init_process_group("gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world = dist.get_rank(), dist.get_world_size()
    n = int(args.mb * 2**20) // 4
    src = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    flat, wire, bare = src.clone(), torch.empty(n, dtype=torch.bfloat16), src.to(torch.bfloat16)
    ws, feedback = Workspace(), ErrorFeedback()

    def bf16() -> None:
        wire.copy_(flat)
        dist.all_reduce(wire)
        flat.copy_(wire)

    ops = {"fp32": lambda: dist.all_reduce(flat), "bf16": bf16, "bf16_bare": lambda: dist.all_reduce(bare),
           "int8": lambda: quantized_all_reduce(flat, dtype=torch.int8, block=args.block, workspace=ws),
           "int8_ef": lambda: quantized_all_reduce(flat, dtype=torch.int8, block=args.block, workspace=ws,
                                                   residual=feedback.residual(0, flat))}
    bpr = math.ceil(math.ceil(n / args.block) / world)
    row = bpr * args.block + 4 * bpr
    rows, send, received = (torch.zeros(world * row, dtype=torch.uint8), torch.zeros(row, dtype=torch.uint8),
                            torch.empty(row, dtype=torch.uint8))

    def int8_wire() -> None:
        for _ in range(world - 1):
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, (rank + 1) % world),
                                                dist.P2POp(dist.irecv, received, (rank - 1) % world)]):
                work.wait()
        all_gather_single(rows, send)

    def bf16_casts() -> None:
        wire.copy_(flat)
        flat.copy_(wire)

    ops.update({"int8_wire": int8_wire, "bf16_casts": bf16_casts})
    try:
        ops["fp8"] = lambda: quantized_all_reduce(flat, dtype=check_wire_dtype("float8_e4m3fn", "cpu"),
                                                  block=args.block, workspace=ws)
    except ValueError:
        pass
    times: dict[str, list[float]] = {name: [] for name in ops}
    for repeat in range(args.repeats + 1):  # the first round warms up (buffers, connections) and is dropped
        for name, op in ops.items():
            flat.copy_(src)
            dist.barrier()
            start = time.perf_counter()
            op()
            slowest = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if repeat:
                times[name].append(float(slowest) * 1e3)

    from torch.profiler import ProfilerActivity, profile

    flat.copy_(src)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.repeats):  # no refill in between: the sum grows W-fold per call, far from overflow
            ops["int8"]()
    top = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    median = {name: round(statistics.median(t), 2) for name, t in times.items()}
    result = {
        "world": world, "mb": args.mb, "numel": n, "block": args.block, "repeats": args.repeats,
        "threads": torch.get_num_threads(), "median_ms": median,
        "ratio_to_bf16": {name: round(m / median["bf16"], 3) for name, m in median.items()},
        "ratio_to_bf16_bare": {name: round(m / median["bf16_bare"], 3) for name, m in median.items()},
        "bytes_sent": {"fp32_ring": int(2 * (world - 1) / world * 4 * n),
                       "bf16_ring": int(2 * (world - 1) / world * 2 * n),
                       "int8": all_reduce_bytes(n, world, torch.int8, args.block)},
        "int8_profile_self_ms": {e.key: round(e.self_cpu_time_total / 1e3 / args.repeats, 2) for e in top},
        "load_avg": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "provenance": provenance(),
    }
    if rank == 0:
        line = json.dumps(result)
        print(line, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(line + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
