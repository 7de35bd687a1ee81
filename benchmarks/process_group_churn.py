"""What a gloo process group leaves behind once destroyed: the memory one rank keeps per group made, used once and
destroyed, as every Flower round does with its federation group (`flwr_sharded.flower.rendezvous.join`).

    PATH=.venv/bin:$PATH python benchmarks/process_group_churn.py --groups 5000 \
        --out benchmarks/results/process_group_churn_<date>.json

Two local ranks make `--groups` groups one after the other (`new_group` over both, one all-reduce of 1,000 floats,
`destroy_process_group`), once with torch's defaults and once with its flight recorder off (`TORCH_FR_BUFFER_SIZE=0`).
Every 100 groups rank 1 (which does not host the store, whose keys grow) collects Python's garbage, trims the heap
and reads its anonymous RSS and malloc's bytes in use (`mallinfo2`). The JSON gives, per environment, both series and
their slopes in KiB per group made, over the first 2,000 groups and over the rest.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ENVIRONMENTS = {"torch_defaults": {}, "flight_recorder_off": {"TORCH_FR_BUFFER_SIZE": "0"}}
EVERY = 100
SPLIT = 2000
"""Groups after which the slope is fitted again (the flight recorder's ring of entries fills before it)."""


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def _anon_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise RuntimeError("no RssAnon in /proc/self/status")


def worker(groups: int, out: Path) -> None:
    """One rank: make, use and destroy `groups` groups; rank 1 writes its samples to `out`."""
    import torch
    import torch.distributed as dist

    from flwr_sharded.parallel.torch_compat import destroy_group

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    tensor, samples = torch.ones(1000), []
    for i in range(groups + 1):
        if i % EVERY == 0:
            gc.collect()
            libc.malloc_trim(0)
            samples.append({"groups": i, "anon_kib": _anon_kib(), "in_use_kib": libc.mallinfo2().uordblks / 1024})
        group = dist.new_group([0, 1], backend="gloo")
        dist.all_reduce(tensor, group=group)
        destroy_group(group)
    if dist.get_rank() == 1:
        out.write_text(json.dumps(samples))
    dist.destroy_process_group()


def slope(samples: list[dict], key: str, lo: int, hi: int) -> float | None:
    """KiB per group of `key` over the samples with lo <= groups <= hi."""
    points = [s for s in samples if lo <= s["groups"] <= hi]
    if len(points) < 3:
        return None
    return statistics.linear_regression([s["groups"] for s in points], [s[key] for s in points]).slope


def main() -> int:
    from flwr_sharded_perf.provenance import provenance

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=5000)
    parser.add_argument("--out", help="results JSON")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.groups, Path(args.worker))
        return 0
    if args.groups < 3 * EVERY:
        parser.error(f"--groups must be at least {3 * EVERY}")
    work, started = Path(tempfile.mkdtemp(prefix="pg-churn-")), time.time()
    result: dict = {"provenance": provenance(), "groups": args.groups, "environments": {}}
    for name, env in ENVIRONMENTS.items():
        samples_path = work / f"{name}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
               "--groups", str(args.groups), "--worker", str(samples_path)]
        done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, capture_output=True, text=True,
                              timeout=3600)
        if done.returncode != 0:
            raise SystemExit(f"{name}: {' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        samples = json.loads(samples_path.read_text())
        fits = {f"{key}_per_group_{span}": slope(samples, key, lo, hi)
                for key in ("anon_kib", "in_use_kib")
                for span, lo, hi in (("first", EVERY, SPLIT), ("after", SPLIT, args.groups))}
        result["environments"][name] = {"env": env, **fits, "samples": samples}
        print(f"{name}: " + ", ".join(f"{k} {v:+.3f}" for k, v in fits.items() if v is not None), file=sys.stderr)
    result["seconds"] = round(time.time() - started, 1)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
