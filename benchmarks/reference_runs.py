"""Runs of every method with one seed, reduced to digests: what a change to the training core must leave unchanged.

    PATH=.venv/bin:$PATH python benchmarks/reference_runs.py --out /tmp/ref-new.json
    PATH=.venv/bin:$PATH python benchmarks/reference_runs.py --compare /tmp/ref-old.json /tmp/ref-new.json

Each run (the static engine through torchrun, and one Flower simulation) saves its final model in fp32; a run's
digest is the sha256 of every saved tensor's name, dtype, shape and bytes, with the losses and perplexities of
`metrics.jsonl`. Two commits compared (`--compare`) are equal bit for bit when the digests are; otherwise the largest
relative difference of any tensor and any logged loss is printed (the files must then both be kept: `--keep DIR`).
A run of a commit: check it out in a worktree (`git worktree add /tmp/old <commit>`) and run this script from there
with the same virtual environment.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flwr_sharded_perf.provenance import provenance

TINY = ["--model", "tiny", "--seq-len", "32", "--batch-size", "2", "--steps", "12", "--eval-every", "6",
        "--eval-blocks", "8", "--log-every", "2", "--no-progress", "--save-model", "--timeout", "120"]
"""Options every static run shares (12 steps of the tiny preset)."""

STATIC: dict[str, tuple[int, list[str]]] = {
    "fsdp": (4, ["--method", "fsdp", "--shards", "4"]),
    "hsdp": (4, ["--method", "hsdp", "--replicas", "2", "--shards", "2"]),
    "fl-fsdp": (4, ["--method", "fl-fsdp", "--federations", "2", "--shards", "2", "--aggregate-every", "4"]),
    "fl-hsdp": (4, ["--method", "fl-hsdp", "--federations", "2", "--replicas", "2", "--shards", "1",
                    "--aggregate-every", "4"]),
    "fl-fsdp-overlap-int8": (4, ["--method", "fl-fsdp", "--federations", "2", "--shards", "2",
                                 "--aggregate-every", "4", "--sync-dtype", "int8", "--sync-error-feedback",
                                 "--sync-fragments", "2", "--sync-delay", "1"]),
    "unequal-2-1": (3, ["--method", "fl-fsdp", "--group-shards", "2,1", "--aggregate-every", "4"]),
    "fl-fsdp-fragments-nesterov-bf16": (4, ["--method", "fl-fsdp", "--federations", "2", "--shards", "2",
                                            "--aggregate-every", "4", "--sync-fragments", "2", "--outer",
                                            "nesterov", "--sync-dtype", "bfloat16"]),
    "fl-fsdp-median": (3, ["--method", "fl-fsdp", "--federations", "3", "--shards", "1", "--aggregate-every", "4",
                           "--outer", "median"]),
}
"""name -> (ranks, options) of each static run."""

FLOWER = ["num-server-rounds=2", "syncs-per-round=2", "aggregate-every=3", "eval-blocks=8", "log-every=3"]
"""The Flower simulations' run config: 2 groups x 2 ranks, 2 rounds of 2 syncs of 3 steps."""
FLOWER_RUNS = {"flower": [], "flower-server-path": ['aggregation="server"', "syncs-per-round=1"],
               "flower-overlap-int8": ['sync-dtype="int8"', "aggregate-every=4", "sync-fragments=2", "sync-delay=1"]}
"""name -> run-config keys of each Flower simulation, over `FLOWER`."""


def digest(run_dir: Path) -> dict:
    """The saved model's sha256 and the run's logged losses."""
    import torch
    from safetensors import safe_open

    h = hashlib.sha256()
    for path in sorted((run_dir / "model").glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in sorted(f.keys()):
                t = f.get_tensor(key).contiguous()
                h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
                h.update(t.view(-1).view(dtype=torch.uint8).numpy().tobytes())
    losses = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key in ("loss", "eval_loss"):
            if key in record:
                losses.append([record.get("kind", ""), record.get("step", record.get("round")), key, record[key]])
    return {"model_sha256": h.hexdigest(), "losses": losses, "dir": str(run_dir)}


def run_static(name: str, ranks: int, options: list[str], work: Path, data_dir: str, port: int) -> dict:
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
           str(port), "-m", "flwr_sharded.train", *TINY, *options, "--data-dir", data_dir, "--run-dir",
           str(run_dir)]
    started = time.perf_counter()
    result = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                            timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return {**digest(run_dir), "seconds": time.perf_counter() - started, "command": " ".join(cmd)}


def run_flower(name: str, work: Path, data_dir: str) -> dict:
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)
    script = Path(__file__).resolve().parents[1] / "apps" / "llama_fl_hsdp" / "run_simulation.sh"
    keys = dict(kv.split("=", 1) for kv in [*FLOWER, *FLOWER_RUNS[name], f'run-dir="{run_dir}"'])
    config = " ".join(f"{k}={v}" for k, v in keys.items())
    started = time.perf_counter()
    result = subprocess.run([str(script), "--run-config", config],
                            env={**os.environ, "FLWR_SHARDED_DATA": data_dir, "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=1200)
    if result.returncode != 0:
        raise RuntimeError(f"the Flower simulation failed ({result.returncode}):\n{result.stdout[-3000:]}")
    return {**digest(run_dir), "seconds": time.perf_counter() - started, "run_config": config}


def compare(old_path: str, new_path: str) -> int:
    """Print each run's verdict; exit 1 unless every run is equal bit for bit or within 1e-6 relative."""
    from safetensors.torch import load_file

    old, new = json.loads(Path(old_path).read_text()), json.loads(Path(new_path).read_text())
    worst = 0.0
    for name in old["runs"]:
        a, b = old["runs"][name], new["runs"].get(name)
        if b is None:
            print(f"{name}: missing in {new_path}")
            worst = float("inf")
            continue
        if a["model_sha256"] == b["model_sha256"] and a["losses"] == b["losses"]:
            print(f"{name}: bit for bit")
            continue
        rel = 0.0
        for path in sorted(Path(a["dir"], "model").glob("*.safetensors")):
            ta, tb = load_file(str(path)), load_file(str(Path(b["dir"], "model", path.name)))
            for key in ta:
                d = (ta[key].double() - tb[key].double()).abs().max() / ta[key].double().abs().max().clamp_min(1e-30)
                rel = max(rel, float(d))
        loss_rel = max((abs(x[3] - y[3]) / max(abs(x[3]), 1e-30) for x, y in zip(a["losses"], b["losses"])),
                       default=0.0)
        print(f"{name}: differs: largest relative difference {rel:.3g} (weights), {loss_rel:.3g} (losses)")
        worst = max(worst, rel, loss_rel)
    return 0 if worst <= 1e-6 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the digests here (JSON)")
    parser.add_argument("--keep", help="run directories go here (kept), instead of a temporary directory")
    parser.add_argument("--data-dir", default=os.environ.get("FLWR_SHARDED_DATA",
                                                             str(Path.home() / ".cache" / "flwr_sharded")))
    parser.add_argument("--only", default="", help="comma-separated run names (default: all)")
    parser.add_argument("--port", type=int, default=29611)
    parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="compare two outputs of this script")
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="reference-runs-"))
    work.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.only.split(",") if n] or [*STATIC, *FLOWER_RUNS]
    runs = {}
    for name in names:
        print(f"{name} ...", file=sys.stderr, flush=True)
        runs[name] = run_flower(name, work, args.data_dir) if name in FLOWER_RUNS else run_static(
            name, *STATIC[name], work, args.data_dir, args.port)
        print(f"{name}: {runs[name]['model_sha256'][:16]} in {runs[name]['seconds']:.0f} s", file=sys.stderr)
    out = {"provenance": provenance(), "runs": runs}
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    if not args.keep:
        print(f"run directories in {work}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
