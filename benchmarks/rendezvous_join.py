"""Join time of a round's federation group: 3 members (spawned gloo ranks on loopback), 10 rounds through one
group's rendezvous store; prints each round's slowest member and the median, and writes them with the run's
provenance to `--out`. Runs on the store of whichever commit is checked out (a TCPStore list before the
authenticated store, a StoreServer since).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/rendezvous_join.py [--out rendezvous_join.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from flwr_sharded_perf.provenance import provenance

from tests.flower.test_group import ROUND_SECRET
from tests.multiproc import run_ranks

ROUNDS = 10
MEMBERS = ["a", "b", "c"]


def _member(rank: int, world: int, port: int) -> list[float]:
    import torch
    import torch.distributed as dist

    from flwr_sharded.flower import rendezvous

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    seconds = []
    for r in range(ROUNDS):
        start = time.monotonic()
        group = rendezvous.join(host="127.0.0.1", port=port, prefix=f"run/round{r}/s0", rank=rank, size=world,
                                rendezvous_timeout=30, sync_timeout=30, secret=ROUND_SECRET, members=MEMBERS)
        seconds.append(time.monotonic() - start)
        value = torch.ones(1)
        dist.all_reduce(value, group=group.pg)
        assert value.item() == world
        group.destroy()
    return seconds


def main() -> None:
    from flwr_sharded.flower import rendezvous

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="results JSON")
    args = parser.parse_args()

    served = rendezvous.serve_stores("127.0.0.1", 1)
    if isinstance(served, list):  # the TCPStore of earlier commits
        port = served[0].port
    else:
        port = served.ports[0]
        for r in range(ROUNDS):
            served.open_round(f"run/round{r}", ROUND_SECRET, 1)
    out = run_ranks(_member, len(MEMBERS), port, timeout=300)
    slowest = [max(o[r] for o in out) for r in range(ROUNDS)]
    print("join s per round (slowest member):", " ".join(f"{s:.3f}" for s in slowest))
    print(f"median {statistics.median(slowest):.3f} s, first {slowest[0]:.3f} s")
    if args.out:
        Path(args.out).write_text(json.dumps({"provenance": provenance(), "join_s": slowest,
                                              "median_s": statistics.median(slowest)}, indent=1) + "\n")


if __name__ == "__main__":
    main()
