"""What the plausibility check costs one rank per sync on the healthy path, in one process (no collective).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plausibility_cost.py --layers 8 --hidden 256 --shards 2

One bucket holding a rank's shards of a Llama-shaped model (every parameter's rows split over S, as FSDP2 shards them;
fp32), its "result" a slightly moved copy in a separate buffer laid out as the sync's flat bucket. Interleaved,
`--repeats` times: the check as the sync runs it (`bucket_norms` of the own values before the reduction, then
`MoveBound.plausible` on the result and its flat bucket, with an adopted history, so the bound is the one of a running federation)
against the sync without it (`max_move=0`: a finiteness sum of the own values and one of the result). Prints the
median milliseconds of each and of the check's parts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from flwr_sharded.parallel import plausibility
from flwr_sharded.parallel.admission import all_finite
from flwr_sharded.parallel.plausibility import MoveBound, bucket_norms
from flwr_sharded_perf.provenance import provenance


def llama_segments(layers: int, hidden: int, shards: int, vocab: int = 8192) -> list[int]:
    """Elements of one rank's shard of each parameter (rows split over `shards`, the last shard the smallest)."""
    inter, kv = int(hidden * 2.6875), hidden // 2
    shapes = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inter, hidden), (inter, hidden),
                   (hidden, inter), (hidden,), (hidden,)]
    shapes += [(hidden,), (vocab, hidden)]
    out = []
    for shape in shapes:
        rows = -(-shape[0] // shards)
        out.append(rows * (shape[1] if len(shape) > 1 else 1))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--out", default="", help="result JSON (none when empty)")
    args = p.parse_args()
    torch.manual_seed(0)
    sizes = llama_segments(args.layers, args.hidden, args.shards)
    own = [torch.randn(n) for n in sizes]
    flat = torch.cat(own) + 1e-3 * torch.randn(sum(sizes))  # the result, in the sync's flat buffer
    means = list(flat.split(sizes))
    bound = MoveBound()
    for _ in range(plausibility.MOVE_HISTORY):  # a running federation's history
        bound.begin(1.0, own_norms=bucket_norms([own]))
        assert bound.plausible(0, means, own)
        bound.record()
    times: dict[str, list[float]] = {"checked": [], "own norms": [], "plausible": [], "unchecked": []}
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        norms = bucket_norms([own])
        t1 = time.perf_counter()
        bound.begin(1.0, own_norms=norms)
        ok = bound.plausible(0, means, own, flat)
        t2 = time.perf_counter()
        bound.record()
        assert ok
        t3 = time.perf_counter()
        assert all_finite(own) and all_finite(means)
        t4 = time.perf_counter()
        times["checked"].append(t2 - t0)
        times["own norms"].append(t1 - t0)
        times["plausible"].append(t2 - t1)
        times["unchecked"].append(t4 - t3)
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    result = {"segments": len(sizes), "elements": sum(sizes), "threads": torch.get_num_threads(),
              "median_ms": med, "extra_ms": med["checked"] - med["unchecked"]}
    print(f"{len(sizes)} segments, {sum(sizes) / 1e6:.2f}M elements, {torch.get_num_threads()} thread(s): checked "
          f"{med['checked']:.3f} ms (own norms {med['own norms']:.3f}, plausible {med['plausible']:.3f}), unchecked "
          f"{med['unchecked']:.3f} ms: +{result['extra_ms']:.3f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"provenance": provenance(), "args": vars(args), **result}, f, indent=1)


if __name__ == "__main__":
    main()
