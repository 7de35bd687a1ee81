"""The GPU check for a machine of two CUDA GPUs or more: what one GPU cannot prove (`gpu_check.py` does the rest).

    python benchmarks/gpu_check_multi.py [--out DIR] [--data-dir DIR] [--dry] [--stages ring,...] [--budget 480]

The same runner, outputs and options as `benchmarks/gpu_check.py` (DIR/gpu_check_multi.json, DIR/summary.md,
DIR/gpu_check_multi.log). Stages:

  env       as gpu_check's, and at least two GPUs
  ring      every quantized wire's all-reduce (`parallel.ring.quantized_all_reduce`, the point-to-point ring
            then `all_gather_single`) on NCCL over min(GPUs, 4) ranks: bit-equal on every rank, bit-equal to the same
            ring over gloo on CPU copies, within its roundings of the fp64 sum
  overlap   the static engine, FL+FSDP with 2 groups over all GPUs (up to 8), 2 fragments with an overlapped sync
            (`--sync-delay 1`) and an int8 wire: FSDP's communicator on the main thread and the federation's on the
            sync thread at once; the run must end, its losses finite, and (`nvidia-smi` per pid, sampled while it
            runs) every rank's process must hold memory on its own GPU only: no stray context on GPU 0
  abort     a round's federation group of 2 members (`flower.rendezvous.join`, NCCL), one member killed (SIGKILL)
            after a first all-reduce: the survivor's next all-reduce, waited for with a timeout, must raise within
            it, and the group's abort (`destroy(failed=True)`) must return

--dry runs on CPU: the ring over gloo (CPU against CPU), the abort with gloo; the overlap stage is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check as base  # noqa: E402 - the runner, shared
from gpu_check import Stage  # noqa: E402


def stage_env(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    out = base.stage_env(args, work)
    if not args.dry and out.get("devices", 0) < 2:
        out.update(ok=False, reason=f"{out.get('devices', 0)} GPU(s): this check needs two or more")
    return out


def _ranks() -> int:
    import torch

    return min(torch.cuda.device_count(), 4) if torch.cuda.is_available() else 2


def stage_ring(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    ranks = 2 if args.dry else _ranks()
    proc = base.torchrun(ranks, [str(Path(__file__).resolve()), "--worker", "ring", "--out", str(work), "--device",
                                 base.device_of(args)], timeout=180, module=False)
    results = [json.loads(p.read_text()) for p in sorted(work.glob("rank*.json"))]
    if proc.returncode != 0 or len(results) != ranks:
        return {"ok": False, "reason": f"exit {proc.returncode}, {len(results)} of {ranks} rank result(s): " +
                " ".join(proc.stderr.split()[-30:])[-400:]}
    problems = []
    for wire, r0 in results[0].items():
        if any(r[wire].get("error") for r in results):
            problems.append(f"{wire}: {next(r[wire]['error'] for r in results if r[wire].get('error'))}")
        elif len({r[wire]["digest"] for r in results}) != 1:
            problems.append(f"{wire}: the ranks' results differ")
        elif not all(r[wire]["equals_gloo_cpu"] for r in results):
            problems.append(f"{wire}: the NCCL result differs from gloo's on CPU")
        elif not all(r[wire]["rel_err"] <= r[wire]["tolerance"] for r in results):
            problems.append(f"{wire}: off the sum by {max(r[wire]['rel_err'] for r in results):.3g}")
    return {"ok": not problems, "ranks": ranks, "wires": results[0], "reason": "; ".join(problems)[:600] or
            f"{len(results[0])} wires over {ranks} ranks: equal on every rank and to gloo on CPU, within roundings"}


RING_TOLERANCE = {"int8": 0.02, "float8_e4m3fn": 0.1, "float8_e5m2": 0.2, "int4": 0.3, "float4_e2m1": 0.4,
                  "int2": 1.0}
"""Relative error of a quantized ring's sum (max |error| over max |sum|) that each wire stays within (int2: a block's
largest value decodes as the mean of its class, off by most of its size at each of the ring's roundings)."""


def worker_ring(args: argparse.Namespace) -> None:
    import hashlib

    import torch
    import torch.distributed as dist

    from flwr_sharded.parallel.ring import quantized_all_reduce
    from flwr_sharded.parallel.wire import QUANTIZED, WIRES

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cpu_group = dist.new_group(backend="gloo")
    results: dict[str, Any] = {}
    for name in QUANTIZED:
        wire = WIRES[name]
        if wire.unsupported(device) or wire.unsupported("cpu"):
            continue
        try:
            gen = torch.Generator().manual_seed(7 + rank)
            mine = torch.randn(100_003, generator=gen)
            mine[::97] = 0.0
            everyone = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(everyone, mine, group=cpu_group)
            exact = torch.stack([t.double() for t in everyone]).sum(0)
            flat = mine.to(device, copy=True)  # on CPU too: `mine` stays the input
            quantized_all_reduce(flat, None, dtype=wire.torch_dtype())
            on_cpu = mine.clone()
            quantized_all_reduce(on_cpu, cpu_group, dtype=wire.torch_dtype())
            got = flat.cpu()
            rel = float((got.double() - exact).abs().max() / exact.abs().max())
            results[name] = {"rel_err": rel, "tolerance": RING_TOLERANCE.get(name, 0.5),
                             "equals_gloo_cpu": bool(torch.equal(got.view(torch.int32), on_cpu.view(torch.int32))),
                             "digest": hashlib.sha256(got.numpy().tobytes()).hexdigest()}
        except Exception as exc:  # noqa: BLE001 - recorded
            results[name] = {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}
            break
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(results) + "\n")
    dist.destroy_process_group()


def _gpu_memory_by_pid() -> dict[int, set[str]]:
    """The GPUs (uuids) each process holds memory on, from nvidia-smi."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20, check=True).stdout
    held: dict[int, set[str]] = {}
    for line in out.splitlines():
        pid, uuid = [x.strip() for x in line.split(",")[:2]]
        held.setdefault(int(pid), set()).add(uuid)
    return held


def stage_overlap(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch

    gpus = min(torch.cuda.device_count(), 8)
    gpus -= gpus % 2
    run_dir = work / "run"
    flags = ["flwr_sharded.train", "--method", "fl-fsdp", "--federations", "2", "--shards", str(gpus // 2),
             "--model", "small", "--precision", "bf16", "--steps", "40", "--aggregate-every", "4",
             "--sync-fragments", "2", "--sync-delay", "1", "--sync-dtype", "int8", "--sync-error-feedback",
             "--seq-len", "512", "--batch-size", "4", "--eval-every", "0", "--eval-blocks", "0", "--log-every", "5",
             "--data-dir", args.data_dir, "--run-dir", str(run_dir), "--no-save-model", "--no-progress"]
    samples: list[dict[int, set[str]]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(2.0):
            try:
                samples.append(_gpu_memory_by_pid())
            except (OSError, subprocess.SubprocessError):
                pass

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        proc = base.torchrun(gpus, flags, timeout=300)
    finally:
        done.set()
        sampler.join()
    train = base.records(run_dir, "train") or []
    problems = [] if proc.returncode == 0 else [f"exit {proc.returncode}: " +
                                                " ".join(proc.stderr.split()[-30:])[-400:]]
    if not train or not all(r["loss"] == r["loss"] for r in train):
        problems.append(f"{len(train)} train record(s), losses {[r['loss'] for r in train]}")
    stray = sorted({pid for s in samples for pid, uuids in s.items() if len(uuids) > 1})
    if not samples:
        problems.append("nvidia-smi gave no sample")
    elif stray:
        problems.append(f"processes {stray} hold memory on more than one GPU (a stray context)")
    return {"ok": not problems, "gpus": gpus, "samples": len(samples), "stray_pids": stray,
            "syncs": len(base.records(run_dir, "sync") or []), "reason": "; ".join(problems) or
            f"fl-fsdp over {gpus} GPUs with an overlapped int8 sync: ended, losses finite, one GPU per process "
            f"in {len(samples)} samples"}


def stage_abort(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from flwr_sharded.flower import rendezvous

    served = rendezvous.serve_stores("127.0.0.1", 1)
    secret = secrets.token_hex(32)
    served.open_round("gpucheck/abort", secret, 1)
    script = str(Path(__file__).resolve())
    procs = []
    try:
        for rank in range(2):
            cmd = [sys.executable, script, "--worker", "peer", "--out", str(work), "--device", base.device_of(args),
                   "--worker-args", f"{rank},{served.ports[0]},{secret}"]
            procs.append(subprocess.Popen(cmd, cwd=base.REPO, env=base._env()))
        deadline = time.monotonic() + 90
        while not (work / "ready1").exists():
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                return {"ok": False, "reason": "the two members did not form the group and all-reduce once"}
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        (work / "go").touch()
        procs[0].wait(timeout=120)
        result = json.loads((work / "rank0.json").read_text())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        served.close()
    return result


ABORT_WAIT_S = 15.0
"""How long the survivor waits for its all-reduce with the killed member."""


def worker_peer(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from flwr_sharded.flower import rendezvous

    rank, port, secret = args.worker_args.split(",")
    rank, work = int(rank), Path(args.out)
    device = torch.device(args.device if args.device == "cpu" else f"cuda:{rank % torch.cuda.device_count()}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = rendezvous.join(host="127.0.0.1", port=int(port), prefix="gpucheck/abort/s0", rank=rank, size=2,
                            rendezvous_timeout=60, sync_timeout=60, secret=secret, members=["node-a", "node-b"],
                            backend="nccl" if device.type == "cuda" else "gloo", device=device)
    value = torch.ones(4, device=device)
    dist.all_reduce(value, group=group.pg)
    (work / f"ready{rank}").touch()
    if rank == 1:
        time.sleep(600)  # killed by the stage
    while not (work / "go").exists():
        time.sleep(0.1)
    start = time.monotonic()
    try:
        work_handle = dist.all_reduce(value, group=group.pg, async_op=True)
        work_handle.wait(timeout=timedelta(seconds=ABORT_WAIT_S))
        if device.type == "cuda":
            torch.cuda.synchronize()
        raised = None
    except Exception as exc:  # noqa: BLE001 - what we expect
        raised = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    waited = time.monotonic() - start
    start = time.monotonic()
    group.destroy(failed=True)
    aborted = time.monotonic() - start
    ok = raised is not None and waited <= ABORT_WAIT_S + 30 and aborted < 30
    reason = (f"the all-reduce with a killed peer raised after {waited:.1f} s ({raised[:80]}); abort {aborted:.1f} s"
              if raised else f"the all-reduce with a killed peer returned after {waited:.1f} s without an error")
    (work / "rank0.json").write_text(json.dumps({"ok": ok, "reason": reason, "raised": raised,
                                                 "waited_s": round(waited, 2), "abort_s": round(aborted, 2)}) + "\n")
    os._exit(0)  # the group's threads may still wait on the dead peer


STAGES = [Stage("env", 30, stage_env), Stage("ring", 120, stage_ring),
          Stage("overlap", 210, stage_overlap, needs_cuda=True), Stage("abort", 120, stage_abort)]
"""Each stage's seconds add up to the budget (gpu_check.BUDGET_S), as in gpu_check."""
WORKERS = {"ring": worker_ring, "peer": worker_peer}

if __name__ == "__main__":
    sys.exit(base.main("gpu_check_multi", STAGES, WORKERS, __doc__, Path(__file__).resolve(), min_gpus=2))
