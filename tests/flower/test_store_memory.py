"""A group's rendezvous store keeps its memory bounded whatever a client sends: the store runs in a subprocess
(like a group's rank 0) and the test floods it, as a stranger without the secret and as a member with it, sampling
the subprocess's resident memory all along. Bounded: every socket has a timeout, the subprocess is killed at the
end."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.flower.test_group import ROUND_SECRET
from tests.multiproc import REPO

pytestmark = pytest.mark.dist  # every test here starts processes

VALUES, VALUE_BYTES = 64, (8 << 20) - 64
"""64 values just under TCPStore's 8 MiB cap (what grew a TCPStore server by 528 MiB)."""
BUDGET_BYTES = 64 << 20

_SERVER = f"""
import sys
from flwr_sharded.flower import rendezvous
server = rendezvous.serve_stores("127.0.0.1", 1)
server.open_round("run1/round1", {ROUND_SECRET!r}, 1)
print(server.ports[0], flush=True)
sys.stdin.read()
"""


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))


class _Peak(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop = pid, _rss(pid), threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.01):
            self.peak = max(self.peak, _rss(self.pid))


def _send(port: int, head: bytes, size: int, source: str) -> None:
    """One connection from `source`: `head`, then `size` bytes, as far as the server takes them within 10 s."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0)) as sock:
            sock.recv(4096)
            sock.sendall(head + b"\x07" * size)
            sock.recv(1)
    except OSError:
        pass


def _stranger(port: int) -> None:
    """64 connections at once (from 8 loopback addresses, as many as the store admits unproven), each announcing a
    frame just under 8 MiB and sending it; then 64 that send a well-formed hello and 8 MiB after it."""
    from flwr_sharded.flower import store_channel as ch
    from flwr_sharded.flower import store_server as srv

    hello = ch.plain_frame(ch.pack(b"h", b"run1/round1/s0", b"\0" * 32, b"\0" * 32))
    sources = [f"127.0.0.{2 + i // srv.MAX_PENDING_PER_HOST}" for i in range(VALUES)]
    for head in (VALUE_BYTES.to_bytes(4, "big"), hello):
        threads = [threading.Thread(target=_send, args=(port, head, VALUE_BYTES, source)) for source in sources]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)


def _member(port: int) -> tuple[int, int]:
    """With the secret: 64 sets of 8 MiB values (refused, each closing the connection), then 1 MiB values until
    the store is full; returns (values stored, values refused)."""
    from flwr_sharded.flower import store_channel as ch
    from flwr_sharded.flower.store_client import RoundStore

    def client() -> RoundStore:
        return RoundStore.connect("127.0.0.1", port, "run1/round1/s0", ROUND_SECRET.encode(),
                                  deadline=time.monotonic() + 10, timeout=10)
    for i in range(VALUES):
        with pytest.raises(OSError):
            client().set(f"big/{i}", b"\x07" * VALUE_BYTES)
    member, stored, refused = client(), 0, 0
    for i in range(VALUES):
        try:
            member.set(f"value/{i}", b"\x07" * ch.VALUE_MAX_BYTES)
            stored += 1
        except RuntimeError as exc:
            assert "full" in str(exc)
            refused += 1
    return stored, refused


@pytest.mark.timeout(180)
def test_a_flood_of_large_values_grows_the_store_by_at_most_64_mib():
    proc = subprocess.Popen([sys.executable, "-c", _SERVER], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        time.sleep(0.5)
        base = _rss(proc.pid)
        peak = _Peak(proc.pid)
        peak.start()
        start = time.monotonic()
        _stranger(port)
        stranger_mib = (peak.peak - base) / 2**20
        stored, refused = _member(port)
        seconds = time.monotonic() - start
        peak.stop.set()
        peak.join(5)
        assert proc.poll() is None  # the store is still serving
    finally:
        proc.kill()
        proc.wait(10)
    grown_mib = (peak.peak - base) / 2**20
    from flwr_sharded.flower import store_server as srv

    assert stored == srv.STORE_MAX_BYTES // (1 << 20) - 1 and refused == VALUES - stored
    assert grown_mib <= BUDGET_BYTES / 2**20
    print(f"\nstore RSS {base / 2**20:.0f} MiB; peak growth under the stranger's flood (2 x 64 connections x 8 MiB) "
          f"{stranger_mib:.1f} MiB, after a member's (64 x 8 MiB refused, then 1 MiB values: {stored} stored, "
          f"{refused} refused as full) {grown_mib:.1f} MiB; {seconds:.1f} s")
