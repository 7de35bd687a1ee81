"""A group's uplink cut while one of its ranks is inside a sync, then restored: the in-network side of the cut-link
tests, run as the isolated runner (`flwr_sharded_perf.netemu.isolation.run_isolated`):

    python -m tests.faults.cut_link static|flower WORKDIR DATA_DIR

Three groups of 2 ranks, each group on a node of its own in the emulated network (unshaped). Rank 1 of group 1 (B)
holds for `HOLD_S` seconds inside a sync, after the admission (the test-only fault `hold_sync`); once it logs so,
B's uplink goes down for `CUT_S` seconds, then up again. What each scenario saw goes to WORKDIR/cut.json, which the
test asserts on:

- `static`: the static engine, fl-fsdp F=3 x S=2, `--sync-retries 3`: the run's times of the cut, of the first
  `sync_failed` record and of the restore, and whether every rank exited 0 (the models: the groups' checkpoints).
- `flower`: three group runtimes driven round by round as the ServerApp drives them, each endpoint on its node's
  loopback (its ClientApp's side of the link): round 1 with all three; round 2, in which B holds and is cut off; round
  3 with A and C as soon as they replied; after the restore, round 4 with B back, caught up from A. Every reply and
  its time.
"""

from __future__ import annotations

import ctypes
import json
import shutil
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from flwr_sharded_perf.netemu.isolation import enter_private_run
from flwr_sharded_perf.netemu.network import EmuTopology, Fabric, RankFailure
from tests.local_flower import wait_until

CUT_S = 30.0
"""How long B's uplink is down."""
HOLD_S = 3.0
"""How long B's rank 1 holds inside the sync: the cut lands while the others wait for its part."""
STATIC_TIMEOUT = 25.0
"""The static engine's `--timeout`: after its sync fails, a rank waits up to this long for the cut member to come
back (it must outlast the rest of the cut and TCP's retransmission back-off)."""
FLOWER_SYNC_TIMEOUT = 15.0
TOPOLOGY = EmuTopology("cut", ranks_per_node=2, nodes=3, nodes_per_group=1, inter_node_bps=None, inter_group_bps=None)
CUT_GROUP = 1
CLONE_NEWNET = 0x40000000


def holding(log: Path) -> bool:
    """Whether the rank writing `log` holds inside its sync (the fault's log line)."""
    return log.is_file() and "holds for" in log.read_text(errors="replace")


def cut(fab: Fabric, seconds: float) -> tuple[float, threading.Thread]:
    """B's uplink down now, up again after `seconds` (in a thread); the time it went down."""
    fab.set_uplink(CUT_GROUP, False)
    at = time.monotonic()
    restore = threading.Thread(target=lambda: (time.sleep(seconds), fab.set_uplink(CUT_GROUP, True)), daemon=True)
    restore.start()
    return at, restore


def static(fab: Fabric, work: Path, data_dir: str) -> dict[str, Any]:
    from tests.multiproc import faults_env

    run_dir, metrics = work / "run", work / "run" / "metrics.jsonl"
    argv = [sys.executable, "-m", "flwr_sharded.train", "--method", "fl-fsdp", "--federations", "3", "--shards", "2",
            "--model", "tiny", "--data-dir", data_dir, "--seq-len", "32", "--batch-size", "2", "--steps", "8",
            "--aggregate-every", "2", "--log-every", "1", "--eval-every", "0", "--eval-blocks", "4", "--no-progress",
            "--no-save-model", "--timeout", str(STATIC_TIMEOUT), "--sync-retries", "3", "--run-dir", str(run_dir),
            "--checkpoint-dir", str(work / "ckpt")]
    held = TOPOLOGY.ranks_per_node * CUT_GROUP + 1  # rank 1 of group 1
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            fab.run_ranks(argv, env=faults_env(hold_sync=f"2@{held}:{HOLD_S}"), timeout=400, log_dir=work / "logs")
            outcome["ranks_exit"] = 0
        except RankFailure as exc:
            outcome["ranks_exit"], outcome["error"] = exc.code, str(exc)

    ranks = threading.Thread(target=run, daemon=True)
    ranks.start()
    wait_until(lambda: holding(work / "logs" / f"rank{held}.err") or not ranks.is_alive(), 240, 0.05, "the hold")
    if not ranks.is_alive():
        return {**outcome, "stage": "before the hold"}
    cut_at, restore = cut(fab, CUT_S)
    wait_until(lambda: "sync_failed" in _text(metrics) or not ranks.is_alive(), 120, 0.05, "a sync_failed record")
    failed_at = time.monotonic()
    restore.join()
    restored_at = time.monotonic()
    ranks.join(400)
    return {**outcome, "failed_s": failed_at - cut_at, "restored_s": restored_at - cut_at,
            "ended_s": time.monotonic() - cut_at, "timeout": STATIC_TIMEOUT, "cut_s": CUT_S}


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def node_client(netns: str, address: str, key: Path) -> Any:
    """A `GroupClient` of a group's endpoint whose connections are made in its node's namespace (the endpoint listens
    on that node's loopback, as a group's does for the ClientApp on its node): each call's connection is opened from
    its own worker thread, moved into the namespace and back."""
    from flwr_sharded.flower.endpoint import GroupClient, read_authkey

    client = GroupClient(address, read_authkey(key))
    exchange = client._exchange
    client._exchange = lambda request, timeout: _in_netns(netns, lambda: exchange(request, timeout))
    return client


def _in_netns(netns: str, fn: Callable[[], Any]) -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    with open("/proc/thread-self/ns/net") as home, open(f"/run/netns/{netns}") as node:
        if libc.setns(node.fileno(), CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns}")
        try:
            return fn()
        finally:
            libc.setns(home.fileno(), CLONE_NEWNET)


def flower(fab: Fabric, work: Path, data_dir: str) -> dict[str, Any]:
    from flwr_sharded.flower import messages as P
    from tests.flower.test_faults import Round
    from tests.flower.test_group import hello, round_args, spec, train_all
    from tests.local_flower import Procs, start_groups
    from tests.multiproc import faults_env

    timeout, seen = FLOWER_SYNC_TIMEOUT, {}
    procs = Procs(work)
    try:
        ip = shutil.which("ip") or "ip"
        groups = []
        for g, name in enumerate("ABC"):
            env = {"GLOO_SOCKET_IFNAME": "eth0", **(faults_env(hold_sync=f"2@1:{HOLD_S}") if g == CUT_GROUP else {})}
            groups.append((name, dict(env=env, wrap=(ip, "netns", "exec", TOPOLOGY.netns(g)),
                                      extra=["--rendezvous-host", TOPOLOGY.node_ip(g)])))
        started = start_groups(procs, groups)
        clients = [node_client(TOPOLOGY.netns(g), address, key) for g, (_, address, key) in enumerate(started)]
        s = spec(Path(data_dir), aggregate_every=2, syncs_per_round=1, rounds=8)
        offer = [hello(c, s, i, 3) for i, c in enumerate(clients)][0]
        seen["round1"] = train_all(clients, offer, "cut/round1", syncs=1, steps=2, sync_timeout=timeout)

        args = [round_args(offer, "cut/round2", i, 3, syncs=2, steps=2, sync_timeout=timeout) for i in range(3)]
        rnd = Round(clients, args).start()
        wait_until(lambda: holding(procs.workdir / "B.log"), 120, 0.05, "B's rank 1 holding inside its sync")
        cut_at, restore = cut(fab, CUT_S)
        others = [rnd.wait(i, timeout + 60) for i in (0, 2)]  # the round goes on without waiting for B
        status = {i: clients[i].call(P.STATUS, timeout=30)["checksums"] for i in (0, 2)}
        a3, c3 = train_all([clients[0], clients[2]], offer, "cut/round3", syncs=1, steps=2, sync_timeout=timeout)
        seen["round3"], seen["round3_s"] = [a3, c3], time.monotonic() - cut_at
        seen["round2"] = [others[0], rnd.wait(1, timeout + 60), others[1]]
        seen["round2_s"] = [at - cut_at for at in rnd.done_at]
        seen["status2"] = [status[0], clients[1].call(P.STATUS, timeout=30)["checksums"], status[2]]
        restore.join()
        seen["restored_s"] = time.monotonic() - cut_at
        order = [clients[0], clients[2], clients[1]]  # B rejoins as member 2, catching up from A (member 0)
        jobs = [c.call(P.TRAIN, round_args(offer, "cut/round4", i, 3, syncs=1, steps=2, sync_timeout=timeout,
                                           catch_up=True), timeout=30, detach=True)["job"]
                for i, c in enumerate(order)]
        seen["round4"] = [c.collect(job, timeout=180) for c, job in zip(order, jobs)]
    finally:
        procs.close()
    return {**seen, "timeout": timeout, "cut_s": CUT_S}


def run_cut(scenario: str, work: Path, data_dir: Path, timeout: float = 540.0) -> dict[str, Any]:
    """The test's side: run `scenario` in fresh namespaces; what it saw (AssertionError if it failed to run)."""
    from flwr_sharded_perf.netemu.isolation import run_isolated
    from tests import REPO

    done = run_isolated([sys.executable, "-m", "tests.faults.cut_link", scenario, str(work), str(data_dir)],
                        env={"PYTHONPATH": str(REPO)}, timeout=timeout, capture=True)
    path = work / "cut.json"
    assert done.returncode == 0 and path.is_file(), done.stderr[-4000:]
    result = json.loads(path.read_text())
    assert "error" not in result, result.get("traceback")
    return result


def main() -> int:
    scenario, work, data_dir = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    enter_private_run()
    result: dict[str, Any]
    try:
        with Fabric(TOPOLOGY) as fab:
            result = {"static": static, "flower": flower}[scenario](fab, work, data_dir)
    except Exception as exc:  # noqa: BLE001 - the test shows it
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    (work / "cut.json").write_text(json.dumps(result, indent=1, default=repr))
    return 0


if __name__ == "__main__":
    sys.exit(main())
