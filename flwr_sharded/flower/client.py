"""The thin ClientApp side (no torch): find or launch this node's group, forward each Flower message to it.

Deployment: the SuperNode's `--node-config` names the group: `group-address="127.0.0.1:7100"
group-authkey-file="/path/key"` (optional: `data-dir`, `partition-id`, `num-partitions`, `facility`).

Local simulation (no `group-address` in the node config): the first message launches the group on this machine,
`torchrun --standalone --nproc-per-node R*S -m flwr_sharded.flower.group ...` in its own session, with a fresh authkey
in a private run directory; `Context.state` remembers it so later rounds reuse it; the `finish` message of the
run's end shuts it down (and kills what is left, by pid). The group also exits on its own when the process that
launched it (the Ray actor) is gone, or after its idle timeout.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Client
from pathlib import Path
from typing import Any, Mapping

from flwr_sharded.errors import ConfigError
from flwr_sharded.flower import handoff
from flwr_sharded.flower import protocol as P
from flwr_sharded.flower.processes import pid_alive

logger = logging.getLogger(__name__)

STATE_KEY = "flwr-sharded-group"
"""Context.state ConfigRecord holding a launched group's pid, address and files."""
EXPORT_KEY = "flwr-sharded-export"
"""Context.state ConfigRecord of the server path's exported hand-off files (round, weight, files) until pulled."""
GROUP_MODULE = "flwr_sharded.flower.group"
NODE_ADDRESS = "group-address"
NODE_AUTHKEY = "group-authkey-file"
NODE_DATA_DIR = "data-dir"
NODE_FACILITY = "facility"


class GroupUnavailable(RuntimeError):
    """The group cannot be reached, rejected the key, went away or did not answer in time."""


class GroupError(RuntimeError):
    """The group answered with an error."""

    def __init__(self, message: str, result: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.result = dict(result or {})


# ----------------------------------------------------------------------------------------------- the endpoint client

class GroupClient:
    """Calls one verb per connection on a group's endpoint; every wait is bounded."""

    def __init__(self, address: str, authkey: bytes, *, connect_timeout: float = 15.0) -> None:
        self.address = address
        self.host, self.port = P.parse_address(address)
        self._authkey = authkey
        self.connect_timeout = connect_timeout

    def call(self, verb: str, args: Mapping[str, Any] | None = None, *, timeout: float = 600.0) -> dict[str, Any]:
        """Send one instruction and return the group's `result`.

        Raises GroupUnavailable (cannot connect, bad key, connection lost, no reply within `timeout` seconds) or
        GroupError (the group replied with an error).
        """
        box: dict[str, Any] = {}
        request = P.encode(P.instruction(verb, args))

        def run() -> None:
            try:
                box["reply"] = self._exchange(request, timeout)
            except BaseException as exc:  # handed to the caller
                box["error"] = exc

        # A worker thread bounds even the parts of the stdlib client that block without a timeout (connect,
        # handshake); if it hangs it is abandoned as a daemon.
        worker = threading.Thread(target=run, name=f"group-call-{verb}", daemon=True)
        worker.start()
        worker.join(timeout + self.connect_timeout + 5.0)
        if worker.is_alive():
            raise GroupUnavailable(f"group at {self.address}: no reply to {verb} within {timeout:.0f} s")
        if "error" in box:
            raise box["error"]
        reply = box["reply"]
        if not reply.get("ok"):
            raise GroupError(str(reply.get("error") or f"{verb} failed"), reply.get("result"))
        return dict(reply.get("result") or {})

    def _exchange(self, request: bytes, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + self.connect_timeout
        while True:
            try:
                conn = Client((self.host, self.port), family="AF_INET", authkey=self._authkey)
                break
            except ConnectionRefusedError as exc:
                if time.monotonic() > deadline:
                    raise GroupUnavailable(f"no group listens at {self.address} (connection refused)") from exc
                time.sleep(0.2)
            except (OSError, EOFError) as exc:
                raise GroupUnavailable(f"cannot connect to the group at {self.address}: {exc!r}") from exc
            except Exception as exc:  # multiprocessing.AuthenticationError
                raise GroupUnavailable(f"the group at {self.address} rejected this node's authkey: {exc}") from exc
        with conn:
            try:
                conn.send_bytes(request)
                if not conn.poll(timeout):
                    raise GroupUnavailable(f"group at {self.address}: no reply within {timeout:.0f} s")
                return P.decode(conn.recv_bytes(P.MAX_MESSAGE_BYTES))
            except (EOFError, OSError) as exc:
                raise GroupUnavailable(f"lost the connection to the group at {self.address} (did the group "
                                       f"die?): {exc!r}") from exc


# ----------------------------------------------------------------------------------------------- launching (local)

@dataclass
class LaunchedGroup:
    """A group this process started on the local machine."""

    pid: int
    """The torchrun launcher (leader of its own session)."""
    address: str
    authkey_file: str
    log_file: str
    run_dir: str
    worker_pids: list[int] = field(default_factory=list)
    """The ranks' pids, learned from the group's hello; killed by pid if the shutdown fails."""

    def to_record(self) -> dict[str, Any]:
        out = asdict(self)
        out["worker_pids"] = [int(p) for p in self.worker_pids]
        return out

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> LaunchedGroup:
        return cls(pid=int(record["pid"]), address=str(record["address"]),
                   authkey_file=str(record["authkey_file"]), log_file=str(record["log_file"]),
                   run_dir=str(record["run_dir"]), worker_pids=[int(p) for p in record.get("worker_pids", [])])

    def client(self) -> GroupClient:
        return GroupClient(self.address, P.read_authkey(self.authkey_file))

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(Path(self.log_file).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _is_group_process(pid: int) -> bool:
    """Guard against pid reuse: only kill processes whose command line is a group's."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return GROUP_MODULE in cmdline


def default_run_root() -> Path:
    return Path(tempfile.gettempdir()) / f"flwr_sharded-{os.getuid()}"


def launch_group(run_dir: str | Path, *, method: str, replicas: int, shards: int, idle_timeout: float = 600.0,
                 watch_pid: int | None = None, data_dir: str = "", ready_timeout: float = 180.0,
                 python: str = sys.executable, env: Mapping[str, str] | None = None) -> LaunchedGroup:
    """Start a group of R*S local ranks and wait until its endpoint listens; returns how to reach and stop it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    authkey_file, address_file, log_file = run_dir / "authkey", run_dir / "address", run_dir / "group.log"
    P.write_authkey(authkey_file)
    address_file.unlink(missing_ok=True)
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(replicas * shards),
           "-m", GROUP_MODULE, "--authkey-file", str(authkey_file), "--address", "127.0.0.1:0",
           "--address-file", str(address_file), "--method", method, "--replicas", str(replicas),
           "--shards", str(shards), "--idle-timeout", str(idle_timeout)]
    if watch_pid:
        cmd += ["--watch-pid", str(watch_pid)]
    if data_dir:
        cmd += ["--data-dir", data_dir]
    full_env = dict(os.environ if env is None else env)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    if full_env.get("CUDA_VISIBLE_DEVICES") == "":  # Ray hides GPUs from CPU-only actors; the group needs them
        del full_env["CUDA_VISIBLE_DEVICES"]
    with open(log_file, "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=True)
    group = LaunchedGroup(pid=proc.pid, address="", authkey_file=str(authkey_file), log_file=str(log_file),
                          run_dir=str(run_dir))
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if address_file.is_file():
            group.address = address_file.read_text().strip()
            logger.info("launched group pid %d at %s (log %s)", proc.pid, group.address, log_file)
            return group
        if proc.poll() is not None:
            raise GroupUnavailable(f"the group exited during start-up (code {proc.returncode}); "
                                   f"{log_file}:\n{group.log_tail()}")
        time.sleep(0.2)
    stop_group(group, graceful=False)
    raise GroupUnavailable(f"the group did not listen within {ready_timeout:.0f} s; {log_file}:\n{group.log_tail()}")


def stop_group(group: LaunchedGroup, *, graceful: bool = True, timeout: float = 30.0) -> bool:
    """Shut a launched group down: the shutdown verb, then SIGTERM, then SIGKILL by pid. True if all exited."""
    if graceful and pid_alive(group.pid) and group.address:
        try:
            group.client().call(P.SHUTDOWN, timeout=min(timeout, 10.0))
        except (GroupUnavailable, GroupError, ConfigError) as exc:
            logger.warning("shutdown of group %s: %s", group.address, exc)
    pids = [group.pid, *group.worker_pids]
    deadline = time.monotonic() + timeout
    for sig, wait in ((None, timeout / 2), (signal.SIGTERM, timeout / 4), (signal.SIGKILL, timeout / 4)):
        if sig is not None:
            for pid in pids:
                if pid_alive(pid) and (pid == group.pid or _is_group_process(pid)):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
        end = min(deadline, time.monotonic() + wait)
        while time.monotonic() < end and any(pid_alive(p) for p in pids):
            time.sleep(0.1)
        if not any(pid_alive(p) for p in pids):
            return True
    return not any(pid_alive(p) for p in pids)


# ------------------------------------------------------------------------------------------ the ClientApp handlers

def _node_partition(context: Any, config: Mapping[str, Any]) -> tuple[int, int]:
    """The node config's partition-id/num-partitions when set (the Flower convention), else the server's."""
    nc = context.node_config
    if "partition-id" in nc and "num-partitions" in nc:
        return int(nc["partition-id"]), int(nc["num-partitions"])
    return int(config.get("partition-id", 0)), int(config.get("num-partitions", 1))


def _launched(context: Any) -> LaunchedGroup | None:
    record = context.state.config_records.get(STATE_KEY)
    return LaunchedGroup.from_record(record) if record is not None else None


def _remember(context: Any, group: LaunchedGroup | None) -> None:
    from flwr.app import ConfigRecord

    if group is None:
        if STATE_KEY in context.state.config_records:
            del context.state.config_records[STATE_KEY]
    else:
        context.state.config_records[STATE_KEY] = ConfigRecord(group.to_record())


def find_group(context: Any, config: Mapping[str, Any], *, launch: bool) -> tuple[GroupClient, LaunchedGroup | None]:
    """This node's group: named by the node config (deployment), or launched here on first use (simulation)."""
    nc = context.node_config
    if NODE_ADDRESS in nc:
        if NODE_AUTHKEY not in nc:
            raise ConfigError(f"node config has {NODE_ADDRESS} but no {NODE_AUTHKEY}")
        return GroupClient(str(nc[NODE_ADDRESS]), P.read_authkey(str(nc[NODE_AUTHKEY]))), None
    group = _launched(context)
    if group is not None:
        if pid_alive(group.pid):
            return group.client(), group
        if not launch:
            raise GroupUnavailable(f"the group this node launched (pid {group.pid}) has exited; "
                                   f"{group.log_file}:\n{group.log_tail()}")
        logger.warning("the group this node launched (pid %d) has exited; launching a new one", group.pid)
        stop_group(group, graceful=False, timeout=10.0)  # any rank left behind
        _remember(context, None)
    if not launch:
        raise GroupUnavailable("this node has no group (no hello reached it, and the node config names none)")
    spec = P.RunSpec.from_json(str(config["spec"])).for_group(_node_partition(context, config)[0],
                                                               str(context.node_config.get(NODE_FACILITY, "")))
    run_dir = default_run_root() / f"run-{context.run_id}" / f"node-{context.node_id}"
    group = launch_group(run_dir, method=spec.method, replicas=spec.replicas, shards=spec.shards,
                         idle_timeout=float(config.get("group-idle-timeout", 600.0)), watch_pid=os.getpid(),
                         ready_timeout=float(config.get("timeout", 180.0)))
    _remember(context, group)
    return group.client(), group


def to_records(ok: bool, error: str, result: Mapping[str, Any]):
    """A reply's RecordDict: numbers (and lists of numbers) in 'metrics', strings and flags in 'info'."""
    from flwr.app import ConfigRecord, MetricRecord, RecordDict

    metrics: dict[str, Any] = {}
    info: dict[str, Any] = {"ok": bool(ok), "error": str(error)}
    for key, value in result.items():
        if key in ("ok", "error"):
            continue
        if isinstance(value, bool):
            metrics[key] = int(value)
        elif isinstance(value, (int, float)):
            metrics[key] = value
        elif isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            floats = any(isinstance(v, float) for v in value)
            metrics[key] = [float(v) for v in value] if floats else [int(v) for v in value]
        elif isinstance(value, str):
            info[key] = value
        elif value is None:
            continue
        else:
            info[key] = str(value)
    return RecordDict({P.METRICS: MetricRecord(metrics), P.INFO: ConfigRecord(info)})


def handle(message: Any, context: Any, verb: str) -> Any:
    """Forward one Flower message to this node's group and wrap the outcome as the reply Message.

    Failures (no group, group error, timeout) become a reply with info.ok = False and the reason, so the ServerApp
    can tell a failed group from a lost node.
    """
    from flwr.app import Message

    config = dict(message.content.config_records.get(P.CONFIG, {}))
    timeout = float(config.get("timeout", 600.0))
    launched: LaunchedGroup | None = None
    try:
        if verb == P.FINISH:
            return Message(to_records(True, "", _finish(context, config, timeout)), reply_to=message)
        if verb == P.PULL:
            applied = None
            if handoff.SHARDS in message.content:  # a chunk of the mean to apply rides along with this pull
                group_client, _ = find_group(context, config, launch=False)
                applied = _apply(group_client, context, message.content, _group_args(context, config, P.APPLY),
                                 timeout)
            return _pull(message, context, config, applied)
        client, launched = find_group(context, config, launch=verb == P.HELLO)
        args = _group_args(context, config, verb)
        if verb == P.APPLY:
            return Message(to_records(True, "", _apply(client, context, message.content, args, timeout)),
                           reply_to=message)
        result = client.call(verb, args, timeout=timeout)
        if verb == P.HELLO:
            result["facility"] = str(context.node_config.get(NODE_FACILITY, ""))
        if verb == P.TRAIN and result.get("export_files"):
            return _train_reply_with_manifest(message, context, result, int(config.get("server-round", 0)))
        if verb == P.HELLO and launched is not None and result.get("pids"):
            launched.worker_pids = [int(p) for p in result["pids"]]
            _remember(context, launched)
        if verb == P.HELLO and not result.get("compatible", False):
            return Message(to_records(False, str(result.get("error", "incompatible")), result), reply_to=message)
        return Message(to_records(True, "", result), reply_to=message)
    except GroupError as exc:
        return Message(to_records(False, str(exc), exc.result), reply_to=message)
    except (GroupUnavailable, ConfigError, OSError, KeyError, ValueError) as exc:
        return Message(to_records(False, f"{type(exc).__name__}: {exc}", {"unavailable": verb != P.PULL}),
                       reply_to=message)


def _group_args(context: Any, config: Mapping[str, Any], verb: str) -> dict[str, Any]:
    """The group instruction's args from the ServerApp's ConfigRecord (node config completes the hello)."""
    if verb == P.HELLO:
        partition_id, num_partitions = _node_partition(context, config)
        return {"spec": config["spec"], "run_key": str(config.get("run-key", context.run_id)),
                "partition_id": partition_id, "num_partitions": num_partitions,
                "rejoin": bool(config.get("rejoin", False)),
                "data_dir": str(context.node_config.get(NODE_DATA_DIR, "")),
                "facility": str(context.node_config.get(NODE_FACILITY, ""))}
    if verb == P.TRAIN:
        return {"syncs": int(config["syncs"]), "steps": int(config["steps"]),
                "members": [str(m) for m in config["members"]], "member_index": int(config["member-index"]),
                "rendezvous_host": str(config["rendezvous-host"]),
                "rendezvous_ports": [int(p) for p in config["rendezvous-ports"]], "prefix": str(config["prefix"]),
                "rendezvous_timeout": float(config["rendezvous-timeout"]),
                "sync_timeout": float(config["sync-timeout"]), "evaluate": bool(config.get("evaluate", True)),
                "export": bool(config.get("export", False)), "checkpoint": bool(config.get("checkpoint", False)),
                "server_round": int(config.get("server-round", 0)), "catch_up": bool(config.get("catch-up", False))}
    if verb == P.APPLY:
        return {"evaluate": bool(config.get("evaluate", False)), "server_round": int(config.get("server-round", 0)),
                "checkpoint": bool(config.get("checkpoint", False)), "chunk": int(config.get("chunk", 0)),
                "chunks": int(config.get("chunks", 1)), "attempt": int(config.get("attempt", 0))}
    return {}


def _train_reply_with_manifest(message: Any, context: Any, result: dict[str, Any], server_round: int) -> Any:
    """The train reply with the manifest of the group's exported pieces; the server then pulls them in chunks.

    The files stay until the group adopts the round's mean (the server may pull a chunk again if it starts over
    without a failed facility), or until the next export replaces them.
    """
    from flwr.app import ConfigRecord, Message

    files = [str(f) for f in result.pop("export_files")]
    weight = float(result.get("facility_tokens", 0))
    _drop_export(context)
    context.state.config_records[EXPORT_KEY] = ConfigRecord({"round": server_round, "weight": weight,
                                                             "files": files})
    try:
        shapes, meta = handoff.manifest(files)
    except (OSError, ValueError) as exc:
        _drop_export(context)
        return Message(to_records(False, f"cannot read the exported shards: {exc}", result), reply_to=message)
    content = to_records(True, "", result)
    for name, record in handoff.manifest_records(shapes, meta, server_round, weight).items():
        content[name] = record
    return Message(content, reply_to=message)


def _pull(message: Any, context: Any, config: Mapping[str, Any], applied: dict[str, Any] | None = None) -> Any:
    """Reply with the requested rows (`"key|start|stop"` each) of this round's exported pieces (and with the
    outcome of the apply chunk the message also carried, if any)."""
    from flwr.app import Message, RecordDict

    export = context.state.config_records.get(EXPORT_KEY)
    server_round = int(config.get("server-round", 0))
    if export is None or int(export["round"]) != server_round:
        held = "none" if export is None else f"round {export['round']}"
        raise ValueError(f"no exported shards of round {server_round} on this node (it holds {held})")
    requests = []
    for text in config.get("pieces", []):
        key, start, stop = str(text).rsplit("|", 2)
        requests.append((key, int(start), int(stop)))
    arrays, meta = handoff.read_rows([str(f) for f in export["files"]], requests)
    content = RecordDict(handoff.to_records(arrays, meta, server_round, float(export["weight"])))
    del arrays
    if applied is not None:
        for name, record in to_records(True, "", applied).items():
            content[name] = record
    return Message(content, reply_to=message)


def _drop_export(context: Any) -> None:
    """Remove the exported hand-off files this node still holds, if any."""
    export = context.state.config_records.get(EXPORT_KEY)
    if export is not None:
        _remove_files([str(f) for f in export["files"]])
        del context.state.config_records[EXPORT_KEY]


def _apply(client: GroupClient, context: Any, content: Any, args: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Write one chunk of the server's pieces to the apply directory of this round's pass (`attempt`: the server
    starts a pass over when it leaves a facility out); after the pass's last chunk every rank of the group
    assembles its own rows from the chunk files and adopts them."""
    arrays, meta, info = handoff.from_records(content)
    server_round, chunk, chunks = args.pop("server_round"), args.pop("chunk"), args.pop("chunks")
    attempt = args.pop("attempt")
    if int(info.get("round", -1)) != server_round:
        raise ValueError(f"the shards are for round {info.get('round')}, this message is for round {server_round}")
    if not 0 <= chunk < chunks:
        raise ValueError(f"chunk {chunk} of {chunks}")
    handoff_dir = str(client.call(P.STATUS, timeout=min(timeout, 30.0))["handoff_dir"])
    directory = os.path.join(handoff_dir, f"apply-round{server_round}.{attempt}")
    if chunk == 0:  # chunks of earlier passes, or of rounds whose apply did not finish
        _remove_applies(handoff_dir, keep=directory)
    paths = [os.path.join(directory, f"c{c}.safetensors") for c in range(chunks)]
    handoff.write_file(paths[chunk], arrays, meta)
    del arrays
    if chunk < chunks - 1:
        return {"chunk": chunk}
    try:
        missing = [p for p in paths if not os.path.isfile(p)]
        if missing:
            raise ValueError(f"{len(missing)} of the {chunks} chunks of round {server_round} did not arrive")
        out = client.call(P.APPLY, {**args, "server_round": server_round, "paths": paths}, timeout=timeout)
        _drop_export(context)  # the round's mean is adopted: nothing more will be pulled
        return out
    finally:
        _remove_applies(handoff_dir)


def _remove_applies(handoff_dir: str, keep: str = "") -> None:
    """Remove the apply directories under `handoff_dir` but `keep`."""
    for directory in Path(handoff_dir).glob("apply-round*"):
        if str(directory) != keep:
            shutil.rmtree(directory, ignore_errors=True)


def _remove_files(paths: list[str], directories: bool = True) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass
        if directories:
            try:
                os.rmdir(os.path.dirname(path))  # the per-round export directory, once empty
            except OSError:
                pass


def _finish(context: Any, config: Mapping[str, Any], timeout: float) -> dict[str, Any]:
    """End of the run: a launched group is shut down; a deployment group drops the run (or exits if asked)."""
    save_dir = str(config.get("save-dir", ""))
    group = _launched(context)
    nc = context.node_config
    if NODE_ADDRESS not in nc and group is not None:
        saved = ""
        if save_dir and pid_alive(group.pid):
            try:
                saved = group.client().call(P.FINISH, {"save_dir": save_dir}, timeout=timeout).get("saved", "")
            except (GroupUnavailable, GroupError) as exc:
                logger.warning("save before shutdown failed: %s", exc)
        stopped = stop_group(group, timeout=min(timeout, 30.0))
        _remember(context, None)
        for name in ("authkey", "address"):  # keep group.log for post-mortems
            Path(group.run_dir, name).unlink(missing_ok=True)
        return {"stopped": int(stopped), "saved": saved}
    if NODE_ADDRESS not in nc:
        return {"stopped": 1, "saved": ""}  # nothing was launched here
    client, _ = find_group(context, config, launch=False)
    if bool(config.get("stop-group", False)):
        if save_dir:
            client.call(P.FINISH, {"save_dir": save_dir}, timeout=timeout)
        client.call(P.SHUTDOWN, timeout=min(timeout, 30.0))
        return {"stopped": 1, "saved": save_dir}
    out = client.call(P.FINISH, {"save_dir": save_dir}, timeout=timeout)
    return {"stopped": 0, "saved": str(out.get("saved", ""))}
