"""What `bench exec`, `bench check` and `bench sync` do inside the namespaces: a command per rank, the links'
throughput, and benchmarks/sync_bench.py on loopback and shaped links."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from flwr_sharded.perf.bench.options import REPO
from flwr_sharded.perf.bench.report import _fmt
from flwr_sharded.perf.netemu.isolation import enter_private_run
from flwr_sharded.perf.netemu.network import Fabric, RankFailure
from flwr_sharded.perf.netemu.topology import EmulationError, EmuTopology, _rate, load_topology, topology_dict

SYNC_BENCH = REPO / "benchmarks" / "sync_bench.py"
_THROUGHPUT = r"""
import socket, sys, time
mode, host, port, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if mode == "recv":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((host, port)); s.listen(1)
    print("ready", flush=True)
    c, _ = s.accept(); got = 0
    while True:
        b = c.recv(1 << 20)
        if not b:
            break
        got += len(b)
    c.sendall(b"k"); print(got, flush=True)
else:
    for _ in range(100):
        try:
            c = socket.create_connection((host, port)); break
        except OSError:
            time.sleep(0.05)
    buf = b"x" * (1 << 16); sent = 0; t = time.perf_counter()
    while sent < n:
        c.sendall(buf[: min(len(buf), n - sent)]); sent += min(len(buf), n - sent)
    c.shutdown(socket.SHUT_WR); c.recv(1)
    print(time.perf_counter() - t, flush=True)
"""
"""A TCP throughput probe: `recv HOST PORT N` prints "ready", then the bytes it got; `send HOST PORT N` the seconds."""


def _inner_exec(opts: argparse.Namespace) -> int:
    enter_private_run()
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


def link_checks(topo: EmuTopology) -> list[tuple[str, int, int, float | None]]:
    """(tier, source node, destination node, configured bits/s) for one transfer on each tier."""
    out: list[tuple[str, int, int, float | None]] = []
    if topo.ranks_per_node > 1:
        out.append(("intra_node", 0, 0, None))
    if topo.nodes_per_group > 1:
        out.append(("inter_node", 0, 1, topo.inter_node_bps))
    if topo.groups > 1:
        out.append(("inter_group", 0, topo.nodes_per_group, topo.inter_group_bps))
    return out


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
    rows = []
    for i, (tier, a, b, bps) in enumerate(link_checks(fab.topology)):
        nbytes = max(1 << 20, int((bps or 4e9) / 8 * seconds))
        secs = measure_transfer(fab, a, b, nbytes, port=5201 + i)
        measured = nbytes * 8 / secs
        rows.append({"tier": tier, "from_node": a, "to_node": b, "bytes": nbytes, "seconds": secs,
                     "measured_bps": measured, "configured_bps": bps,
                     "ratio": measured / bps if bps else None,
                     "ok": None if not bps else 0.7 <= measured / bps <= 1.05})
    return rows


def _inner_check(opts: argparse.Namespace) -> int:
    enter_private_run()
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
    out = [("loopback", EmuTopology(name="loopback", ranks_per_node=F * S, nodes=1, nodes_per_group=1,
                                    inter_node_bps=None, inter_group_bps=None))]
    for bw in bandwidths:
        name = _rate(bw).replace(" ", "").replace("/s", "")
        out.append((name, EmuTopology(name=name, ranks_per_node=S, nodes=F, nodes_per_group=1,
                                      inter_node_bps=None, inter_group_bps=bw)))
    return out


def _inner_sync(opts: argparse.Namespace) -> int:
    enter_private_run()
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
        res = json.loads(path.read_text())
        res["network"] = name
        res["topology"] = topology_dict(topo)
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
