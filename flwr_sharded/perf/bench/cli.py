"""`flwr-sharded bench`: the four methods side by side on an emulated tiered cluster (see `netemu`).

    flwr-sharded bench [--cluster FILE] [--contrast FILE] [--quick] [--out DIR]     # the full benchmark
    flwr-sharded bench exec --cluster FILE [--nproc N] -- CMD ARGS...              # any command, one per rank
    flwr-sharded bench sync [--bandwidths 100Mbit,1Gbit] [--federations 2]          # benchmarks/sync_bench.py

The full benchmark builds the cluster of `--cluster` with network namespaces, bridges and tbf (inside
`unshare --net --mount --pid`: needs root, leaves nothing behind), then trains FSDP, HSDP, FL+FSDP, FL+HSDP and
the no-sync limit (FL+FSDP with syncing off) on the same model, samples and seed, one after the other, with
`train.py --measure-traffic`. It reports per-method step times (median over windows of A steps, each holding one
sync), a phase breakdown like the paper's Table 4, speedups, the no-sync gap, bytes per tier measured (collectives
and wire) against the cost model, a sweep of A, an equal-samples learning comparison like Table 3, the planner's
choice next to the measured-fastest method (also on the `--contrast` cluster), a JSON file and time-to-perplexity
and A-sweep plots.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from flwr_sharded.parallel.wire import SYNC_DTYPE_BYTES
from flwr_sharded.errors import ConfigError
from flwr_sharded.perf.bench.common import REPO
from flwr_sharded.perf.bench.layouts import VARIANT_RUNS, parse_layouts
from flwr_sharded.perf.bench.scenarios import _inner_main
from flwr_sharded.perf.bench.subcommands import _inner_check, _inner_exec, _inner_sync, sync_topologies
from flwr_sharded.perf.netemu.fabric import RankFailure
from flwr_sharded.perf.netemu.isolation import check_host, host_leftovers, inside, run_isolated
from flwr_sharded.perf.netemu.topology import EmulationError, load_topology

DEFAULT_CLUSTER = REPO / "examples" / "clusters" / "emulated.yaml"
DEFAULT_CONTRAST = REPO / "benchmarks" / "clusters" / "emulated-flat.yaml"
ARGS_ENV = "FLWR_SHARDED_BENCH_ARGS"


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


RUN_KEYS = ("fsdp", "hsdp", "fl-fsdp", "fl-hsdp", "no-sync", *VARIANT_RUNS)


def _method_list(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in values if v not in RUN_KEYS]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"choose among {','.join(RUN_KEYS)}, got {text!r}")
    return values


def _bandwidths(text: str) -> list[float]:
    from flwr_sharded.perf.cluster import parse_bandwidth

    try:
        return [parse_bandwidth(x.strip(), "--bandwidths") for x in text.split(",") if x.strip()]
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `bench` sub-command (and its `exec` and `sync` sub-commands)."""
    from flwr_sharded.config import default_data_dir

    p = subparsers.add_parser(
        "bench", help="run the four methods side by side on an emulated tiered network (root; Linux netns + tc)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", default=str(DEFAULT_CLUSTER), metavar="FILE",
                   help="cluster YAML to emulate (default examples/clusters/emulated.yaml)")
    p.add_argument("--contrast", default=str(DEFAULT_CONTRAST), metavar="FILE",
                   help="a contrasting cluster for the planner check (default benchmarks/clusters/emulated-flat.yaml); "
                        "'none' to skip")
    p.add_argument("--layouts", default=None, metavar="LIST",
                   help="override layouts of the main cluster, e.g. fsdp=1x1x8,fl-fsdp=4x1x2 (F x R x S)")
    p.add_argument("--model", default="small", help="model preset (default small)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=1, help="sequences per rank per step (default 1)")
    p.add_argument("--steps", type=int, default=32, help="optimizer steps of each run (default 32)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each method on the main cluster, interleaved")
    p.add_argument("--contrast-steps", type=int, default=32, help="steps per run on the contrasting cluster (32)")
    p.add_argument("--contrast-repeats", type=int, default=1,
                   help="runs of each method on the contrasting cluster, interleaved (default 1)")
    p.add_argument("--contrast-batch-size", type=int, default=4,
                   help="sequences per rank per step on the contrasting cluster (default 4: compute-heavy, so "
                        "communication is a small part of a step)")
    p.add_argument("--methods", type=_method_list, default=list(RUN_KEYS), dest="method_list", metavar="LIST",
                   help=f"runs to do, among {','.join(RUN_KEYS)} (default all)")
    p.add_argument("--aggregate-every", type=int, default=8, help="A of the FL methods (default 8)")
    p.add_argument("--sync-dtype", choices=tuple(SYNC_DTYPE_BYTES), default="float32",
                   help="wire dtype of the FL methods' shard sync (train --sync-dtype; default float32); the "
                        "predicted sync bytes and the planner use its size")
    p.add_argument("--overlap-fragments", type=int, default=2,
                   help="sync fragments N of the overlapped runs (train --sync-fragments; default 2)")
    p.add_argument("--overlap-delay", type=int, default=3,
                   help="steps tau each fragment's sync overlaps in the overlapped runs (train --sync-delay; 3)")
    p.add_argument("--overlap-alpha", type=float, default=0.0,
                   help="share of the local values kept at a merge in the overlapped runs (train --sync-alpha; 0)")
    p.add_argument("--overlap-carry", action=argparse.BooleanOptionalAction, default=True,
                   help="the overlapped runs keep the local steps taken while their syncs travel (train "
                        "--sync-carry; default on)")
    p.add_argument("--sweep", type=_int_list, default=[1, 2, 4, 8, 16, 32], dest="sweep_values", metavar="LIST",
                   help="values of A for the FL+FSDP sweep (default 1,2,4,8,16,32)")
    p.add_argument("--no-sweep", action="store_true", help="skip the sweep of A")
    p.add_argument("--sweep-windows", type=int, default=1,
                   help="measured windows of max(A, 8) steps per sweep point, after a warm-up window (default 1)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--eval-every", type=int, default=16)
    p.add_argument("--eval-blocks", type=int, default=32)
    p.add_argument("--fl-margin", type=float, default=0.1, help="the planner's FL margin (default 0.1)")
    p.add_argument("--no-planner-run", dest="measure_planner_choice", action="store_false",
                   help="do not measure the planner's first choice when it is not among the measured layouts")
    p.add_argument("--data-dir", default=default_data_dir(), help="prepared data directory")
    p.add_argument("--out", default="bench-results", help="output directory (bench.json, bench.md, PNGs)")
    p.add_argument("--keep-runs", default=None, metavar="DIR", help="keep each run's metrics, traffic and logs here")
    p.add_argument("--date", default=None, help="date printed in the report (default today)")
    p.add_argument("--quick", action="store_true",
                   help="tiny model, 8 steps, A=2, no sweep, no contrast, no planner run (for tests)")
    p.add_argument("--run-timeout", type=float, default=1200.0, help="seconds one training run may take")
    p.add_argument("--collective-timeout", type=float, default=300.0, help="seconds one collective may take")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds the whole benchmark may take")
    p.set_defaults(func=run, bench_command=None)
    sub = p.add_subparsers(dest="bench_command")

    e = sub.add_parser("exec", help="run a command once per rank on the emulated cluster (RANK, WORLD_SIZE, "
                                    "MASTER_ADDR, GLOO_SOCKET_IFNAME set), e.g. a torchrun-style script")
    e.add_argument("--cluster", required=True, metavar="FILE", dest="exec_cluster")
    e.add_argument("--nproc", type=int, default=None, help="ranks (default: all of the cluster)")
    e.add_argument("--log-dir", default=None, help="keep each rank's stdout/stderr here")
    e.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    e.set_defaults(func=run_exec)

    c = sub.add_parser("check", help="measure the emulated links' throughput against the description")
    c.add_argument("--cluster", required=True, metavar="FILE", dest="exec_cluster")
    c.add_argument("--seconds", type=float, default=0.5, help="target duration of each transfer (default 0.5)")
    c.add_argument("--json", action="store_true", help="print JSON")
    c.set_defaults(func=run_check)

    s = sub.add_parser("sync", help="benchmarks/sync_bench.py on loopback and across shaped inter-group links")
    s.add_argument("--federations", type=int, default=2)
    s.add_argument("--shards", type=int, default=1)
    s.add_argument("--bandwidths", type=_bandwidths, default=[1e8, 1e9], dest="bandwidth_values",
                   help="inter-group bandwidths (default 100Mbit,1Gbit)")
    s.add_argument("--layers", type=int, default=16)
    s.add_argument("--hidden", type=int, default=64)
    s.add_argument("--repeats", type=int, default=20)
    s.add_argument("--sync-out", default="benchmarks/results", dest="sync_out", help="directory for the JSON files")
    s.add_argument("extra", nargs=argparse.REMAINDER, help="-- more sync_bench.py arguments")
    s.set_defaults(func=run_sync)
    return p


def _apply_quick(args: argparse.Namespace) -> None:
    if args.quick:
        args.model, args.seq_len, args.batch_size, args.steps = "tiny", 32, 1, 8
        args.aggregate_every, args.eval_every, args.eval_blocks = 2, 4, 8
        args.overlap_fragments, args.overlap_delay = 1, 1
        args.sweep_values, args.contrast, args.measure_planner_choice = [], None, False
        args.repeats = 1
        args.sweep_windows = 1
    if args.no_sweep:
        args.sweep_values = []
    if args.contrast in ("none", ""):
        args.contrast = None


def _validate(args: argparse.Namespace) -> None:
    """Everything that can be checked before touching the network: cluster files, layouts, model, data, host."""
    from flwr_sharded.config import DataConfig
    from flwr_sharded.presets import PRESETS
    from flwr_sharded.training.data import check_data

    for option, value in (("--steps", args.steps), ("--seq-len", args.seq_len), ("--batch-size", args.batch_size),
                          ("--aggregate-every", args.aggregate_every), ("--sweep-windows", args.sweep_windows),
                          ("--repeats", args.repeats), ("--contrast-repeats", args.contrast_repeats),
                          ("--contrast-steps", args.contrast_steps),
                          ("--contrast-batch-size", args.contrast_batch_size)):
        if value < 1:
            raise ConfigError(f"{option} must be >= 1, got {value}")
    from flwr_sharded.config import TrainConfig, validate_sync
    from flwr_sharded.parallel.outer import FedAvg

    if any("overlap" in key for key in args.method_list):
        cfg = TrainConfig().parallel
        cfg.aggregate_every, cfg.sync_fragments, cfg.sync_delay, cfg.sync_alpha, cfg.sync_carry = (
            args.aggregate_every, args.overlap_fragments, args.overlap_delay, args.overlap_alpha, args.overlap_carry)
        try:
            validate_sync(cfg, FedAvg())
        except ConfigError as exc:
            raise ConfigError(f"the overlapped runs (--overlap-fragments, --overlap-delay, --overlap-alpha with "
                              f"--aggregate-every): {exc}") from None
    if args.model not in PRESETS:
        raise ConfigError(f"--model: the benchmark needs a preset to predict its traffic; got {args.model!r}, "
                          f"choose one of {', '.join(PRESETS)}")
    for option, path in (("--cluster", args.cluster), ("--contrast", args.contrast)):
        if path is None:
            continue
        topo = load_topology(path)
        layouts = parse_layouts(args.layouts if option == "--cluster" else None, topo)
        if option == "--cluster" and "fl-fsdp" not in layouts:
            raise ConfigError(f"--cluster {path}: a single node has no FL+FSDP layout to benchmark; describe at "
                              f"least 2 nodes")
    check_data(DataConfig(data_dir=args.data_dir))
    check_host()


def run(args: argparse.Namespace) -> int:
    """Handler of `flwr-sharded bench`."""
    _apply_quick(args)
    if inside():
        return _inner_main(args)
    try:
        _validate(args)
    except ConfigError as exc:
        print(f"flwr-sharded bench: error: {exc}", file=sys.stderr)
        return 2
    args.out = str(Path(args.out).resolve())
    args.data_dir = str(Path(args.data_dir).expanduser().resolve())
    for name in ("cluster", "contrast", "keep_runs"):
        if getattr(args, name):
            setattr(args, name, str(Path(getattr(args, name)).resolve()))
    return _reexec(args, "main")


def run_exec(args: argparse.Namespace) -> int:
    """Handler of `flwr-sharded bench exec`."""
    args.cluster = args.exec_cluster
    if args.cmd and args.cmd[0] == "--":
        args.cmd = args.cmd[1:]
    if inside():
        return _inner_exec(args)
    try:
        if not args.cmd:
            raise ConfigError("bench exec: give a command after --, e.g. -- python script.py")
        topo = load_topology(args.cluster)
        if args.nproc is not None and not 1 <= args.nproc <= topo.world_size:
            raise ConfigError(f"--nproc {args.nproc}: the cluster has {topo.world_size} ranks")
        check_host()
    except ConfigError as exc:
        print(f"flwr-sharded bench exec: error: {exc}", file=sys.stderr)
        return 2
    args.cluster = str(Path(args.cluster).resolve())
    return _reexec(args, "exec")


def run_check(args: argparse.Namespace) -> int:
    """Handler of `flwr-sharded bench check`."""
    args.cluster = args.exec_cluster
    if inside():
        return _inner_check(args)
    try:
        load_topology(args.cluster)
        check_host()
    except ConfigError as exc:
        print(f"flwr-sharded bench check: error: {exc}", file=sys.stderr)
        return 2
    args.cluster = str(Path(args.cluster).resolve())
    return _reexec(args, "check")


def run_sync(args: argparse.Namespace) -> int:
    """Handler of `flwr-sharded bench sync`."""
    args.extra = args.extra[1:] if args.extra and args.extra[0] == "--" else args.extra
    args.out = str(Path(args.sync_out).resolve())
    if inside():
        return _inner_sync(args)
    try:
        for name, topo in sync_topologies(args.federations, args.shards, args.bandwidth_values):
            topo.check_fits()
        check_host()
    except ConfigError as exc:
        print(f"flwr-sharded bench sync: error: {exc}", file=sys.stderr)
        return 2
    return _reexec(args, "sync")


def _reexec(args: argparse.Namespace, mode: str) -> int:
    """Run this sub-command again inside fresh namespaces; check that nothing is left on the host afterwards."""
    payload = {k: v for k, v in vars(args).items() if k != "func"}
    payload["mode"] = mode
    try:
        result = run_isolated([sys.executable, "-m", "flwr_sharded.perf.bench"],
                              env={ARGS_ENV: json.dumps(payload)}, timeout=args.timeout)
    except TimeoutError as exc:
        print(f"flwr-sharded bench: error: {exc}", file=sys.stderr)
        return 1
    except EmulationError as exc:
        print(f"flwr-sharded bench: error: {exc}", file=sys.stderr)
        return 2
    left = host_leftovers()
    if any(left.values()):
        print(f"flwr-sharded bench: warning: left on the host: {left}", file=sys.stderr)
    return result.returncode


def _inner_entry() -> int:
    """`python -m flwr_sharded.perf.bench`, started by `_reexec` inside the namespaces."""
    payload = json.loads(os.environ[ARGS_ENV])
    mode = payload.pop("mode")
    args = argparse.Namespace(**payload)
    try:
        if mode == "main":
            return _inner_main(args)
        if mode == "exec":
            return _inner_exec(args)
        if mode == "check":
            return _inner_check(args)
        return _inner_sync(args)
    except (ConfigError, RankFailure) as exc:
        print(f"flwr-sharded bench: error: {exc}", file=sys.stderr)
        return 1

