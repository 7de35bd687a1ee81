"""`flwr-sharded bench`: the four methods side by side on an emulated tiered cluster (see `netemu`).

    flwr-sharded bench [--cluster FILE] [--contrast FILE] [--quick] [--out DIR]     # the full benchmark
    flwr-sharded bench exec --cluster FILE [--nproc N] -- CMD ARGS...              # any command, one per rank
    flwr-sharded bench sync [--bandwidths 100Mbit,1Gbit] [--federations 2]          # benchmarks/sync_bench.py

The full benchmark builds the cluster of `--cluster` with network namespaces, bridges and tbf (needs root, leaves
nothing behind) and trains FSDP, HSDP, FL+FSDP, FL+HSDP and the no-sync limit on the same model, samples and seed. It
reports step times, phases (the paper's Table 4), speedups, bytes per tier measured against the cost model, a sweep of
A, learning at equal samples (Table 3), the planner's choice against the measured fastest (also on `--contrast`), a
JSON file and plots.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from flwr_sharded import schema
from flwr_sharded.config import DataConfig, data_dir_of
from flwr_sharded.errors import ConfigError
from flwr_sharded_perf.bench.runs import parse_layouts
from flwr_sharded_perf.bench.options import BenchOptions, ExecOptions, LinkCheckOptions, SyncOptions, resolve_bench
from flwr_sharded_perf.bench.report import _fmt
from flwr_sharded_perf.bench.scenarios import _inner_main, parse_group_shards, unequal_layouts
from flwr_sharded_perf.provenance import REPO
from flwr_sharded_perf.netemu.isolation import (EmulationError, check_host, enter_private_run, host_leftovers,
                                                in_isolated_runner, run_isolated)
from flwr_sharded_perf.netemu.network import EmuTopology, Fabric, RankFailure, _rate, load_topology, topology_dict

ARGS_ENV = "FLWR_SHARDED_BENCH_ARGS"
SYNC_BENCH = REPO / "benchmarks" / "sync_bench.py"


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `bench` sub-command (and its `exec`, `check` and `sync` sub-commands); options: `bench.options`."""
    p = subparsers.add_parser(
        "bench", help="run the four methods side by side on an emulated tiered network (root; Linux netns + tc)",
        description=__doc__, formatter_class=schema.HelpFormatter)
    schema.add_arguments(p, BenchOptions)
    p.set_defaults(func=run_bench, bench_command=None)
    sub = p.add_subparsers(dest="bench_command")
    e = sub.add_parser("exec", help="run a command once per rank on the emulated cluster (RANK, WORLD_SIZE, "
                                    "MASTER_ADDR, GLOO_SOCKET_IFNAME set), e.g. a torchrun-style script",
                       formatter_class=schema.HelpFormatter)
    schema.add_arguments(e, ExecOptions)
    e.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    e.set_defaults(func=run_exec)
    c = sub.add_parser("check", help="measure the emulated links' throughput against the description",
                       formatter_class=schema.HelpFormatter)
    schema.add_arguments(c, LinkCheckOptions)
    c.set_defaults(func=run_check)
    s = sub.add_parser("sync", help="benchmarks/sync_bench.py on loopback and across shaped inter-group links",
                       formatter_class=schema.HelpFormatter)
    schema.add_arguments(s, SyncOptions)
    s.add_argument("extra", nargs=argparse.REMAINDER, help="-- more sync_bench.py arguments")
    s.set_defaults(func=run_sync)
    return p


def _resolve(parsed: argparse.Namespace, sub: type | None, what: str) -> argparse.Namespace | None:
    """The options of `parsed` (see `bench.options.resolve_bench`), or None after printing the error."""
    try:
        args = resolve_bench(parsed, sub)
    except ConfigError as exc:
        print(f"flwr-sharded {what}: error: {exc}", file=sys.stderr)
        return None
    for name in ("cmd", "extra"):
        if hasattr(parsed, name):
            setattr(args, name, getattr(parsed, name))
    return args


def _apply_quick(args: argparse.Namespace) -> None:
    if args.quick:
        args.model, args.seq_len, args.batch_size, args.steps = "tiny", 32, 1, 8
        args.aggregate_every, args.eval_every, args.eval_blocks = 2, 4, 8
        args.sync_fragments, args.sync_delay, args.repeats, args.sweep_windows = 1, 1, 1, 1
        args.sweep_values, args.contrast, args.measure_planner_choice = [], None, False
        if args.method_list:  # the unequal scenario only when it is all there is to run
            args.unequal = None


def _validate(args: argparse.Namespace) -> None:
    """Check what can be before touching the network (clusters, layouts, model, data); make paths absolute."""
    from flwr_sharded.config import ParallelConfig
    from flwr_sharded.parallel.rules import FedAvg
    from flwr_sharded.presets import PRESETS
    from flwr_sharded.training.data import check_data
    from flwr_sharded.validation import validate_sync

    if any("overlap" in key for key in args.method_list):
        cfg = ParallelConfig(aggregate_every=args.aggregate_every, sync_fragments=args.sync_fragments,
                             sync_delay=args.sync_delay, sync_alpha=args.sync_alpha, sync_carry=args.sync_carry)
        try:
            validate_sync(cfg, FedAvg())
        except ConfigError as exc:
            raise ConfigError(f"the overlapped runs: {exc}") from None
    if args.model not in PRESETS:
        raise ConfigError(f"--model: the benchmark needs a preset to predict its traffic; got {args.model!r}, "
                          f"choose one of {', '.join(PRESETS)}")
    for option, path in (("--cluster", args.cluster), ("--contrast", args.contrast)):
        if path is None:
            continue
        topo = load_topology(path)
        layouts = parse_layouts(args.layouts if option == "--cluster" else None, topo)
        if option == "--cluster" and "fl-fsdp" not in layouts and args.method_list:
            raise ConfigError(f"--cluster {path}: a single node has no FL+FSDP layout to benchmark; describe at "
                              f"least 2 nodes")
    if args.unequal is not None:
        unequal_layouts(parse_group_shards(args.unequal_groups), load_topology(args.unequal), args.slow_group)
        if "unequal-slow-speed" in args.unequal_run_list and args.steps % args.aggregate_every:
            raise ConfigError(f"--steps {args.steps}: the run with --group-steps speed trains whole periods of "
                              f"--aggregate-every {args.aggregate_every} steps; use a multiple of it")
    if not args.method_list and args.unequal is None:
        raise ConfigError("--methods none and --unequal none: nothing to run")
    check_data(DataConfig(data_dir=args.data_dir))
    args.out = str(Path(args.out).resolve())
    args.data_dir = str(data_dir_of(DataConfig(data_dir=args.data_dir)).resolve())
    for name in ("cluster", "contrast", "unequal", "keep_runs"):
        if getattr(args, name):
            setattr(args, name, str(Path(getattr(args, name)).resolve()))


def _run_mode(parsed: argparse.Namespace, mode: str, sub: type | None, prepare, check) -> int:
    """Handler of `flwr-sharded bench` (mode "main") or `bench MODE`: its checks, then the re-execution."""
    command = "bench" if mode == "main" else f"bench {mode}"
    args = _resolve(parsed, sub, command)
    if args is None:
        return 2
    prepare(args)
    if in_isolated_runner():
        enter_private_run()
        return INNER[mode](args)
    try:
        check(args)
        check_host()
    except ConfigError as exc:
        print(f"flwr-sharded {command}: error: {exc}", file=sys.stderr)
        return 2
    return _reexec(args, mode)


def run_bench(parsed: argparse.Namespace) -> int:
    """Handler of `flwr-sharded bench`."""
    return _run_mode(parsed, "main", None, _apply_quick, _validate)


def run_exec(parsed: argparse.Namespace) -> int:
    """Handler of `flwr-sharded bench exec`."""

    def prepare(args: argparse.Namespace) -> None:
        args.cmd = args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd

    def check(args: argparse.Namespace) -> None:
        if not args.cmd:
            raise ConfigError("bench exec: give a command after --, e.g. -- python script.py")
        topo = load_topology(args.cluster)
        if args.nproc is not None and not 1 <= args.nproc <= topo.world_size:
            raise ConfigError(f"--nproc {args.nproc}: the cluster has {topo.world_size} ranks")
        args.cluster = str(Path(args.cluster).resolve())

    return _run_mode(parsed, "exec", ExecOptions, prepare, check)


def run_check(parsed: argparse.Namespace) -> int:
    """Handler of `flwr-sharded bench check`."""

    def check(args: argparse.Namespace) -> None:
        load_topology(args.cluster)
        args.cluster = str(Path(args.cluster).resolve())

    return _run_mode(parsed, "check", LinkCheckOptions, lambda args: None, check)


def run_sync(parsed: argparse.Namespace) -> int:
    """Handler of `flwr-sharded bench sync`."""

    def prepare(args: argparse.Namespace) -> None:
        args.extra = args.extra[1:] if args.extra and args.extra[0] == "--" else args.extra
        args.out = str(Path(args.sync_out).resolve())

    def check(args: argparse.Namespace) -> None:
        for _, topo in sync_topologies(args.federations, args.shards, args.bandwidth_values):
            topo.check_fits()

    return _run_mode(parsed, "sync", SyncOptions, prepare, check)


def _reexec(args: argparse.Namespace, mode: str) -> int:
    """Run this sub-command again inside fresh namespaces; check that nothing is left on the host afterwards."""
    payload = {**{k: v for k, v in vars(args).items() if k != "func"}, "mode": mode}
    try:
        result = run_isolated([sys.executable, "-m", "flwr_sharded_perf.bench"],
                              env={ARGS_ENV: json.dumps(payload)}, timeout=args.timeout)
    except (TimeoutError, EmulationError) as exc:
        print(f"flwr-sharded bench: error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, TimeoutError) else 2
    left = host_leftovers()
    if any(left.values()):
        print(f"flwr-sharded bench: warning: left on the host: {left}", file=sys.stderr)
    return result.returncode


_THROUGHPUT = r"""
import socket, sys, time
mode, host, port, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if mode == "recv":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((host, port)); s.listen(1)
    print("ready", flush=True)
    c, _ = s.accept(); got = sum(iter(lambda: len(c.recv(1 << 20)), 0))
    c.sendall(b"k"); print(got, flush=True)
else:
    for _ in range(100):
        try:
            c = socket.create_connection((host, port)); break
        except OSError:
            time.sleep(0.05)
    buf, sent, t = b"x" * (1 << 16), 0, time.perf_counter()
    while sent < n:
        c.sendall(buf[: n - sent]); sent += min(len(buf), n - sent)
    c.shutdown(socket.SHUT_WR); c.recv(1); print(time.perf_counter() - t, flush=True)
"""
"""A TCP throughput probe: `recv HOST PORT N` prints "ready", then the bytes it got; `send HOST PORT N` the seconds."""


def _inner_exec(opts: argparse.Namespace) -> int:
    topo = load_topology(opts.cluster)
    nproc = opts.nproc or topo.world_size
    with Fabric(topo) as fab:
        try:
            results = fab.run_ranks(list(opts.cmd), world=nproc, timeout=opts.run_timeout, log_dir=opts.log_dir)
        except RankFailure as exc:
            print(f"flwr-sharded bench exec: error: {exc}", file=sys.stderr)
            return 1
    sys.stdout.write(results[0].stdout)
    sys.stderr.write(results[0].stderr[-4000:])
    return 0


def measure_transfer(fab: Fabric, src_node: int, dst_node: int, nbytes: int, port: int = 5201) -> float:
    """Seconds to send `nbytes` over TCP from one node to another through the emulated links."""
    argv = [sys.executable, "-c", _THROUGHPUT]
    target = [fab.topology.node_ip(dst_node), str(port), str(nbytes)]
    recv = fab.spawn(dst_node, [*argv, "recv", *target], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        recv.stdout.readline()  # "ready"
        send = fab.spawn(src_node, [*argv, "send", *target], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = send.communicate(timeout=max(60.0, nbytes * 8 / 1e6))
        if send.returncode != 0:
            raise EmulationError(f"transfer node {src_node} -> {dst_node} failed: {err.decode()[-500:]}")
        return float(out.decode().strip().splitlines()[-1])
    finally:
        fab.kill_all()


def check_links(fab: Fabric, seconds: float = 0.5) -> list[dict[str, Any]]:
    """Time one TCP transfer per tier; shaped tiers should come out a little under their tbf rate."""
    t, rows = fab.topology, []
    links = [("intra_node", 0, 0, None, t.ranks_per_node > 1), ("inter_node", 0, 1, t.inter_node_bps,
             t.nodes_per_group > 1), ("inter_group", 0, t.nodes_per_group, t.inter_group_bps, t.groups > 1)]
    for i, (tier, a, b, bps) in enumerate(link[:4] for link in links if link[4]):
        nbytes = max(1 << 20, int((bps or 4e9) / 8 * seconds))
        secs = measure_transfer(fab, a, b, nbytes, port=5201 + i)
        measured = nbytes * 8 / secs
        rows.append({"tier": tier, "from_node": a, "to_node": b, "bytes": nbytes, "seconds": secs,
                     "measured_bps": measured, "configured_bps": bps, "ratio": measured / bps if bps else None,
                     "ok": None if not bps else 0.7 <= measured / bps <= 1.05})
    return rows


def _inner_check(opts: argparse.Namespace) -> int:
    topo = load_topology(opts.cluster)
    with Fabric(topo) as fab:
        rows = check_links(fab, opts.seconds)
    if opts.json:
        print(json.dumps({"topology": topology_dict(topo), "links": rows}, indent=1))
        return 0
    print(topo.describe())
    print("| tier | nodes | MB | seconds | measured | configured | measured / configured |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tier']} | {r['from_node']} -> {r['to_node']} | {r['bytes'] / 1e6:.1f} | {r['seconds']:.3f} | "
              f"{_rate(r['measured_bps'])} | {_rate(r['configured_bps']) if r['configured_bps'] else 'unshaped'}"
              f" | {_fmt(r['ratio'], '.3f')} |")
    return 0 if all(r["ok"] in (None, True) for r in rows) else 1


def sync_topologies(F: int, S: int, bandwidths: Sequence[float]) -> list[tuple[str, EmuTopology]]:
    """Loopback (all ranks on one node) and F nodes in F groups, the group uplinks at each bandwidth."""
    names = [_rate(bw).replace(" ", "").replace("/s", "") for bw in bandwidths]
    return [("loopback", EmuTopology(name="loopback", ranks_per_node=F * S, nodes=1, nodes_per_group=1,
                                     inter_node_bps=None, inter_group_bps=None))] + [
        (name, EmuTopology(name=name, ranks_per_node=S, nodes=F, nodes_per_group=1, inter_node_bps=None,
                           inter_group_bps=bw)) for name, bw in zip(names, bandwidths)]


def _inner_sync(opts: argparse.Namespace) -> int:
    out_dir = Path(opts.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, topo in sync_topologies(opts.federations, opts.shards, opts.bandwidth_values):
        path = out_dir / f"sync_emulated_F{opts.federations}_S{opts.shards}_h{opts.hidden}_{name}.json"
        argv = [sys.executable, str(SYNC_BENCH), "--federations", str(opts.federations), "--shards", str(opts.shards),
                "--layers", str(opts.layers), "--hidden", str(opts.hidden), "--repeats", str(opts.repeats),
                "--out", str(path), *opts.extra]
        print(f"-- sync_bench on {topo.describe()} ...")
        with Fabric(topo) as fab:
            fab.run_ranks(argv, timeout=opts.run_timeout)
        res = {**json.loads(path.read_text()), "network": name, "topology": topology_dict(topo)}
        path.write_text(json.dumps(res, indent=2))
        rows.append(res)
        print(f"   sync/flat {res['sync_over_flat']:.3f}")
    print("\n| network | shard bytes/rank | sync s | flat s | per-param s | sync / flat | per-param / sync |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        med = r["median_s"]
        print(f"| {r['network']} | {r['shard_bytes_per_rank']:,} | {med['sync']:.4f} | {med['flat']:.4f} | "
              f"{med['per-param']:.4f} | {r['sync_over_flat']:.3f} | {r['per_param_over_sync']:.2f} |")
    return 0


INNER = {"main": _inner_main, "exec": _inner_exec, "check": _inner_check, "sync": _inner_sync}
"""What each mode runs inside the namespaces."""


def _inner_entry() -> int:
    """`python -m flwr_sharded_perf.bench`, started by `_reexec` inside the namespaces."""
    sys.stdout.reconfigure(line_buffering=True)  # progress lines as they come
    payload = json.loads(os.environ[ARGS_ENV])
    mode = payload.pop("mode")
    try:
        enter_private_run()
        return INNER[mode](argparse.Namespace(**payload))
    except (ConfigError, RankFailure) as exc:
        print(f"flwr-sharded bench: error: {exc}", file=sys.stderr)
        return 1
