"""How the overlapped, quantized and sparse syncs move learning quality: eval perplexity after the same samples.

The emulated benchmark's FL+FSDP run (`flwr-sharded bench`: 4 x 1 x 2 on 8 ranks, the `small` model, 1 x 64 tokens
per rank per step, AdamW lr 1e-3, seed 42, A = 8 unless `--aggregate-every`, 32 steps, 32 eval blocks) with one sync
variant at a time; only the sync differs, so the network does not matter and the ranks talk over loopback. Quality is
deterministic for a given variant (the same numbers as the bench's runs of the same variant). Each run's result holds
its final eval and train perplexity, its wall time and its eval curve (`[step, eval ppl]`, one point every 16 steps);
`--steps` sets the length, the learning-rate schedule following it.

    PYTHONPATH=. .venv/bin/python benchmarks/overlap_quality.py --data-dir .data --out results/overlap_quality.json
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

from flwr_sharded.run_dir import read_records
from flwr_sharded_perf.bench.runs import SyncVariant
from flwr_sharded_perf.provenance import provenance

VARIANTS = {
    "blocking fp32": SyncVariant(),
    "int8 + EF": SyncVariant(dtype="int8", error_feedback=True),
    "N=2 tau=0": SyncVariant(fragments=2),
    "N=1 tau=1 alpha=0": SyncVariant(delay=1),
    "N=1 tau=3 alpha=0": SyncVariant(delay=3),
    "N=2 tau=1 alpha=0": SyncVariant(fragments=2, delay=1),
    "N=2 tau=1 alpha=0.5": SyncVariant(fragments=2, delay=1, alpha=0.5),
    "N=2 tau=3 alpha=0": SyncVariant(fragments=2, delay=3),
    "N=2 tau=3 alpha=0.5": SyncVariant(fragments=2, delay=3, alpha=0.5),
    "N=1 tau=3 alpha=0 carry": SyncVariant(delay=3, carry=True),
    "N=2 tau=3 alpha=0 carry": SyncVariant(fragments=2, delay=3, carry=True),
    "N=2 tau=3 alpha=0.5 carry": SyncVariant(fragments=2, delay=3, alpha=0.5, carry=True),
    "N=4 tau=1 alpha=0 carry": SyncVariant(fragments=4, delay=1, carry=True),
    "N=2 tau=3 alpha=0 carry, int8 + EF": SyncVariant(dtype="int8", error_feedback=True, fragments=2, delay=3,
                                                      carry=True),
    # the 4-bit and sparse wires, and how the fraction and the bits move quality
    "int4 + EF": SyncVariant(dtype="int4", error_feedback=True),
    "float4_e2m1 + EF": SyncVariant(dtype="float4_e2m1", error_feedback=True),
    "int4": SyncVariant(dtype="int4"),
    "top-1% int8 + EF": SyncVariant(dtype="int8", error_feedback=True, topk=0.01),
    "top-2% int8 + EF": SyncVariant(dtype="int8", error_feedback=True, topk=0.02),
    "top-5% int8 + EF": SyncVariant(dtype="int8", error_feedback=True, topk=0.05),
    "top-10% int8 + EF": SyncVariant(dtype="int8", error_feedback=True, topk=0.1),
    "top-2% int4 + EF": SyncVariant(dtype="int4", error_feedback=True, topk=0.02),
    "top-2% float32 + EF": SyncVariant(dtype="float32", error_feedback=True, topk=0.02),
    "N=2 tau=3 alpha=0 carry, int4 + EF": SyncVariant(dtype="int4", error_feedback=True, fragments=2, delay=3,
                                                      carry=True),
    "int2 + EF": SyncVariant(dtype="int2", error_feedback=True),
    "int2": SyncVariant(dtype="int2"),
    "N=2 tau=3 alpha=0 carry, int2 + EF": SyncVariant(dtype="int2", error_feedback=True, fragments=2, delay=3,
                                                      carry=True),
    "N=2 tau=3 alpha=0 carry, top-2% int8 + EF": SyncVariant(dtype="int8", error_feedback=True, topk=0.02,
                                                             fragments=2, delay=3, carry=True),
}
RECIPE = ("--sync-topk-merge", "scatter-mean", "--sync-error-decay", "0.95")
"""SparseLoCo's merge and residual (the defaults, spelled out); `sum` with decay 1 is the earlier top-k sync."""
SPARSE = {  # top-1% (41 of each 4096: <= 0.01x the fp32 sync's bytes over 4 groups) with int2 codebook values
    name: (SyncVariant(dtype="int2", error_feedback=True, topk=0.01), (*RECIPE, *extra)) for name, extra in {
        "top-1% int2, scatter-mean": (),
        "top-1% int2, scatter-mean, restart at residual": ("--sync-restart", "residual"),
        "top-1% int2, scatter-mean, dense warm-up 1": ("--sync-dense-warmup", "1"),
        "top-1% int2, scatter-mean, dense flush": ("--sync-dense-flush",),
        "top-1% int2, scatter-mean, warm-up 1 + flush": ("--sync-dense-warmup", "1", "--sync-dense-flush"),
        "top-1% int2, scatter-mean, restart at residual + flush": ("--sync-restart", "residual",
                                                                    "--sync-dense-flush"),
        "top-1% int2, scatter-mean, restart at residual + flush, no decay": (
            "--sync-restart", "residual", "--sync-dense-flush", "--sync-error-decay", "1"),
    }.items()}
SPARSE["top-1% int2, sum, no decay"] = (SyncVariant(dtype="int2", error_feedback=True, topk=0.01),
                                        ("--sync-topk-merge", "sum", "--sync-error-decay", "1"))
SPARSE["top-1% int8, sum, no decay"] = (SyncVariant(dtype="int8", error_feedback=True, topk=0.01),
                                        ("--sync-topk-merge", "sum", "--sync-error-decay", "1"))
VARIANTS.update({name: variant for name, (variant, _) in SPARSE.items()})


def run(variant: SyncVariant, data_dir: str, work: Path, steps: int, extra: tuple[str, ...] = (), *,
        aggregate_every: int) -> dict:
    run_dir = work / "run"
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "8", "--standalone",
            "-m", "flwr_sharded.train", "--method", "fl-fsdp", "--federations", "4", "--replicas", "1",
            "--shards", "2", "--aggregate-every", str(aggregate_every), *variant.train_args(), *extra,
            "--model", "small", "--seq-len", "64",
            "--batch-size", "1", "--steps", str(steps), "--lr", "0.001", "--seed", "42", "--log-every", "8",
            "--eval-every", "16", "--eval-blocks", "32", "--data-dir", data_dir, "--no-progress",
            "--run-dir", str(run_dir), "--no-save-model", "--timeout", "300"]
    start = time.perf_counter()
    done = subprocess.run(argv, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, timeout=max(1800, 3 * steps))
    if done.returncode:
        raise SystemExit(f"the run failed (exit code {done.returncode}):\n{done.stderr[-4000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    curve = [[r["step"], r["eval_ppl"]] for r in read_records(run_dir) if r.get("kind") == "eval"]
    return {"eval_ppl": summary["eval_ppl"], "train_ppl": summary["ppl"], "wall_s": time.perf_counter() - start,
            "eval_curve": curve}


def main() -> int:
    from flwr_sharded import schema, tool_options
    from flwr_sharded.config import DataConfig, ParallelConfig, TrainConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=schema.HelpFormatter)
    tool_options.add_option(parser, DataConfig, "data_dir", required=True)
    parser.add_argument("--out", type=Path, required=True, help="result JSON")
    tool_options.add_option(parser, TrainConfig, "steps", default=32)
    tool_options.add_option(parser, ParallelConfig, "aggregate_every")
    parser.add_argument("--only", default="", help="variant names separated by '|' (empty: all)")
    args = parser.parse_args()
    names = [n for n in VARIANTS if not args.only or n in args.only.split("|")]
    rows = {}
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            extra = SPARSE[name][1] if name in SPARSE else ()
            result = run(VARIANTS[name], args.data_dir, Path(tmp), args.steps, extra,
                         aggregate_every=args.aggregate_every)
            rows[name] = {**result, "load_avg": os.getloadavg()[0]}
        ref = rows.get("blocking fp32", {}).get("eval_ppl")
        rel = f"{rows[name]['eval_ppl'] / ref - 1:+.2%}" if ref else "-"
        print(f"{name:32s} eval ppl {rows[name]['eval_ppl']:8.1f} ({rel} vs blocking fp32), train ppl "
              f"{rows[name]['train_ppl']:8.1f}, {rows[name]['wall_s']:.0f} s", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"provenance": provenance(), "steps": args.steps,
                                    "aggregate_every": args.aggregate_every, "runs": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
