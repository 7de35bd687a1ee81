"""Peak resident memory of every rank at start-up (build or load, shard), the first step, saving, and of export.

    PYTHONPATH=. .venv/bin/python benchmarks/startup_memory.py --label after \
        --out benchmarks/results/startup_memory_2026-12-01.json

1. Generates (once, in `--work`) a Llama of about 1.2 GiB in fp32 (hidden 2048, 12 layers, untied 8192-token
   vocabulary; 311 M parameters), saved as one safetensors file with `save_pretrained`.
2. `torchrun --nproc-per-node 4`, fsdp with S = 4, `--model DIR --pretrained`: each rank measures its peak RSS
   (`VmHWM`, reset between phases) over start-up (process start -> `Trainer` built), the first AdamW step, `--save`
   (`Trainer.save_pretrained`) and a DCP checkpoint.
3. The same on the `tiny` preset: the fixed footprint of the same process (imports, data, tokenizer, gloo).
   Then start-up and step of the big shape with random init (`--model DIR` without `--pretrained`), and loading the
   same weights from a bf16 safetensors file (converted to the fp32 parameters).
4. `flwr-sharded export` of both checkpoints in a fresh process each (its peak RSS; the tiny one is the fixed part).

The ranks pin glibc's thresholds and trim the heap after loading, as `flwr_sharded.train` does, and the trainer's first
step raises them (`flwr_sharded.host_memory`), unless `--default-allocator`. Steps 2-4 are measured too (their
peak over the same fixed footprint: the steady state under the raised thresholds).

The target: peak <= 1.3 x (16 bytes per parameter / S: fp32 parameters, gradients and AdamW's two moments) + the
fixed footprint, for every rank and for export. Results (and the load average at the start and end) go to `--out`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from flwr_sharded_perf.provenance import provenance

REPO = Path(__file__).resolve().parents[1]
SHAPE = dict(vocab_size=8192, hidden_size=2048, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4,
             intermediate_size=2048, tie_word_embeddings=False, max_position_embeddings=2048)
NPROC = 4


def _hwm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _reset_hwm() -> int:
    """Reset the high-water mark to the current RSS; return that RSS."""
    Path("/proc/self/clear_refs").write_text("5")
    return _rss_bytes()


def generate(directory: Path) -> None:
    """Write the benchmark model (random init, fp32 safetensors) to `directory`, unless it is there already."""
    if (directory / "config.json").is_file():
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    tmp = directory.with_name(directory.name + ".tmp")
    model.save_pretrained(tmp, max_shard_size="50GB")
    os.replace(tmp, directory)


def generate_bf16(source: Path, directory: Path) -> None:
    """The same model with bf16 tensors (the usual dtype of published checkpoints), unless it is there already."""
    if (directory / "config.json").is_file():
        return
    from safetensors.torch import load_file, save_file

    tmp = directory.with_name(directory.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: v.bfloat16() for k, v in load_file(source / "model.safetensors").items()},
              str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    (tmp / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}, indent=2))
    shutil.copy(source / "generation_config.json", tmp / "generation_config.json")
    os.replace(tmp, directory)


def worker(args: argparse.Namespace, train_args: list[str]) -> None:
    """One torchrun rank: start-up, one step, save_pretrained, checkpoint; write this rank's peaks as JSON.

    Like `flwr_sharded.train`, it pins glibc's thresholds first and calls `after_load` once the model is loaded
    (`flwr_sharded.host_memory`), unless `--default-allocator`."""
    from flwr_sharded import host_memory

    release = not args.default_allocator
    if args.step_threshold:  # the thresholds from the second step on, instead of the package's
        host_memory.STEP_THRESHOLD_BYTES = args.step_threshold
    if release:
        host_memory.pin_thresholds()
    else:  # the trainer's first step leaves them alone too
        host_memory.after_first_step = lambda: {}
    peaks: dict[str, int] = {}
    starts: dict[str, int] = {}
    import torch

    from flwr_sharded.parallel.topology import init_topology
    from flwr_sharded.train import resolve_config, train_parser
    from flwr_sharded.training.preflight import preflight
    from flwr_sharded.training.trainer import Trainer

    torch.set_num_threads(1)
    cfg = resolve_config(train_parser().parse_args(train_args))
    preflight(cfg, int(os.environ["WORLD_SIZE"]))
    topo = init_topology(cfg.parallel, cfg.timeout_s)
    times: dict[str, float] = {}
    start = time.perf_counter()
    trainer = Trainer(cfg, topo)
    if release:
        host_memory.after_load()
    times["startup_s"] = time.perf_counter() - start
    peaks["startup"] = _hwm_bytes()  # from process start: imports, topology, data, model
    starts["step"] = _reset_hwm()
    start = time.perf_counter()
    float(trainer.step())
    times["step_s"] = time.perf_counter() - start
    peaks["step"] = _hwm_bytes()
    starts["later_steps"] = _reset_hwm()  # steps 2-4: the steady state (the policy's thresholds after step 1)
    start = time.perf_counter()
    for _ in range(3):
        float(trainer.step())
    times["later_step_s"] = (time.perf_counter() - start) / 3
    peaks["later_steps"] = _hwm_bytes()
    n_params = sum(p.numel() for p in trainer.model.parameters())
    rank = int(os.environ["RANK"])
    out = Path(args.work) / f"rank-{args.name}-{rank}.json"
    if args.startup_only:
        out.write_text(json.dumps({"rank": rank, "peaks": peaks, "starts": starts, "parameters": n_params, **times}))
        return
    starts["save_pretrained"] = _reset_hwm()
    start = time.perf_counter()
    trainer.save_pretrained(str(Path(args.work) / f"saved-{args.name}"))
    times["save_s"] = time.perf_counter() - start
    peaks["save_pretrained"] = _hwm_bytes()
    starts["checkpoint"] = _reset_hwm()
    trainer.save_checkpoint()
    peaks["checkpoint"] = _hwm_bytes()
    out.write_text(json.dumps({"rank": rank, "peaks": peaks, "starts": starts, "parameters": n_params, **times}))
    import torch.distributed as dist

    dist.destroy_process_group()


def export_worker(args: argparse.Namespace) -> None:
    """Run `export_pretrained` in this fresh process; write its peak RSS."""
    from flwr_sharded.training.checkpoint_export import export_pretrained

    start = time.perf_counter()
    export_pretrained(Path(args.work) / f"ckpt-{args.name}" / "group-0", Path(args.work) / f"exported-{args.name}")
    seconds = time.perf_counter() - start
    (Path(args.work) / f"export-{args.name}.json").write_text(json.dumps({"peak": _hwm_bytes(), "seconds": seconds}))


MALLOC: dict[str, str] = {}
"""glibc allocator settings for the measured processes (`--malloc-mmap-threshold`)."""


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}",
            **MALLOC}


def _run(cmd: list[str], timeout: float) -> None:
    result = subprocess.run(cmd, env=_env(), cwd=REPO, timeout=timeout, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stderr[-4000:]}")


def _launch(args: argparse.Namespace, name: str, model: list[str], startup_only: bool = False) -> list[dict]:
    work = Path(args.work)
    shutil.rmtree(work / f"ckpt-{name}", ignore_errors=True)
    shutil.rmtree(work / f"saved-{name}", ignore_errors=True)
    train_args = ["--method", "fsdp", "--shards", str(NPROC), *model, "--data-dir", args.data_dir,
                  "--tokenizer", str(Path(args.data_dir) / "tokenizer"), "--seq-len", "64",
                  "--batch-size", "1", "--steps", "1", "--no-progress", "--checkpoint-dir", str(work / f"ckpt-{name}")]
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(NPROC), "--master-port",
          str(args.port), __file__, "--worker", "--name", name, "--work", str(work),
          *(["--startup-only"] if startup_only else []), *(["--default-allocator"] if args.default_allocator else []),
          *(["--step-threshold", str(args.step_threshold)] if args.step_threshold else []),
          "--", *train_args], timeout=args.timeout)
    ranks = [json.loads((work / f"rank-{name}-{r}.json").read_text()) for r in range(NPROC)]
    if startup_only:
        return ranks
    shutil.rmtree(work / f"exported-{name}", ignore_errors=True)
    _run([sys.executable, __file__, "--export-worker", "--name", name, "--work", str(work)], timeout=args.timeout)
    return ranks


def _same_tensors(a: Path, b: Path) -> bool:
    """The two saved models hold the same tensors, bit for bit (read one tensor at a time)."""
    import torch
    from safetensors import safe_open

    def files(d: Path) -> dict[str, Path]:
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(f, "pt") as h:
                out.update({k: f for k in h.keys()})
        return out

    fa, fb = files(a), files(b)
    if fa.keys() != fb.keys():
        return False
    for key in fa:
        with safe_open(fa[key], "pt") as ha, safe_open(fb[key], "pt") as hb:
            if not torch.equal(ha.get_tensor(key), hb.get_tensor(key)):
                return False
    return True


def main() -> int:
    from flwr_sharded import schema, tool_options
    from flwr_sharded.config import DataConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=schema.HelpFormatter)
    parser.add_argument("--out", help="results JSON")
    parser.add_argument("--label", default="", help="what is measured (e.g. before / after)")
    parser.add_argument("--work", default="/tmp/startup_memory", help="model, checkpoints, exports")
    tool_options.add_option(parser, DataConfig, "data_dir",
                      default=os.environ.get("FLWR_SHARDED_TEST_DATA", str(REPO / ".data")))
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one measured process may take")
    parser.add_argument("--port", type=int, default=29517, help="torchrun's master port")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints and saved models in --work")
    parser.add_argument("--malloc-mmap-threshold", type=int, default=None,
                        help="bytes: run the measured processes with MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ "
                             "at this value (glibc then returns freed buffers above it to the OS at once)")
    parser.add_argument("--default-allocator", action="store_true",
                        help="the ranks leave glibc's thresholds and heap alone (no flwr_sharded.host_memory)")
    parser.add_argument("--step-threshold", type=int, default=0,
                        help="bytes: the ranks' mmap and trim thresholds from the second step on (default: the "
                             "package's, flwr_sharded.host_memory.STEP_THRESHOLD_BYTES)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--export-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--name", default="", help=argparse.SUPPRESS)
    parser.add_argument("--startup-only", action="store_true", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.worker:
        worker(args, rest[1:] if rest[:1] == ["--"] else rest)
        return 0
    if args.export_worker:
        export_worker(args)
        return 0
    if args.malloc_mmap_threshold:
        MALLOC.update(MALLOC_MMAP_THRESHOLD_=str(args.malloc_mmap_threshold),
                      MALLOC_TRIM_THRESHOLD_=str(args.malloc_mmap_threshold))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    load_start, started = os.getloadavg(), time.time()
    model_dir, bf16_dir = work / "model", work / "model-bf16"
    _run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(REPO)!r}); from benchmarks.startup_memory "
                                f"import generate, generate_bf16; from pathlib import Path; "
                                f"generate(Path({str(model_dir)!r})); "
                                f"generate_bf16(Path({str(model_dir)!r}), Path({str(bf16_dir)!r}))"],
         timeout=args.timeout)
    big = _launch(args, "big", ["--model", str(model_dir), "--pretrained"])
    tiny = _launch(args, "tiny", ["--model", "tiny"])
    init = _launch(args, "init", ["--model", str(model_dir)], startup_only=True)  # same shape, seeded random init
    bf16 = _launch(args, "bf16", ["--model", str(bf16_dir), "--pretrained"], startup_only=True)  # bf16 file
    export_big = json.loads((work / "export-big.json").read_text())
    export_tiny = json.loads((work / "export-tiny.json").read_text())
    n_params = big[0]["parameters"]
    state = 16 * n_params / NPROC  # fp32 parameters + gradients + AdamW moments, this rank's share
    gib = 1 << 30
    per_rank = []
    for b, t in zip(big, tiny):
        fixed = max(t["peaks"].values())
        train_peak = max(b["peaks"]["startup"], b["peaks"]["step"])
        per_rank.append({
            "rank": b["rank"], "fixed_gib": fixed / gib, "startup_peak_gib": b["peaks"]["startup"] / gib,
            "step_peak_gib": b["peaks"]["step"] / gib, "save_pretrained_peak_gib": b["peaks"]["save_pretrained"] / gib,
            "checkpoint_peak_gib": b["peaks"]["checkpoint"] / gib,
            "startup_x": (b["peaks"]["startup"] - t["peaks"]["startup"]) / state,
            "startup_step_x": (train_peak - fixed) / state,
            "later_steps_peak_gib": b["peaks"]["later_steps"] / gib,
            "later_steps_x": (b["peaks"]["later_steps"] - fixed) / state,
            "step_extra_gib": (b["peaks"]["step"] - b["starts"]["step"]) / gib,
            "save_pretrained_extra_gib": (b["peaks"]["save_pretrained"] - b["starts"]["save_pretrained"]) / gib,
            "checkpoint_extra_gib": (b["peaks"]["checkpoint"] - b["starts"]["checkpoint"]) / gib,
            "startup_s": b["startup_s"], "step_s": b["step_s"], "later_step_s": b["later_step_s"],
            "save_s": b["save_s"],
            "within_target": train_peak <= 1.3 * state + fixed})
    def startup_summary(runs: list[dict]) -> list[dict]:
        return [{"rank": i["rank"], "startup_peak_gib": i["peaks"]["startup"] / gib,
                 "startup_x": (i["peaks"]["startup"] - t["peaks"]["startup"]) / state,
                 "startup_step_x": (max(i["peaks"].values()) - max(t["peaks"].values())) / state,
                 "startup_s": i["startup_s"]} for i, t in zip(runs, tiny)]

    export = {"peak_gib": export_big["peak"] / gib, "fixed_gib": export_tiny["peak"] / gib,
              "x": (export_big["peak"] - export_tiny["peak"]) / state, "seconds": export_big["seconds"],
              "within_target": export_big["peak"] <= 1.3 * state + export_tiny["peak"],
              "equals_save_pretrained": _same_tensors(work / "saved-big", work / "exported-big")}
    result = {
        "date": datetime.date.today().isoformat(), "label": args.label,
        "command": " ".join(["python", *sys.argv]), "git": _git_head(),
        "load_avg_start": load_start, "load_avg_end": os.getloadavg(), "seconds": time.time() - started,
        "model": {**SHAPE, "parameters": n_params, "fp32_gib": 4 * n_params / gib},
        "ranks": NPROC, "method": "fsdp", "shards": NPROC, "seq_len": 64, "batch_size": 1,
        "state_share_gib": state / gib, "target": "peak <= 1.3 x state_share + fixed",
        "malloc": MALLOC, "host_memory": not args.default_allocator, "step_threshold": args.step_threshold or None,
        "per_rank": per_rank, "max_startup_x": max(r["startup_x"] for r in per_rank),
        "max_startup_step_x": max(r["startup_step_x"] for r in per_rank),
        "max_later_steps_x": max(r["later_steps_x"] for r in per_rank), "export": export,
        "random_init": startup_summary(init), "pretrained_bf16_file": startup_summary(bf16),
        "provenance": provenance()}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    if not args.keep:
        for name in ("big", "tiny"):
            for sub in ("ckpt", "saved", "exported"):
                shutil.rmtree(work / f"{sub}-{name}", ignore_errors=True)
    return 0


def _git_head() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


if __name__ == "__main__":
    sys.exit(main())
