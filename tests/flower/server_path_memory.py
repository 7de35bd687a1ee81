"""Peak memory of the server path's aggregation, measured as RSS in a fresh process.

`python -m tests.flower.server_path_memory F MODE [MIB]`: F groups (S = 2) send a MIB-MiB fp32 model (32 equal
parameters), one reply at a time, to a `StreamingShardAggregator` (FedAvg). MODE: `fp32-group` (one reply per group),
`fp32-rank` (one reply per rank), `bf16-group`. Prints one JSON line: peak RSS over the baseline, the largest reply,
and their difference (what the aggregator itself holds), each also as a multiple of one fp32 model. Run it with
`MALLOC_MMAP_THRESHOLD_=65536` so freed tensors go back to the OS and the peak means something.
"""

from __future__ import annotations

import gc
import json
import resource
import sys
import time

import torch

from flwr_sharded.flower.server.aggregation import ParamSpec, ShardReply, StreamingShardAggregator
from flwr_sharded.parallel.shard_transport import ShardPiece, decode_pieces, encode_pieces

S, PARAMS = 2, 32


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(F: int, mode: str, mib: int = 64) -> dict:
    torch.set_num_threads(1)
    dtype = torch.bfloat16 if mode.startswith("bf16") else torch.float32
    cols = 1024
    rows = mib * 2**20 // (4 * cols * PARAMS)
    spec = {f"p{i}": ParamSpec((rows, cols), dtype) for i in range(PARAMS)}
    fp32_bytes = PARAMS * rows * cols * 4
    gc.collect()
    base = _rss()
    agg = StreamingShardAggregator(round=0, spec=spec, complete=(mode != "fp32-rank"))

    def replies(f: int):  # one reply alive at a time, as the wire format would hand it over
        gen = torch.Generator().manual_seed(f)
        half = rows // S
        ranks = [[(n, r) for n in spec] for r in range(S)] if mode == "fp32-rank" else [[(n, r) for n in spec
                                                                                          for r in range(S)]]
        for k, keys in enumerate(ranks):
            pieces = [ShardPiece(n, r * half, (rows, cols), torch.randn(half, cols, generator=gen).to(dtype))
                      for n, r in keys]
            arrays, meta = encode_pieces(pieces)
            del pieces
            reply = ShardReply(f"g{f}/{k}", 0, 1.0, decode_pieces(arrays, meta))
            del arrays, meta
            yield reply
            del reply

    largest = 0
    start = time.perf_counter()
    for f in range(F):
        for reply in replies(f):
            largest = max(largest, sum(p.data.numel() * p.data.element_size() for p in reply.pieces))
            assert agg.add(reply)
            del reply
    agg.finalize()
    seconds = time.perf_counter() - start
    peak = _peak() - base
    return {"F": F, "mode": mode, "fp32_model_mib": fp32_bytes / 2**20, "peak_mib": peak / 2**20,
            "peak_x": peak / fp32_bytes, "largest_reply_x": largest / fp32_bytes,
            "aggregator_x": (peak - largest) / fp32_bytes, "seconds": seconds}


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]), sys.argv[2], *(int(a) for a in sys.argv[3:]))))
