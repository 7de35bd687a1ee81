"""One-run timing of the server path against the decentralised shard sync, on 4 local gloo ranks (F = 2, S = 2).

`python -m tests.flower.server_path_timing [MIB]`: a stack of Linear layers (MIB MiB of fp32 parameters) is sharded
with FSDP2 in each group; the decentralised `ShardSync.sync` is timed, then the server path on the same pre-sync
shards: each rank encodes its pieces (wire format), a server (here rank 0, after an all_gather_object that stands in
for the Flower transport and is NOT counted) decodes, validates and aggregates the two groups' replies, and each rank
writes back its own rows. Prints one JSON line. Flower's own message transport is excluded (see docs/server-path.md).
"""

from __future__ import annotations

import json
import sys
import time


def _worker(rank: int, world: int, mib: int):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from flwr_sharded.flower.server.aggregation import ShardReply, StreamingShardAggregator
    from flwr_sharded.parallel.shard_transport import decode_pieces, encode_pieces, shard_pieces
    from flwr_sharded.parallel.sync import ShardSync
    from tests.flower.test_server_path import mean_of, write_pieces

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fed", "shard"))
    fed = mesh.get_local_rank("fed")
    layers = 8
    width = int((mib * 2**20 / 4 / layers) ** 0.5)
    torch.manual_seed(fed)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    sync = ShardSync(model.named_parameters(), fed_group=mesh.get_group("fed"))
    sync.check_alignment()
    pre = shard_pieces(model.named_parameters(), clone=True)
    times = []
    for _ in range(3):
        write_pieces(model.named_parameters(), pre)
        dist.barrier()
        times.append(sync.sync(weight=1.0 + fed).seconds)
    decentralised = sorted(times)[1]

    write_pieces(model.named_parameters(), pre)
    dist.barrier()
    t0 = time.perf_counter()
    wire = encode_pieces(shard_pieces(model.named_parameters()))
    encode = time.perf_counter() - t0
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (fed, wire))  # stands in for the transport: not timed
    t0 = time.perf_counter()
    agg = StreamingShardAggregator(round=0)
    for f in (0, 1):
        agg.add(ShardReply(f"g{f}", 0, 1.0 + f, [p for g, w in everyone if g == f for p in decode_pieces(*w)]))
    agg.finalize()
    server = time.perf_counter() - t0
    t0 = time.perf_counter()
    write_pieces(model.named_parameters(), mean_of(agg, pre))
    apply = time.perf_counter() - t0
    return {"decentralised_s": decentralised, "encode_s": encode, "server_s": server, "apply_s": apply,
            "params": sum(p.numel() for p in model.parameters())}


if __name__ == "__main__":
    from tests.multiproc import run_ranks

    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    out = run_ranks(_worker, 4, mib, timeout=300)
    d = max(o["decentralised_s"] for o in out)
    s = max(o["encode_s"] for o in out) + out[0]["server_s"] + max(o["apply_s"] for o in out)
    print(json.dumps({"model_mib": mib, "params": out[0]["params"], "decentralised_sync_s": d,
                      "server_path_s_excluding_transport": s, "ratio": s / d,
                      "server_aggregation_s": out[0]["server_s"]}))
