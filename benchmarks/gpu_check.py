"""The GPU check: every path a GPU user takes, on the CUDA GPUs of this machine, in one script.

    python benchmarks/gpu_check.py [--out benchmarks/results/gpu_check-<date>.json] [--quick]

1. the static engine for each method the GPU count allows (NCCL; with one GPU: F = 2 groups of S = 1 sharing it,
   process groups over gloo), 20 steps of the `small` preset in bf16, losses finite and decreasing;
2. the Flower simulation (`flwr run apps/llama_fl_hsdp`) with one group per R*S GPUs, through the demo script;
3. a throughput run of a 1B-class Llama (`llama-1b`: 1.2 B parameters, vocab 128256) in bf16 on every GPU as FSDP:
   tokens/s, MFU and peak GPU memory.

Without a CUDA GPU it says so and exits 0. Writes one dated JSON with what it measured and the commands it ran.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _torchrun(nproc: int, args: list[str], timeout: float) -> tuple[int, str, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "flwr_sharded.train", *args]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout[-3000:] + proc.stderr[-3000:], time.monotonic() - start


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def static_runs(gpus: int, data_dir: str, work: Path, steps: int) -> list[dict]:
    """One short run per method the GPU count allows."""
    layouts = {"fsdp": ["--method", "fsdp", "--shards", str(gpus)]}
    if gpus >= 2:
        layouts["fl-fsdp"] = ["--method", "fl-fsdp", "--federations", "2", "--shards", str(gpus // 2)]
    else:  # two groups of one rank share the one GPU: NCCL refuses two ranks per device, gloo does not
        layouts["fl-fsdp"] = ["--method", "fl-fsdp", "--federations", "2", "--shards", "1", "--backend", "gloo"]
    if gpus >= 4:
        layouts["hsdp"] = ["--method", "hsdp", "--replicas", "2", "--shards", str(gpus // 2)]
        layouts["fl-hsdp"] = ["--method", "fl-hsdp", "--federations", "2", "--replicas", "2",
                              "--shards", str(gpus // 4)]
    out = []
    for name, layout in layouts.items():
        nproc = 2 if gpus == 1 and name == "fl-fsdp" else gpus
        run_dir = work / name
        args = [*layout, "--model", "small", "--precision", "bf16", "--steps", str(steps), "--aggregate-every", "4",
                "--log-every", "5", "--eval-every", "0", "--seq-len", "512", "--batch-size", "8",
                "--data-dir", data_dir, "--run-dir", str(run_dir), "--no-save-model", "--no-progress"]
        code, tail, seconds = _torchrun(nproc, args, timeout=900)
        train = [r for r in _records(run_dir) if r.get("kind") == "train"]
        ok = code == 0 and len(train) >= 2 and all(r["loss"] == r["loss"] for r in train) \
            and train[-1]["loss"] < train[0]["loss"]
        out.append({"method": name, "ranks": nproc, "ok": ok, "returncode": code, "seconds": seconds,
                    "first_loss": train[0]["loss"] if train else None, "last_loss": train[-1]["loss"] if train else None,
                    "tokens_per_s": train[-1]["tokens_per_s"] if train else None,
                    "peak_memory_mib": train[-1]["peak_memory_mib"] if train else None,
                    "command": "torchrun --nproc-per-node %d -m flwr_sharded.train %s" % (nproc, " ".join(args)),
                    **({} if ok else {"log_tail": tail})})
        print(f"static {name}: {'ok' if ok else 'FAILED'} ({seconds:.0f} s)", flush=True)
    return out


def flower_run(gpus: int, data_dir: str, work: Path) -> dict:
    """The Flower simulation with one group of R*S = 1 GPU per SuperNode (as many groups as GPUs, at least 1)."""
    groups = max(1, gpus)
    run_dir = work / "flower"
    env = {**os.environ, "FLWR_SHARDED_GROUPS": str(groups), "FLWR_SHARDED_DATA": data_dir}
    cmd = ["bash", str(REPO / "apps/llama_fl_hsdp/run_simulation.sh"), "--run-config",
           f'shards=1 num-groups={groups} model="small" precision="bf16" num-server-rounds=2 syncs-per-round=2 '
           f'aggregate-every=10 run-dir="{run_dir}"']
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=1200)
    rounds = [r for r in _records(run_dir) if r.get("kind") == "round"]
    ok = proc.returncode == 0 and len(rounds) == 2 and all(r["synced"] and r["checksums_equal"] for r in rounds)
    print(f"flower: {'ok' if ok else 'FAILED'} ({time.monotonic() - start:.0f} s)", flush=True)
    return {"ok": ok, "groups": groups, "returncode": proc.returncode, "seconds": time.monotonic() - start,
            "rounds": [{k: r.get(k) for k in ("round", "train_ppl", "eval_ppl", "tokens_per_s", "overhead_pct")}
                       for r in rounds], "command": " ".join(cmd),
            **({} if ok else {"log_tail": proc.stdout[-4000:]})}


def throughput(gpus: int, data_dir: str, work: Path, steps: int) -> dict:
    """llama-1b in bf16, FSDP over every GPU: tokens/s, MFU and peak GPU memory of the last window."""
    run_dir = work / "llama-1b"
    args = ["--method", "fsdp", "--shards", str(gpus), "--model", "llama-1b", "--precision", "bf16",
            "--seq-len", "2048", "--batch-size", "4", "--steps", str(steps), "--log-every", str(max(1, steps // 2)),
            "--eval-every", "0", "--eval-blocks", "0", "--optimizer", "adamw", "--data-dir", data_dir,
            "--run-dir", str(run_dir), "--no-save-model", "--no-progress"]
    code, tail, seconds = _torchrun(gpus, args, timeout=1200)
    train = [r for r in _records(run_dir) if r.get("kind") == "train"]
    last = train[-1] if train else {}
    out = {"ok": code == 0 and bool(train), "returncode": code, "seconds": seconds, "model": "llama-1b",
           "tokens_per_s": last.get("tokens_per_s"), "tflops_per_rank": last.get("tflops_per_rank"),
           "mfu": last.get("mfu"), "peak_memory_mib": last.get("peak_memory_mib"), "step_s": last.get("step_s"),
           "command": "torchrun --nproc-per-node %d -m flwr_sharded.train %s" % (gpus, " ".join(args))}
    if not out["ok"]:
        out["log_tail"] = tail
    print(f"throughput: {out}", flush=True)
    return out


def main() -> int:
    from flwr_sharded import schema, tool_options
    from flwr_sharded.config import DataConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=schema.HelpFormatter)
    parser.add_argument("--out", default="", help="JSON file (empty: benchmarks/results/gpu_check-<date>.json)")
    tool_options.add_option(parser, DataConfig, "data_dir", default=os.environ.get("FLWR_SHARDED_DATA", str(REPO / ".data")))
    parser.add_argument("--quick", action="store_true", help="fewer steps (a smoke test)")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU on this machine; nothing to check")
        return 0
    gpus = torch.cuda.device_count()
    from flwr_sharded.training.corpus import prepare_data

    prepare_data(args.data_dir, progress=False)
    steps = 10 if args.quick else 20
    result = {"date": time.strftime("%Y-%m-%d"), "gpus": gpus, "device": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "cuda": torch.version.cuda}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        result["static"] = static_runs(gpus, args.data_dir, work, steps)
        result["flower"] = flower_run(gpus, args.data_dir, work)
        result["throughput"] = throughput(gpus, args.data_dir, work, steps)
    out = Path(args.out or REPO / "benchmarks" / "results" / f"gpu_check-{result['date']}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    ok = all(r["ok"] for r in result["static"]) and result["flower"]["ok"] and result["throughput"]["ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
