"""The planner's memory model (`flwr_sharded_perf.memory_model`) against the trainer's measured peak memory on CPU.

    PYTHONPATH=. .venv/bin/python benchmarks/memory_model_check.py --data-dir .data [--layouts fsdp-s2,fsdp-s4]

For each layout the real trainer runs under torchrun (`-m flwr_sharded.train`, gloo, OMP_NUM_THREADS=1, 3 steps) on a
generated Llama of about 250 MB in fp32 (h 768, 8 blocks, MLP 2048, 12 heads, 4 key/value heads, untied head, the
corpus's 8192-token vocabulary). Every rank records its peak resident memory during `Trainer.run`: a wrapper resets
the kernel's high-water mark (VmHWM) once the model is built, so the build (each rank makes the whole model before
sharding it) is not counted; the run's own `peak_memory_mib` (ru_maxrss, construction included) is kept next to it.
The same layout on the `tiny` preset with 1 x 16 tokens gives the fixed footprint of that process (Python, torch,
transformers, gloo, the corpus): fixed = its peak less its predicted bytes (under 2 MB). Per rank, measured = peak
less fixed; a layout's measured is its largest rank, compared with `trainer_memory(..., device="cpu")`.

On CPU "GPU memory" is the process's RSS: tensors come from glibc malloc (no caching allocator), the optimizer runs
one parameter at a time (no foreach temporaries), and memory freed to malloc but kept by it still counts.
`flwr_sharded.train` pins glibc's mmap and trim thresholds at 128 KiB (`flwr_sharded.host_memory`), so every
tensor of 128 KiB or more is its own mapping, returned when freed: RSS then follows live tensors. `--mmap-threshold
N` sets MALLOC_MMAP_THRESHOLD_ for the ranks instead (the environment wins). Internal: `--worker DIR -- TRAIN
ARGS` runs one rank.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from flwr_sharded_perf.provenance import provenance

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20

CHECK_MODEL = dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4,
                   intermediate_size=2048, tie_word_embeddings=False)
"""The generated Llama (as `flwr_sharded.training.models.Preset` fields); vocabulary from the tokenizer."""
VOCAB = 8192
"""The embedded corpus's tokenizer."""
COMMON = ["--steps", "3", "--seq-len", "256", "--batch-size", "2", "--eval-blocks", "4", "--no-save-model",
          "--no-progress", "--log-every", "1", "--aggregate-every", "1", "--warmup", "0"]
"""Flags of every run: 3 steps of 2 x 256 tokens per rank, a sync after every FL step, a short evaluation."""
TINY = ["--batch-size", "1", "--seq-len", "16"]
"""The fixed-footprint run: the same layout on the tiny preset with 16 tokens per rank."""

LAYOUTS: dict[str, list[str]] = {
    "fsdp-s2": ["--method", "fsdp", "--shards", "2"],
    "fsdp-s4": ["--method", "fsdp", "--shards", "4"],
    "hsdp-r2-s2": ["--method", "hsdp", "--replicas", "2", "--shards", "2"],
    "fl-fsdp-f2-s2-fedavg": ["--method", "fl-fsdp", "--federations", "2", "--shards", "2"],
    "fl-fsdp-f2-s2-nesterov": ["--method", "fl-fsdp", "--federations", "2", "--shards", "2", "--outer", "nesterov"],
    "fsdp-s2-ac": ["--method", "fsdp", "--shards", "2", "--activation-checkpointing"],
    "fl-fsdp-f2-s2-nesterov-ac": ["--method", "fl-fsdp", "--federations", "2", "--shards", "2", "--outer",
                                  "nesterov", "--activation-checkpointing"],
    "fsdp-s2-bf16": ["--method", "fsdp", "--shards", "2", "--precision", "bf16"],
    "fl-fsdp-f2-s2-bf16wire": ["--method", "fl-fsdp", "--federations", "2", "--shards", "2", "--sync-dtype",
                               "bfloat16"],
    "fsdp-s2-accum2": ["--method", "fsdp", "--shards", "2", "--grad-accum", "2"],
}
"""Layouts checked: the train flags that differ (world size = F x R x S)."""


# ---------------------------------------------------------------------------------------------------------------------
# One rank (under torchrun).


def worker(out_dir: str, argv: list[str]) -> int:
    """Run `flwr_sharded.train` with `Trainer.run` wrapped to record this rank's peak RSS during training."""
    from flwr_sharded import host_memory, train
    from flwr_sharded.host_memory import PeakRSS, current_rss, peak_rss
    from flwr_sharded.training import trainer as trainer_module

    original = trainer_module.Trainer.run

    def run(self: Any, run_dir: Any = None) -> dict[str, Any]:
        build_hwm = peak_rss() or 0
        host_memory.trim()
        start = current_rss() or 0
        peak = PeakRSS(start)
        try:
            return original(self, run_dir)
        finally:
            extra = peak.extra_bytes()
            record = {"rank": int(os.environ["RANK"]), "rss_start": start, "build_hwm": build_hwm,
                      "peak_rss": None if extra is None else start + extra, "rss_end": current_rss(),
                      "parameters_local": sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                                              for p in self.model.parameters()),
                      "dtypes": sorted({str(p.dtype) for p in self.model.parameters()})}
            Path(out_dir, f"rank{record['rank']}.json").write_text(json.dumps(record))

    trainer_module.Trainer.run = run
    return train.main(argv)


# ---------------------------------------------------------------------------------------------------------------------
# The driver.


def world_size(flags: list[str]) -> int:
    size = 1
    for name in ("--federations", "--replicas", "--shards"):
        if name in flags:
            size *= int(flags[flags.index(name) + 1])
    return size


def launch(run_dir: Path, flags: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """One torchrun of the trainer; per-rank records and the run's metrics."""
    run_dir.mkdir(parents=True, exist_ok=True)
    ranks_dir = run_dir / "ranks"
    ranks_dir.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world_size(flags)),
           str(Path(__file__).resolve()), "--worker", str(ranks_dir), "--", *flags, "--run-dir", str(run_dir / "run")]
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - started
    (run_dir / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        raise RuntimeError(f"run failed ({proc.returncode}), see {run_dir / 'log.txt'}:\n{proc.stderr[-3000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(ranks_dir.glob("rank*.json"), key=lambda p: int(p.stem[4:]))]
    lines = [json.loads(x) for x in (run_dir / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    run_peak = max((x["peak_memory_mib"] for x in lines if x.get("kind") == "train"), default=None)
    return {"seconds": seconds, "ranks": ranks, "run_peak_memory_mib": run_peak}


def predict(flags: list[str], model: str, shape: Any, tokens: int) -> Any:
    """The memory model's breakdown for the run these flags describe (its TrainConfig, on CPU)."""
    from flwr_sharded_perf.memory_model import StepOptions, trainer_memory
    from flwr_sharded.train import resolve_config, train_parser

    cfg = resolve_config(train_parser().parse_args([*flags, "--model", model]))
    p = cfg.parallel
    return trainer_memory(shape, S=p.shards, R=p.replicas, F=p.federations, tokens=tokens,
                          options=StepOptions.from_config(cfg, "cpu"))


def check(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import LlamaConfig

    from flwr_sharded_perf.model_shape import model_from_preset, shape_of
    from flwr_sharded.presets import Preset

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="memory_model_check_"))
    model_dir = work / "model"
    LlamaConfig(vocab_size=VOCAB, max_position_embeddings=256, **CHECK_MODEL).save_pretrained(model_dir)
    shape = shape_of(Preset(**CHECK_MODEL), VOCAB, name="check-llama")
    tiny = model_from_preset("tiny", VOCAB)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(":"),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if args.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    data = ["--data-dir", args.data_dir]
    out: dict[str, Any] = {
        "provenance": provenance(), "load_avg_start": os.getloadavg()[0],
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": _torch_version(),
                 "platform": platform.platform()},
        "malloc_mmap_threshold": args.mmap_threshold, "model": {**CHECK_MODEL, "vocab_size": VOCAB,
                                                                "parameters": shape.num_params},
        "common_flags": COMMON, "tiny_flags": TINY, "layouts": {}}
    for name in args.layouts:
        flags = [*LAYOUTS[name], *COMMON, *data]
        load = os.getloadavg()[0]
        print(f"{name}: {world_size(flags)} ranks ...", flush=True)
        big = launch(work / name, [*flags, "--model", str(model_dir)], env, args.timeout)
        small = launch(work / f"{name}-tiny", [*flags, *TINY, "--model", "tiny"], env, args.timeout)
        tokens = 2 * 256
        predicted = predict(flags, str(model_dir), shape, tokens)
        predicted_tiny = predict([*flags, *TINY], "tiny", tiny, 16)
        per_rank = []
        for b, t in zip(big["ranks"], small["ranks"]):
            fixed = t["peak_rss"] - predicted_tiny.total
            per_rank.append({"rank": b["rank"], "peak_rss_mib": b["peak_rss"] / MiB, "fixed_mib": fixed / MiB,
                             "measured_mib": (b["peak_rss"] - fixed) / MiB, "rss_start_mib": b["rss_start"] / MiB,
                             "build_hwm_mib": b["build_hwm"] / MiB})
        measured = max(r["measured_mib"] for r in per_rank)
        row = {"flags": LAYOUTS[name], "world_size": world_size(flags), "load_avg": [load, os.getloadavg()[0]],
               "seconds": big["seconds"], "per_rank": per_rank, "measured_mib": measured,
               "measured_mean_mib": sum(r["measured_mib"] for r in per_rank) / len(per_rank),
               "predicted_mib": predicted.total / MiB, "ratio": measured / (predicted.total / MiB),
               "predicted_peak_phase": predicted.peak_phase,
               "predicted_terms_mib": {k: v / MiB for k, v in predicted.terms().items()},
               "predicted_phases_mib": {k: v / MiB for k, v in predicted.phases.items()},
               "run_peak_memory_mib": big["run_peak_memory_mib"], "tiny_predicted_mib": predicted_tiny.total / MiB,
               "parameters_local": [r["parameters_local"] for r in big["ranks"]], "dtypes": big["ranks"][0]["dtypes"]}
        out["layouts"][name] = row
        print(f"  measured {measured:.0f} MiB (fixed {per_rank[0]['fixed_mib']:.0f}), predicted "
              f"{row['predicted_mib']:.0f} MiB ({predicted.peak_phase}), ratio {row['ratio']:.3f}", flush=True)
        if args.out:
            _write(args.out, out)
    out["load_avg_end"] = os.getloadavg()[0]
    return out


def _torch_version() -> str:
    import torch

    return torch.__version__


def _write(path: str, data: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def table(data: dict[str, Any]) -> str:
    """A Markdown table of a result file."""
    lines = ["| layout | ranks | measured MiB | predicted MiB | ratio | predicted peak | fixed MiB | run's ru_maxrss |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in data["layouts"].items():
        lines.append(f"| {name} | {r['world_size']} | {r['measured_mib']:.0f} | {r['predicted_mib']:.0f} | "
                     f"{r['ratio']:.2f} | {r['predicted_peak_phase']} | {r['per_rank'][0]['fixed_mib']:.0f} | "
                     f"{r['run_peak_memory_mib']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        rest = argv[2:]
        return worker(argv[1], rest[1:] if rest[:1] == ["--"] else rest)
    from flwr_sharded import schema, tool_options
    from flwr_sharded.config import DataConfig

    p = argparse.ArgumentParser(description=__doc__, formatter_class=schema.HelpFormatter)
    tool_options.add_option(p, DataConfig, "data_dir", default=str(ROOT / ".data"))
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of: {', '.join(LAYOUTS)}")
    p.add_argument("--out", default=None, help="result JSON (unset: benchmarks/results/memory_model_check_DATE.json)")
    p.add_argument("--work-dir", default=None, help="where the runs write (unset: a new temporary directory)")
    p.add_argument("--mmap-threshold", type=int, default=0,
                   help="MALLOC_MMAP_THRESHOLD_ for the ranks (0: the trainer's, 128 KiB)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per torchrun")
    p.add_argument("--table", metavar="JSON", help="print the Markdown table of a result file and exit")
    args = p.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return 0
    args.layouts = [x for x in args.layouts.split(",") if x]
    unknown = sorted(set(args.layouts) - set(LAYOUTS))
    if unknown:
        p.error(f"unknown layouts {unknown}; choose among {', '.join(LAYOUTS)}")
    suffix = "_mmap" if args.mmap_threshold else ""
    args.out = args.out or str(ROOT / "benchmarks" / "results" /
                               f"memory_model_check_{datetime.date.today().isoformat()}{suffix}.json")
    data = check(args)
    _write(args.out, data)
    print(table(data))
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
