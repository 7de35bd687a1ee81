"""The inner step under the package's allocator policy against glibc's default thresholds, on the emulated cluster.

    PATH=.venv/bin:$PATH python benchmarks/allocator_step.py --rounds 3 \
        --out benchmarks/results/allocator_step_<date>.json

Runs `flwr-sharded bench --methods no-sync,fl-fsdp-overlap-int8 --repeats 1 --sweep none --contrast none
--no-planner-run --unequal none` once per round in each of two environments, alternating which goes first: the
package's policy (`flwr_sharded.host_memory`: 128 KiB thresholds through start-up and the first step, 32 MiB
after it), and `MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=33554432` (which the policy leaves alone: glibc
at its default ceiling from the start); with `--preload LIB` (e.g. jemalloc's `libjemalloc.so.2`) a third
environment with that allocator in `LD_PRELOAD`. Each run's median seconds per step of both methods, their medians
over the rounds and each environment's ratio to glibc's default go to `--out`. Needs root (the emulated network).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flwr_sharded_perf.provenance import provenance

REPO = Path(__file__).resolve().parents[1]
METHODS = ("no-sync", "fl-fsdp-overlap-int8")
DEFAULT = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "33554432"}


def bench(out: Path, env: dict[str, str], data_dir: str) -> dict[str, float]:
    """One bench run; the median seconds per step of each method."""
    cmd = ["flwr-sharded", "bench", "--methods", ",".join(METHODS), "--repeats", "1", "--sweep", "none",
           "--contrast", "none", "--no-planner-run", "--unequal", "none", "--data-dir", data_dir, "--out", str(out)]
    done = subprocess.run(cmd, env={**os.environ, **env}, cwd=REPO, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    runs = json.loads((out / "bench.json").read_text())["scenarios"]["main"]["runs"]
    return {m: runs[m]["step_s"] for m in METHODS}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", help="results JSON")
    parser.add_argument("--data-dir", default=os.environ.get("FLWR_SHARDED_DATA",
                                                             str(Path.home() / ".cache" / "flwr_sharded")))
    parser.add_argument("--preload", help="an allocator's shared library, measured as a third environment")
    args = parser.parse_args()
    if args.preload and not Path(args.preload).is_file():
        parser.error(f"--preload {args.preload}: no such file")
    environments = [("policy", {}), ("glibc_default", DEFAULT)]
    if args.preload:
        environments.append((f"preload:{Path(args.preload).name}", {"LD_PRELOAD": args.preload}))
    work = Path(tempfile.mkdtemp(prefix="allocator-step-"))
    started, load_start = time.time(), os.getloadavg()
    measured: dict[str, list[dict[str, float]]] = {name: [] for name, _ in environments}
    for r in range(args.rounds):
        for name, env in environments if r % 2 == 0 else environments[::-1]:
            measured[name].append(bench(work / f"{name}-{r}", env, args.data_dir))
            print(f"round {r + 1} {name}: " + ", ".join(f"{m} {s:.3f} s/step" for m, s in measured[name][-1].items()),
                  file=sys.stderr, flush=True)
    medians = {name: {m: statistics.median(run[m] for run in runs) for m in METHODS} for name, runs in measured.items()}
    result = {"provenance": provenance(), "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
              "seconds": time.time() - started,
              "step_s": measured, "median_step_s": medians,
              "over_default": {name: {m: medians[name][m] / medians["glibc_default"][m] for m in METHODS}
                               for name in medians if name != "glibc_default"}}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
