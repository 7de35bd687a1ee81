"""The GPU check: what one CUDA GPU (an H200) can prove about this package, in at most 8 minutes, without network.

    python benchmarks/gpu_check.py [--out DIR] [--data-dir DIR] [--dry] [--stages env,kernels,...] [--budget 480]

Writes three files in DIR: gpu_check.json (every stage: pass, fail or skip, the reason, what it measured),
summary.md and gpu_check.log (every stage's output); DIR is --out, else $OUT (the `device` tool's folder), else
benchmarks/results/gpu_check-<date>. Each stage runs in a process of its own under a timeout (the whole run under
--budget seconds), so a crash or a hang fails that stage only; runs and checkpoints go to a temporary directory.
The corpus must be prepared in --data-dir (`flwr-sharded prepare-data`): the check never downloads. Stages:

  env       torch, CUDA, NCCL, transformers and flwr versions, the device and its compute capability, the all-gather
            the sync uses (`all_gather_single`, or `all_gather_into_tensor` before torch 2.13); fails only where torch
            or transformers is below pyproject.toml's floor (no stage imports flwr: its absence is reported)
  kernels   every quantized wire's quantize/dequantize (int8, fp8 e4m3/e5m2, int4, fp4) and the top-k wire's
            select/encode/decode/scatter on CUDA, bit-equal to CPU on random, zero, huge and subnormal values
  sync      two processes on the one GPU over gloo: blocking and overlapped `ShardSync`s (float32, bfloat16 and int8
            wires) against a central weighted mean, both ranks equal; the overlapped ones again under
            TORCH_CUDA_SANITIZER=1
  train     one NCCL rank (`-m flwr_sharded.train`): a bf16 FSDP2 run with activation checkpointing, its checkpoint
            and its resume (a synchronous and an asynchronous write) against the same run straight through
  rdv       a round's federation group (`flower.rendezvous.join`) on NCCL through the rendezvous store, an
            all-reduce, its abort, and a second round's join after it
  llama-1b  `llama-1b` in bf16 on the GPU: step time, tokens/s, MFU, peak memory against the memory model
            (`flwr_sharded_perf.memory_model.trainer_memory`)
  rollback  `RollbackPoint.commit()` of `llama-1b`'s shards and AdamW moments: seconds per commit

--dry runs on CPU with no GPU (what the test suite does, so the script cannot rot): the CUDA-only checks are
skipped with their reason, the others run their CPU side (kernels CPU against CPU, the sync on CPU over gloo, the
train and rendezvous stages on gloo with the `tiny` model, llama-1b replaced by `tiny`). What needs two GPUs or more
is `benchmarks/gpu_check_multi.py`. Exit status 0 when no stage failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = 480.0
"""The whole check's seconds (8 minutes: the device tool's command limit is 10)."""
WEIGHTS = (1.0, 3.0)
"""The two sync members' FedAvg weights."""


# ------------------------------------------------------------------------------------------------------ the runner

@dataclass(frozen=True)
class Stage:
    name: str
    timeout: float
    """Seconds this stage may take at most (less when the budget has less left)."""
    run: Callable[[argparse.Namespace, Path], dict[str, Any]]
    """Runs in a process of its own; returns {"ok": bool, "reason": str, ...what it measured}."""
    needs_cuda: bool = False
    """Skipped in --dry mode (no CPU side worth running)."""


def run_stages(stages: list[Stage], args: argparse.Namespace, script: Path) -> dict[str, Any]:
    """Every selected stage in a process of its own (`script --stage NAME`), within the budget; the results. Each
    stage's output is appended to OUT/<check>.log."""
    deadline = time.monotonic() + args.budget
    results: dict[str, Any] = {}
    for stage in stages:
        if stage.name not in args.stages:
            continue
        if stage.needs_cuda and args.dry:
            results[stage.name] = {"status": "skip", "reason": "needs a CUDA GPU (--dry)"}
        elif deadline - time.monotonic() < 10:
            results[stage.name] = {"status": "skip", "reason": f"the budget of {args.budget:.0f} s is spent"}
        else:
            results[stage.name] = _run_stage(stage, args, script, min(stage.timeout, deadline - time.monotonic()))
        r = results[stage.name]
        print(f"{stage.name:9s} {r['status'].upper():4s} {r.get('seconds', 0):6.1f} s  {r['reason']}", flush=True)
    return results


def _run_stage(stage: Stage, args: argparse.Namespace, script: Path, timeout: float) -> dict[str, Any]:
    result_file = Path(args.work) / f"{stage.name}.json"
    log_file = Path(args.work) / f"{stage.name}.log"
    cmd = [sys.executable, str(script), "--stage", stage.name, "--out", args.out, "--work", args.work,
           "--data-dir", args.data_dir, *(["--dry"] if args.dry else [])]
    start = time.monotonic()
    with open(log_file, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=_env(),
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the stage and every process it started
            proc.wait()
            code = None
    seconds = round(time.monotonic() - start, 1)
    with open(Path(args.out) / f"{args.title}.log", "a") as log:
        log.write(f"===== {stage.name} ({seconds} s, exit {code})\n{log_file.read_text()}\n")
    if code is None:
        return {"status": "fail", "reason": f"timed out after {timeout:.0f} s", "seconds": seconds}
    if not result_file.is_file():
        return {"status": "fail", "reason": f"exited {code} without a result ({args.title}.log)", "seconds": seconds}
    result = json.loads(result_file.read_text())
    status = "pass" if result.pop("ok") and code == 0 else "fail"
    return {"status": status, "reason": result.pop("reason", ""), "seconds": seconds, **result}


def _env() -> dict[str, str]:
    """The stages' environment: this repository importable, no network, one thread per process on CPU."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def stage_main(stages: list[Stage], args: argparse.Namespace) -> int:
    """In a stage's own process: run it and write its result; an exception is the stage's failure, with its reason."""
    stage = next(s for s in stages if s.name == args.stage)
    work = Path(args.work) / stage.name
    work.mkdir(parents=True, exist_ok=True)
    try:
        result = stage.run(args, work)
    except Exception as exc:  # noqa: BLE001 - the reason is the result
        import traceback

        traceback.print_exc()
        result = {"ok": False, "reason": f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"}
    (Path(args.work) / f"{stage.name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


def write_report(title: str, results: dict[str, Any], args: argparse.Namespace) -> bool:
    """DIR/<name>.json and DIR/summary.md; whether no stage failed."""
    out = Path(args.out)
    ok = all(r["status"] != "fail" for r in results.values())
    report = {"check": title, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "dry": args.dry, "ok": ok,
              "provenance": args.provenance, "stages": results}
    (out / f"{title}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    lines = [f"# {title} ({'dry run on CPU' if args.dry else 'GPU'}, {report['date']})", "",
             f"{'no stage failed' if ok else 'FAILED'}: " + ", ".join(
                 f"{sum(r['status'] == s for r in results.values())} {s}" for s in ("pass", "fail", "skip")), "",
             "| stage | status | seconds | reason |", "|---|---|---|---|"]
    lines += [f"| {name} | {r['status']} | {r.get('seconds', '')} | {r['reason']} |" for name, r in results.items()]
    lines += ["", f"Details: `{title}.json`; every stage's output: `{title}.log`."]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return ok


def torchrun(nproc: int, args: list[str], *, timeout: float, env: dict[str, str] | None = None,
             module: bool = True) -> subprocess.CompletedProcess:
    """`torchrun --standalone` of `-m MODULE ARGS` (or a script), its output captured; TimeoutExpired past `timeout`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           *(["-m"] if module else []), *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env or _env())
    print(f"$ torchrun --nproc-per-node {nproc} {' '.join(args)}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}",
          flush=True)
    return proc


def records(run_dir: Path, kind: str, *, after_resume: bool = False) -> list[dict[str, Any]] | None:
    """The run's metrics.jsonl records of one kind (`after_resume`: those after its resume record; None if none)."""
    path = run_dir / "metrics.jsonl"
    every = [json.loads(line) for line in (path.read_text().splitlines() if path.is_file() else []) if line.strip()]
    if after_resume:
        kinds = [r.get("kind") for r in every]
        if "resume" not in kinds:
            return None
        every = every[kinds.index("resume") + 1:]
    return [r for r in every if r.get("kind") == kind]


def device_of(args: argparse.Namespace) -> str:
    return "cpu" if args.dry else "cuda"


# ------------------------------------------------------------------------------------------------------ the stages

def stage_env(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import importlib.metadata as meta
    import platform

    import torch
    import torch.distributed as dist

    def version(name: str) -> str:
        try:
            return meta.version(name)
        except meta.PackageNotFoundError:
            return "not installed"

    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "transformers": version("transformers"), "flwr": version("flwr"),
                           "all_gather": "all_gather_single" if hasattr(dist, "all_gather_single") else
                           "all_gather_into_tensor",
                           "nccl_available": dist.is_nccl_available(), "cuda": torch.version.cuda,
                           "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        out.update(devices=torch.cuda.device_count(), device=torch.cuda.get_device_name(0),
                   capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                   memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
                   nccl=".".join(map(str, torch.cuda.nccl.version())), cudnn=torch.backends.cudnn.version(),
                   bf16=torch.cuda.is_bf16_supported())
    out["floors"] = floors()
    problems = [f"{name} {out[name]} is below the floor {floor} (pyproject.toml)" for name, floor in
                out["floors"].items() if name in NEEDED and _below(out[name], floor)]
    if not args.dry and not out["cuda_available"]:
        problems.append("no CUDA GPU")
    return {"ok": not problems, "reason": "; ".join(problems) or
            f"torch {out['torch']}, CUDA {out['cuda']}, NCCL {out.get('nccl')}, {out.get('device', 'CPU')}, "
            f"transformers {out['transformers']}, flwr {out['flwr']}", **out}


NEEDED = ("torch", "transformers")
"""What the stages import of the floors pyproject.toml declares (flwr: none of them)."""


def floors() -> dict[str, str]:
    """The lowest versions pyproject.toml declares ("NAME>=FLOOR") of torch, transformers and flwr."""
    text = (REPO / "pyproject.toml").read_text()
    return {name: m.group(1) for name in ("torch", "transformers", "flwr")
            for m in [re.search(rf'"{name}(?:\[[a-z,]*\])?>=([0-9.]+)', text)] if m}


def _below(version: str, floor: str) -> bool:
    """Whether a release (2.11.0+cu130; "not installed") is below a floor (2.8)."""
    def numbers(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])

    return version == "not installed" or numbers(version) < numbers(floor)


def _values(n: int, seed: int) -> dict[str, Any]:
    """Inputs that stress a blockwise format: random, zeros, huge, subnormal, mixed, a partial last block."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    tiny = torch.finfo(torch.float32).tiny
    mixed = torch.randn(n, generator=gen)
    mixed[::7] = 0.0
    mixed[3::11] = 3e38
    mixed[5::13] = -1e30
    mixed[6::17] = tiny / 8  # subnormal
    return {"random": torch.randn(n, generator=gen), "zeros": torch.zeros(n), "huge": torch.full((n,), 3e38),
            "subnormal": torch.randn(n, generator=gen) * tiny / 4, "mixed": mixed,
            "partial": torch.randn(n - 37, generator=gen)}


def _bits(t: Any) -> Any:
    """A tensor's bytes on the CPU (bit equality, NaN and -0.0 included)."""
    return t.detach().contiguous().cpu().view(-1).view(__import__("torch").uint8)


def stage_kernels(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch

    from flwr_sharded.parallel import sparse
    from flwr_sharded.parallel.codecs.blockwise import dequantize, quantize
    from flwr_sharded.parallel.wire import QUANTIZED, WIRES

    device = torch.device(device_of(args))
    failures, checked, skipped = [], [], []
    for name in QUANTIZED:
        wire = WIRES[name]
        why = wire.unsupported("cpu") or wire.unsupported(device)
        if why:
            skipped.append(f"{name}: {why}")
            continue
        for case, x in _values(4096, 0).items():
            ref = quantize(x, wire.torch_dtype())
            got = quantize(x.to(device), wire.torch_dtype())
            pairs = [("codes", ref.values, got.values), ("scales", ref.scales, got.scales),
                     ("dequantized", dequantize(ref), dequantize(got))]
            for what, a, b in pairs:
                if not torch.equal(_bits(a), _bits(b)):
                    failures.append(f"{name}/{case}: {what} differ")
            checked.append(f"{name}/{case}")
    for values in ["float32", "bfloat16", *QUANTIZED]:
        if WIRES[values].unsupported("cpu") or WIRES[values].unsupported(device):
            continue
        wire = sparse.SparseWire(WIRES[values], 0.05)
        for case, x in _values(3 * sparse.CHUNK + 100, 1).items():
            layout = wire.layout(x.numel())
            dev_x = x.to(device, copy=True)
            idx, val = sparse.select(x, layout, torch.empty_like(x))
            didx, dval = sparse.select(dev_x, layout, torch.empty_like(dev_x))
            # with ties (zeros, huge) which of the equal entries top-k keeps is the device's choice
            if case not in ("zeros", "huge") and not _same_selection(idx, val, didx.cpu(), dval.cpu(), layout):
                failures.append(f"topk-{values}/{case}: select keeps other entries")
            row, drow = torch.zeros(layout.bytes, dtype=torch.uint8), torch.zeros(layout.bytes, dtype=torch.uint8,
                                                                                 device=device)
            sent = sparse.encode_row(idx, val, layout, row)  # the CPU's selection, on both devices
            dsent = sparse.encode_row(idx.to(device), val.to(device), layout, drow)
            if layout.codec is not None and not layout.codec.exact_across_devices:  # (a codebook's bin means are
                # sums, rounded as each device sums): decode the CPU's row
                drow.copy_(row)
                dsent = sparse.decode_row(drow, layout)[1]
            di, dv = sparse.decode_row(drow, layout)
            ci, cv = sparse.decode_row(row, layout)
            dense, ddense = torch.zeros_like(x), torch.zeros_like(dev_x)
            sparse.scatter(dense, layout, ci, cv, add=True)
            sparse.scatter(ddense, layout, di, dv, add=True)
            for what, a, b in [("row", row, drow), ("encoded values", sent, dsent), ("decoded", cv, dv),
                               ("scattered", dense, ddense)]:
                if not torch.equal(_bits(a), _bits(b)):
                    failures.append(f"topk-{values}/{case}: {what} differ")
            checked.append(f"topk-{values}/{case}")
    reason = (f"{len(failures)} mismatch(es): {'; '.join(failures[:6])}" if failures else
              f"{len(checked)} cases bit-equal, {device} against cpu")
    if skipped:
        reason += f" (skipped {'; '.join(skipped)})"
    return {"ok": not failures and bool(checked), "reason": reason, "checked": checked, "failures": failures,
            "skipped": skipped}


def _same_selection(idx: Any, val: Any, didx: Any, dval: Any, layout: Any) -> bool:
    """Whether two top-k selections keep the same (index, value) entries chunk by chunk, in any order."""
    import torch

    start = 0
    for rows, k in [(layout.full, layout.per_chunk), (1 if layout.rest else 0, layout.kept - layout.full *
                                                     layout.per_chunk)]:
        for _ in range(rows):
            a, b = idx[start:start + k].sort(), didx[start:start + k].sort()
            if not (torch.equal(a.values, b.values) and
                    torch.equal(_bits(val[start:start + k][a.indices]), _bits(dval[start:start + k][b.indices]))):
                return False
            start += k
    return True


SYNC_CASES = {"float32": 1e-6, "bfloat16": 2e-3, "int8": 2e-3}
"""The wires the sync stage runs, each with its tolerance against the central mean (fp64)."""


def stage_sync(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    script = str(Path(__file__).resolve())
    runs = {"plain": {}}
    if not args.dry:
        runs["sanitizer"] = {"TORCH_CUDA_SANITIZER": "1"}
    out: dict[str, Any] = {}
    problems = []
    for run, extra in runs.items():
        rundir = work / run
        rundir.mkdir(parents=True, exist_ok=True)
        modes = "overlapped" if run == "sanitizer" else "blocking,overlapped"
        proc = torchrun(2, [script, "--worker", "sync", "--out", str(rundir), "--device", device_of(args),
                            "--modes", modes], timeout=240, env={**_env(), **extra}, module=False)
        ranks = [json.loads(p.read_text()) for p in sorted(rundir.glob("rank*.json"))]
        if proc.returncode != 0 or len(ranks) != 2:
            tail = " ".join((proc.stderr or proc.stdout).split()[-40:])
            problems.append(f"{run}: exit {proc.returncode}, {len(ranks)} rank result(s): {tail[-300:]}")
            continue
        for case, r0 in ranks[0].items():
            r1 = ranks[1][case]
            bad = r0.get("error") or r1.get("error") or (
                None if r0["max_err"] <= r0["tolerance"] and r1["max_err"] <= r1["tolerance"] else
                f"off the central mean by {max(r0['max_err'], r1['max_err']):.3g} > {r0['tolerance']:g}") or (
                None if r0["digest"] == r1["digest"] else "the two ranks differ")
            out[f"{run}/{case}"] = {"max_err": max(r0.get("max_err", -1), r1.get("max_err", -1)),
                                    "seconds": r0.get("seconds"), "problem": bad}
            if bad:
                problems.append(f"{run}/{case}: {bad}")
    return {"ok": not problems and bool(out), "cases": out,
            "reason": "; ".join(problems)[:600] or f"{len(out)} syncs equal the central weighted mean"}


def worker_sync(args: argparse.Namespace) -> None:
    """One of two gloo ranks: each wire's blocking and/or overlapped sync against the central weighted mean."""
    import hashlib

    import torch
    import torch.distributed as dist

    from flwr_sharded.parallel.sync import ShardSync
    from flwr_sharded.parallel.wire import WIRES

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    results: dict[str, Any] = {}
    for mode in args.modes.split(","):
        for wire, tolerance in SYNC_CASES.items():
            case = f"{mode}/{wire}"
            try:
                gen = torch.Generator().manual_seed(1234)  # the same global model on both ranks
                params = [torch.nn.Parameter(torch.randn(shape, generator=gen).to(device))
                          for shape in [(300, 40), (1000,), (7, 13), (5000,)]]
                sync = ShardSync([(f"p{i}", p) for i, p in enumerate(params)], fed_group=dist.group.WORLD,
                                 bucket_bytes=16384, wire=None if wire == "float32" else WIRES[wire],
                                 error_feedback=wire == "int8")
                if sync.keeps_global:
                    sync.capture_global()
                local = torch.Generator().manual_seed(100 + rank)
                with torch.no_grad():  # local training's stand-in: a member-specific move of every shard
                    for p in params:
                        p.add_(0.01 * torch.randn(p.shape, generator=local).to(device))
                before = [p.detach().double().cpu() for p in params]
                everyone: list = [None] * world
                dist.all_gather_object(everyone, (WEIGHTS[rank], before))
                total = sum(w for w, _ in everyone)
                expected = [sum(w * b[i] for w, b in everyone) / total for i in range(len(params))]
                start = time.perf_counter()
                if mode == "overlapped":
                    sync.start(WEIGHTS[rank], overlap=True)
                    with torch.no_grad():  # steps taken while the sync is in flight: not in the mean (alpha 0)
                        for p in params:
                            p.mul_(2.0)
                    sync.finish(timeout=60)
                else:
                    sync.sync(WEIGHTS[rank])
                if device.type == "cuda":
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - start
                after = [p.detach().cpu() for p in params]
                err = max(float((a.double() - e).abs().max()) for a, e in zip(after, expected))
                digest = hashlib.sha256(b"".join(a.numpy().tobytes() for a in after)).hexdigest()
                results[case] = {"max_err": err, "tolerance": tolerance, "digest": digest, "seconds": seconds}
            except Exception as exc:  # noqa: BLE001 - recorded; the next case runs
                results[case] = {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}",
                                 "tolerance": tolerance}
                print(f"rank {rank} {case}: {results[case]['error']}", flush=True)
                break  # a failed collective may leave the group unusable: the other rank breaks too
        else:
            continue
        break
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(results) + "\n")
    dist.destroy_process_group()


def _train_args(args: argparse.Namespace, model: str) -> list[str]:
    gpu = not args.dry
    return ["--method", "fsdp", "--shards", "1", "--model", model, "--precision", "bf16" if gpu else "fp32",
            "--data-dir", args.data_dir, "--no-save-model", "--no-progress", "--eval-every", "0",
            "--eval-blocks", "0", "--log-every", "1"]


def stage_train(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """A straight run of 8 steps; 4 steps with a checkpoint, resumed to 8 (sync write, then async); equal losses."""
    model = "tiny" if args.dry else "small"
    seq, batch = ("32", "2") if args.dry else ("256", "4")
    common = [*_train_args(args, model), "--activation-checkpointing", "--seq-len", seq, "--batch-size", batch,
              "--warmup", "0", "--min-lr-ratio", "1.0", "--lr", "1e-3"]  # a constant rate: 4 steps then 4 = 8
    if args.dry:  # the CPU side: a checkpoint written asynchronously, and its resume
        runs, writes = {}, {"async-write": ["--async-checkpoint"]}
    else:
        runs, writes = {"straight": ["--steps", "8"]}, {"sync-write": [], "async-write": ["--async-checkpoint"]}
    for name, extra in writes.items():
        ckpt = ["--checkpoint-dir", str(work / f"ckpt-{name}"), "--checkpoint-every", "4"]
        runs[f"{name}/first"] = ["--steps", "4", *ckpt, *extra]
        runs[f"{name}/resumed"] = ["--steps", "8", *ckpt, *extra, "--resume"]
    losses: dict[str, dict[int, float]] = {}
    for name, extra in runs.items():
        run_dir = work / name.replace("/", "-")
        proc = torchrun(1, ["flwr_sharded.train", *common, *extra, "--run-dir", str(run_dir)], timeout=150)
        if proc.returncode != 0:
            return {"ok": False, "reason": f"{name}: exit {proc.returncode}: " +
                    " ".join(proc.stderr.split()[-30:])[-400:]}
        taken = records(run_dir, "train", after_resume=name.endswith("resumed"))
        if taken is None:
            return {"ok": False, "reason": f"{name}: no resume record (did not resume)", "losses": losses}
        losses[name] = {r["step"]: r["loss"] for r in taken}
    problems = [f"{n}: loss not finite" for n, ls in losses.items() if not all(v == v and abs(v) < 1e9
                                                                             for v in ls.values())]
    diffs = {}
    for name in writes:
        resumed = losses[f"{name}/resumed"]
        if sorted(resumed) != [5, 6, 7, 8]:
            problems.append(f"{name}: the resumed run logged steps {sorted(resumed)}, not 5-8")
        if "straight" in losses:
            diffs[name] = max(abs(resumed.get(s, float("inf")) - losses["straight"][s]) for s in (5, 6, 7, 8))
            if diffs[name] > 1e-2:  # bf16 on a GPU: the steps after a resume need not be bit-equal
                problems.append(f"{name}: resumed losses differ from the straight run by {diffs[name]:.3g}")
    return {"ok": not problems, "losses": losses, "resume_loss_diff": diffs,
            "reason": "; ".join(problems) or f"{model}: trained, checkpointed ({', '.join(writes)}), resumed" +
            (f", resumed losses within {max(diffs.values()):.2g} of the straight run" if diffs else "")}


def stage_rdv(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from flwr_sharded.flower import rendezvous

    device = torch.device(device_of(args))
    backend = "gloo" if args.dry else "nccl"
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    served = rendezvous.serve_stores("127.0.0.1", 1)
    secret = secrets.token_hex(32)
    out: dict[str, Any] = {"backend": backend}
    try:
        for r, failed in enumerate((True, False)):  # the first round is aborted, the second destroyed
            served.open_round(f"gpucheck/round{r}", secret, 1)
            start = time.monotonic()
            group = rendezvous.join(host="127.0.0.1", port=served.ports[0], prefix=f"gpucheck/round{r}/s0", rank=0,
                                    size=1, rendezvous_timeout=30, sync_timeout=30, secret=secret,
                                    members=["node-a"], backend=backend, device=device)
            value = torch.full((4,), 2.0, device=device)
            dist.all_reduce(value, group=group.pg)
            if device.type == "cuda":
                torch.cuda.synchronize()
            joined = time.monotonic() - start
            if not torch.equal(value.cpu(), torch.full((4,), 2.0)):
                return {"ok": False, "reason": f"round {r}: all-reduce of one member gave {value.tolist()}", **out}
            start = time.monotonic()
            group.destroy(failed=failed)
            out[f"round{r}"] = {"join_s": round(joined, 3), "aborted" if failed else "destroyed_s":
                                round(time.monotonic() - start, 3)}
    finally:
        served.close()
    return {"ok": True, "reason": f"{backend}: joined, all-reduced, aborted; joined again after the abort", **out}


def stage_llama(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from flwr_sharded.train import resolve_config, train_parser
    from flwr_sharded_perf.memory_model import StepOptions, trainer_memory
    from flwr_sharded_perf.model_shape import model_from_preset

    model, seq, batch, steps = ("tiny", 32, 2, 2) if args.dry else ("llama-1b", 2048, 4, 12)
    flags = [*_train_args(args, model), "--seq-len", str(seq), "--batch-size", str(batch), "--steps", str(steps),
             "--log-every", str(steps // 2)]
    run_dir = work / "run"
    proc = torchrun(1, ["flwr_sharded.train", *flags, "--run-dir", str(run_dir)], timeout=300)
    train = records(run_dir, "train")
    if proc.returncode != 0 or not train:
        return {"ok": False, "reason": f"exit {proc.returncode}, {len(train)} train record(s): " +
                " ".join(proc.stderr.split()[-30:])[-400:]}
    last = train[-1]
    cfg = resolve_config(train_parser().parse_args(flags))
    predicted = trainer_memory(model_from_preset(model, 8192), S=1, tokens=seq * batch,
                               options=StepOptions.from_config(cfg, device_of(args)))
    predicted_mib = predicted.total / 2**20
    ratio = last["peak_memory_mib"] / predicted_mib
    out = {k: last.get(k) for k in ("step", "loss", "tokens_per_s", "tflops_per_rank", "mfu", "peak_memory_mib",
                                    "step_s")}
    out.update(model=model, predicted_peak_mib=round(predicted_mib, 1), measured_over_predicted=round(ratio, 3),
               peak_phase=predicted.peak_phase)
    problems = [] if last["loss"] == last["loss"] else ["loss not finite"]
    if not args.dry and not 0.75 <= ratio <= 1.25:  # on CPU the peak is the process's RSS: not comparable
        problems.append(f"peak memory {last['peak_memory_mib']:.0f} MiB is {ratio:.2f}x the model's")
    mfu = f", MFU {100 * out['mfu']:.1f}%" if out.get("mfu") else ""
    against = "(the process's RSS on CPU: not compared)" if args.dry else f"= {ratio:.2f}x the memory model's"
    return {"ok": not problems, **out, "reason": "; ".join(problems) or
            f"{model}: {out['tokens_per_s']:.0f} tokens/s{mfu}, step {out['step_s']:.3f} s, peak "
            f"{out['peak_memory_mib']:.0f} MiB {against}"}


def stage_rollback(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import statistics

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from flwr_sharded.parallel.alignment import local_shard
    from flwr_sharded.parallel.rollback import RollbackPoint
    from flwr_sharded.parallel.sharding import mixed_precision_policy
    from flwr_sharded.training.model_init import build_sharded_model

    device = device_of(args)
    model_name = "tiny" if args.dry else "llama-1b"
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh(device, (1,), mesh_dim_names=("shard",))
    model = build_sharded_model(model_name, vocab_size=8192, max_seq_len=2048, mesh=mesh, seed=0,
                                mp_policy=mixed_precision_policy("auto", device), device=device)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()  # the moments exist, as after a first step
    point = RollbackPoint([(params, None)], optimizer, clock=lambda: {"step": 1}, set_clock=lambda state: None)
    seconds = []
    for _ in range(3):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        point.commit()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    shard_gib = sum(local_shard(p).numel() * local_shard(p).element_size() for p in params) / 2**30
    dist.destroy_process_group()
    median = statistics.median(seconds)
    return {"ok": True, "model": model_name, "commit_s": [round(s, 4) for s in seconds], "shard_gib": shard_gib,
            "reason": f"{model_name}: commit of {shard_gib:.2f} GiB of shards and 2 moments each: {median:.3f} s "
                      f"(median of 3)"}


STAGES = [Stage("env", 30, stage_env), Stage("kernels", 45, stage_kernels), Stage("sync", 90, stage_sync),
          Stage("train", 120, stage_train), Stage("rdv", 30, stage_rdv), Stage("llama-1b", 120, stage_llama),
          Stage("rollback", 45, stage_rollback)]
"""Each stage's seconds add up to the budget (BUDGET_S): every stage fits, and one that overruns fails alone."""
WORKERS = {"sync": worker_sync}


def parser(description: str, stages: list[Stage], workers: dict[str, Any]) -> argparse.ArgumentParser:
    """The command line of this script and of gpu_check_multi.py."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", ""),
                   help="results directory (default: $OUT, else benchmarks/results/<check>-<date>)")
    p.add_argument("--data-dir", default=os.environ.get("FLWR_SHARDED_DATA", str(Path.home() / ".cache" /
                                                                                    "flwr_sharded")),
                   help="the prepared corpus (`flwr-sharded prepare-data --data-dir DIR`; default $FLWR_SHARDED_DATA)")
    p.add_argument("--dry", action="store_true", help="on CPU: skip what needs CUDA, run the CPU side of the rest")
    names = [s.name for s in stages]
    p.add_argument("--stages", default=",".join(names), help=f"a comma-separated subset of {','.join(names)}")
    p.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole check")
    p.add_argument("--stage", choices=names, help=argparse.SUPPRESS)  # internal: one stage, in its own process
    p.add_argument("--work", default="", help=argparse.SUPPRESS)  # internal: the stages' scratch directory
    p.add_argument("--worker", choices=sorted(workers), help=argparse.SUPPRESS)  # internal: a torchrun rank
    p.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    p.add_argument("--modes", default="blocking,overlapped", help=argparse.SUPPRESS)  # the sync worker's
    p.add_argument("--worker-args", default="", help=argparse.SUPPRESS)  # a worker's own, comma-separated
    return p


def main(title: str = "gpu_check", stages: list[Stage] = STAGES, workers: dict[str, Any] = WORKERS,
         doc: str = __doc__, script: Path = Path(__file__).resolve(), min_gpus: int = 1) -> int:
    args = parser(doc, stages, workers).parse_args()
    if args.worker:
        workers[args.worker](args)
        return 0
    if not args.dry and not args.stage:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < min_gpus:
            print(f"{title}: {gpus} CUDA GPU(s) on this machine, it needs {min_gpus}; nothing was checked "
                  f"(--dry runs the CPU side)", file=sys.stderr)
            return 2
    if not args.out:
        args.out = str(REPO / "benchmarks" / "results" / f"{title}-{time.strftime('%Y-%m-%d')}")
    args.title = title
    if args.stage:
        return stage_main(stages, args)
    args.stages = set(args.stages.split(","))
    unknown = args.stages - {s.name for s in stages}
    if unknown:
        raise SystemExit(f"--stages: unknown {sorted(unknown)}; choose from {', '.join(s.name for s in stages)}")
    if not (Path(args.data_dir) / "tokenizer" / "tokenizer.json").is_file():
        raise SystemExit(f"--data-dir {args.data_dir}: no prepared corpus (tokenizer/tokenizer.json); run "
                         f"`flwr-sharded prepare-data --data-dir {args.data_dir}` where the network is, and carry it")
    if str(REPO) not in sys.path:  # the package need not be installed (the lent image has it only as this tree)
        sys.path.insert(0, str(REPO))
    from flwr_sharded_perf.provenance import provenance

    args.provenance = provenance()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"{title}.log").write_text("")
    print(f"{title}: {'dry run on CPU' if args.dry else 'GPU'}; results in {args.out}", flush=True)
    with tempfile.TemporaryDirectory(prefix=f"{title}-") as work:  # checkpoints, run directories: not kept
        args.work = work
        results = run_stages(stages, args, script)
    ok = write_report(title, results, args)
    print(f"{title}: {'no stage failed' if ok else 'FAILED'}; {Path(args.out) / 'summary.md'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
