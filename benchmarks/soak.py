"""A long Flower run watched from outside: every process's resident memory, file descriptors and threads per round.

    PATH=.venv/bin:$PATH python benchmarks/soak.py --path simulation --rounds 2000 \
        --out benchmarks/results/soak_simulation_<date>.json
    PATH=.venv/bin:$PATH python benchmarks/soak.py --path deployment --rounds 2000 \
        --out benchmarks/results/soak_deployment_<date>.json

Runs `apps/llama_fl_hsdp` for `--rounds` rounds (2 groups x S=2 ranks, tiny model, A = 2, one sync per round, a
checkpoint every round): `--path simulation` through `apps/llama_fl_hsdp/run_simulation.sh` (Flower's simulation
engine: a local SuperLink, Ray, one ClientApp per group), `--path deployment` on loopback (a SuperLink, two
SuperNodes, two group torchrun jobs, `flwr run`). Every `--interval` seconds it samples every process of the run
(found by a marker in their environment): RSS with its anonymous and file-backed parts, file descriptors and
threads, with the number of rounds recorded so far. Per process it fits each of the three against rounds after
`--warmup-rounds` (least squares, MiB per 100 rounds) and gives the range of its descriptors and threads over the same
rounds. `--env NAME=VALUE` sets a variable for the whole run (e.g. `MALLOC_TRIM_THRESHOLD_`, or `LD_PRELOAD` of another
allocator), `--set KEY=VALUE` a run-config value (e.g. `checkpoint-rounds=100000`: a checkpoint after the last round
only). Writes the JSON (provenance, samples, per-process fits, the rounds' step times) and, with matplotlib, a plot
next to it, also when stopped early by SIGTERM (exit code 143) or `--timeout`. Everything started is killed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.local_flower: the loopback deployment and the process helpers

from tests.local_flower import (Procs, base_env, cmdline, deployment_rounds, kill_tree_by_env,  # noqa: E402
                                pids_with_env, round_records, run_config_args)
from flwr_sharded_perf.provenance import provenance  # noqa: E402

APP = REPO / "apps" / "llama_fl_hsdp"
MARKER = "FLWR_SHARDED_SOAK"
"""Set in the environment of everything the run starts; the sampler finds the run's processes by it."""
RUN_CONFIG = {"model": "tiny", "seq-len": 32, "batch-size": 2, "eval-blocks": 8, "aggregate-every": 2,
              "syncs-per-round": 1, "checkpoint-rounds": 1, "keep-checkpoints": 2, "log-every": 1000, "seed": 7,
              "round-timeout": 300.0, "save-model": False}
"""The soak's run: one sync of A = 2 steps per round and a checkpoint every round (`num-server-rounds` and the
directories are added)."""
TARGET_MIB_PER_100_ROUNDS = 0.05
KINDS = (("torchrun", ("torch.distributed.run",)), ("rank", ("flwr_sharded.flower.group",)),
         ("superlink", ("flower-superlink",)), ("superexec", ("flower-superexec",)),
         ("serverapp", ("flwr-serverapp",)), ("supernode", ("flower-supernode",)),
         ("clientapp", ("flwr-clientapp",)), ("simulation", ("flwr-simulation",)), ("flwr-run", ("bin/flwr run",)),
         ("ray", ("ray::", "raylet", "gcs_server", "/ray/", "ray.")))
"""A process's kind: the first whose needles one appears in its command line."""


def kind_of(command: str) -> str:
    for kind, needles in KINDS:
        if any(n in command for n in needles):
            return kind
    return "other"


def _status(pid: int) -> dict[str, int] | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:
        return {"rss_kib": int(fields["VmRSS"].split()[0]), "anon_kib": int(fields["RssAnon"].split()[0]),
                "file_kib": int(fields["RssFile"].split()[0]), "threads": int(fields["Threads"]), "fds": fds}
    except (KeyError, ValueError, IndexError):  # a zombie has no VmRSS
        return None


class Sampler(threading.Thread):
    """Every `interval` seconds: each process marked `tag`'s RSS, descriptors and threads, with the rounds so far."""

    def __init__(self, tag: str, metrics: Path, interval: float) -> None:
        super().__init__(daemon=True)
        self.tag, self.metrics, self.interval = tag, metrics, interval
        self.samples: list[dict[str, Any]] = []
        self.commands: dict[int, str] = {}
        self.done = threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        while not self.done.wait(self.interval):
            rounds = len(round_records(self.metrics))
            for pid in pids_with_env(MARKER, self.tag):
                status = _status(pid)
                if status is None:
                    continue
                if pid not in self.commands:
                    self.commands[pid] = cmdline(pid)[:300]
                self.samples.append({"t": round(time.monotonic() - start, 1), "round": rounds, "pid": pid, **status})


def fit(samples: list[dict[str, Any]], warmup: int) -> dict[str, Any] | None:
    """One process's samples after `warmup` rounds: the slopes (MiB per 100 rounds) of its RSS and of the RSS's
    anonymous part (the heap: what a leak grows) and file-backed part (libraries' pages, read as code runs), its
    RSS, descriptors and threads."""
    later = [s for s in samples if s["round"] >= warmup]
    if len({s["round"] for s in later}) < 3:
        return None
    xs, ys = [s["round"] for s in later], [s["rss_kib"] / 1024 for s in later]

    def slope(values: list[float]) -> float:  # least squares against the rounds
        return statistics.linear_regression(xs, values).slope

    parts = {f"{part}_mib_per_100_rounds": round(100 * slope([s[f"{part}_kib"] / 1024 for s in later]), 3)
             for part in ("anon", "file")}
    return {"rss_mib_per_100_rounds": round(100 * slope(ys), 3), **parts, "rss_mib_first": round(ys[0], 1),
            "rss_mib_last": round(ys[-1], 1), "rounds": [xs[0], xs[-1]],
            "fds": [min(s["fds"] for s in later), max(s["fds"] for s in later)],
            "threads": [min(s["threads"] for s in later), max(s["threads"] for s in later)]}


def run_simulation(work: Path, config: dict, env: dict[str, str], timeout: float) -> int:
    cmd = ["bash", str(APP / "run_simulation.sh"), *run_config_args(config)]
    with open(work / "run.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 15)
                proc.wait(timeout=60)


def run_deployment(work: Path, config: dict, env: dict[str, str], timeout: float) -> int:
    procs = Procs(work)
    saved = dict(os.environ)
    os.environ.update(env)  # the deployment's processes take this environment (base_env)
    try:
        deployment_rounds(procs, APP, [(f"group{i}", {}) for i in range(2)], config, timeout=timeout,
                          node_config=f'allowed-checkpoint-root="{config["checkpoint-dir"]}"')
        return 0
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        procs.close()
        os.environ.clear()
        os.environ.update(saved)


def plot(result: dict[str, Any], samples: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for pid, info in result["processes"].items():
        points = [(s["round"], s["rss_kib"] / 1024) for s in samples if s["pid"] == int(pid)]
        ax.plot(*zip(*points), label=f"{info['kind']} {pid}", linewidth=1)
    ax.axvline(result["warmup_rounds"], color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("rounds recorded")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title(f"soak, {result['path']}: {result['rounds']} rounds ({result['provenance']['date'][:10]})")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


class Stopped(Exception):
    """SIGTERM arrived: the run is ended (its processes killed on the way out), its samples kept."""


def _stop(*_: Any) -> None:
    raise Stopped


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", choices=("simulation", "deployment"), default="simulation")
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--warmup-rounds", type=int, default=100, help="rounds left out of the fits")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="for the whole run")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a run-config value instead of the soak's (VALUE read as JSON where it parses, e.g. "
                             "checkpoint-rounds=100000)")
    parser.add_argument("--data-dir", default=os.environ.get("FLWR_SHARDED_DATA",
                                                             str(Path.home() / ".cache" / "flwr_sharded")))
    parser.add_argument("--timeout", type=float, default=6 * 3600.0, help="seconds before the run is stopped")
    parser.add_argument("--out", help="results JSON (the plot: the same name, .png)")
    args = parser.parse_args()
    if args.rounds <= args.warmup_rounds + 2 or args.interval <= 0:
        parser.error("--rounds must exceed --warmup-rounds by 3 or more, and --interval be > 0")
    extra = dict(item.split("=", 1) for item in args.env if "=" in item)
    changed = {key: _value(text) for key, _, text in (item.partition("=") for item in args.set)}
    if len(extra) != len(args.env) or any("=" not in item for item in args.set):
        parser.error(f"--env takes NAME=VALUE and --set KEY=VALUE, got {args.env} and {args.set}")

    signal.signal(signal.SIGTERM, _stop)  # the run is ended and what it sampled so far is written
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    tag = uuid.uuid4().hex
    env = {**extra, MARKER: tag, "FLWR_SHARDED_DATA": args.data_dir}
    config = {**RUN_CONFIG, **changed, "num-server-rounds": args.rounds, "checkpoint-dir": str(work / "checkpoints"),
              "data-dir": args.data_dir}
    metrics = work / "run" / "metrics.jsonl"
    sampler = Sampler(tag, metrics, args.interval)
    started, load_start = time.time(), os.getloadavg()
    print(f"soak: {args.rounds} rounds on the {args.path} path in {work}", file=sys.stderr, flush=True)
    sampler.start()
    try:
        if args.path == "simulation":
            code = run_simulation(work, {**config, "run-dir": str(metrics.parent)},
                                  {**base_env(**env), "FLWR_HOME": str(work / "flwr_home")}, args.timeout)
        else:
            code = run_deployment(work, config, env, args.timeout)
    except Stopped:
        code = 143
        print("soak: stopped (SIGTERM); writing the rounds so far", file=sys.stderr, flush=True)
    finally:
        sampler.done.set()
        sampler.join(timeout=30)
        kill_tree_by_env(MARKER, tag)
    rounds = round_records(metrics)
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for s in sampler.samples:
        by_pid.setdefault(s["pid"], []).append(s)
    processes = {}
    for pid, samples in sorted(by_pid.items()):
        fitted = fit(samples, args.warmup_rounds)
        if fitted is not None:
            processes[str(pid)] = {"kind": kind_of(sampler.commands.get(pid, "")),
                                   "command": sampler.commands.get(pid, ""), **fitted}
    worst = max((p["rss_mib_per_100_rounds"] for p in processes.values() if p["kind"] == "rank"), default=None)
    round_s = [r["round_s"] for r in rounds if "round_s" in r]
    result = {"provenance": provenance(), "path": args.path, "rounds": len(rounds), "asked_rounds": args.rounds,
              "exit_code": code, "env": extra, "run_config": config, "warmup_rounds": args.warmup_rounds,
              "seconds": round(time.time() - started, 1), "load_avg_start": load_start,
              "load_avg_end": os.getloadavg(), "median_round_s": statistics.median(round_s) if round_s else None,
              "worst_rank_rss_mib_per_100_rounds": worst, "target_mib_per_100_rounds": TARGET_MIB_PER_100_ROUNDS,
              "processes": processes, "samples": sampler.samples}
    text = json.dumps(result, indent=1)
    summary = {k: v for k, v in result.items() if k not in ("samples", "processes")}
    print(json.dumps(summary, indent=1))
    for pid, p in processes.items():
        print(f"{p['kind']:>10} {pid:>7}: {p['rss_mib_first']:7.1f} -> {p['rss_mib_last']:7.1f} MiB, "
              f"{p['rss_mib_per_100_rounds']:+.3f} MiB/100 rounds (anon {p['anon_mib_per_100_rounds']:+.3f}, file "
              f"{p['file_mib_per_100_rounds']:+.3f}), fds {p['fds']}, threads {p['threads']}")
    if args.out:
        out = Path(args.out)
        out.write_text(text + "\n")
        try:
            plot(result, sampler.samples, out.with_suffix(".png"))
        except ImportError:
            print("matplotlib missing: no plot", file=sys.stderr)
    return code if code == 143 else 0 if code == 0 and len(rounds) == args.rounds else 1


if __name__ == "__main__":
    sys.exit(main())
