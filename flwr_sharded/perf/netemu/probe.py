"""A throughput probe: seconds to send bytes over TCP between two nodes of a fabric (used by `bench check`)."""

from __future__ import annotations

import subprocess
import sys

from flwr_sharded.perf.netemu.network import Fabric
from flwr_sharded.perf.netemu.topology import EmulationError

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


def measure_transfer(fabric: Fabric, src_node: int, dst_node: int, nbytes: int, port: int = 5201) -> float:
    """Seconds to send `nbytes` over TCP from one node to another through the emulated links."""
    t = fabric.topology
    recv = fabric.spawn(dst_node, [sys.executable, "-c", _THROUGHPUT, "recv", t.node_ip(dst_node), str(port),
                                   str(nbytes)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        recv.stdout.readline()  # "ready"
        send = fabric.spawn(src_node, [sys.executable, "-c", _THROUGHPUT, "send", t.node_ip(dst_node), str(port),
                                       str(nbytes)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = send.communicate(timeout=max(60.0, nbytes * 8 / 1e6))
        if send.returncode != 0:
            raise EmulationError(f"transfer node {src_node} -> {dst_node} failed: {err.decode()[-500:]}")
        return float(out.decode().strip().splitlines()[-1])
    finally:
        fabric.kill_all()
