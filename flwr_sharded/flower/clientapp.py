"""The thin ClientApp side (no torch): find or launch this node's group, forward each Flower message to it.

Deployment: the SuperNode's `--node-config` names the group (`group-address="127.0.0.1:7100"
group-authkey-file="/path/key"`; optional: `data-dir`, `partition-id`, `num-partitions`, `facility`, `gpus` and the
permissions of `flwr_sharded.flower.node_policy`). Local simulation (no `group-address`): the first hello launches
the group here (`launch`), `Context.state` remembers it, and `finish` shuts it down (it also exits when its launcher
is gone, or after its idle timeout). A train message starts the round and is answered at once; each collect waits up
to its timeout, then replies `pending` (a SuperNode handles one message at a time, so an abort never waits long). The
train config goes to the group unchanged: a key it does not know is an error reply.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from flwr_sharded.errors import ConfigError
from flwr_sharded.flower import messages, shard_files
from flwr_sharded.flower.endpoint import GroupClient, GroupError, GroupUnavailable, read_authkey
from flwr_sharded.flower.launch import (ADDRESS_FILE, AUTHKEY_FILE, LaunchedGroup, assign_gpus, default_run_root,
                                        launch_group, pid_alive, stop_group, visible_gpus)
from flwr_sharded.flower.node_policy import NodePolicy
from flwr_sharded.flower.run_config import FlowerRun

logger = logging.getLogger(__name__)

STATE_KEY = "flwr-sharded-group"
"""Context.state ConfigRecord holding a launched group's pid, address and files."""
EXPORT_KEY = "flwr-sharded-export"
"""Context.state ConfigRecord of the server path's exported hand-off files (round, weight, files) until pulled."""
NODE_ADDRESS = "group-address"
NODE_AUTHKEY = "group-authkey-file"
NODE_DATA_DIR = "data-dir"
NODE_FACILITY = "facility"
NODE_GPUS = "gpus"


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
    if group is not None:
        context.state.config_records[STATE_KEY] = ConfigRecord(group.to_record())
    elif STATE_KEY in context.state.config_records:
        del context.state.config_records[STATE_KEY]


def find_group(context: Any, config: Mapping[str, Any], *, launch: bool) -> tuple[GroupClient, LaunchedGroup | None]:
    """This node's group: named by the node config (deployment), or launched here on first use (simulation)."""
    nc = context.node_config
    if NODE_ADDRESS in nc:
        if NODE_AUTHKEY not in nc:
            raise ConfigError(f"node config has {NODE_ADDRESS} but no {NODE_AUTHKEY}")
        return GroupClient(str(nc[NODE_ADDRESS]), read_authkey(str(nc[NODE_AUTHKEY]))), None
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
    partition_id = _node_partition(context, config)[0]
    run = FlowerRun.from_json(str(config["run"])).for_group(partition_id, str(nc.get(NODE_FACILITY, "")))
    p = run.train.parallel
    gpus = assign_gpus(partition_id, p.replicas * p.shards, visible_gpus(), str(nc.get(NODE_GPUS, "")))
    group = launch_group(default_run_root() / f"run-{context.run_id}" / f"node-{context.node_id}", method=p.method,
                         replicas=p.replicas, shards=p.shards, watch_pid=os.getpid(), gpus=gpus,
                         idle_timeout=float(config.get("group-idle-timeout", 600.0)),
                         ready_timeout=float(config.get("timeout", 180.0)),
                         log_file=group_log_file(run.train.output.run_dir, partition_id))
    _remember(context, group)
    return group.client(), group


def group_log_file(run_dir: str | None, partition_id: int) -> Path | None:
    """`<run-dir>/groups/group-<partition id>.log` when the ServerApp's run directory is on this machine (a
    simulation); None otherwise (the log stays in the group's private directory)."""
    if run_dir and Path(run_dir).is_dir():
        return Path(run_dir) / "groups" / f"group-{partition_id}.log"
    return None


def reply_records(ok: bool, error: str, result: Mapping[str, Any]) -> RecordDict:
    """A reply's RecordDict: numbers (and lists of numbers) in 'metrics', strings and flags in 'info'."""
    metrics: dict[str, Any] = {}
    info: dict[str, Any] = {"ok": bool(ok), "error": str(error)}
    for key, value in result.items():
        if key in ("ok", "error") or value is None:
            continue
        if isinstance(value, bool):
            metrics[key] = int(value)
        elif isinstance(value, (int, float)):
            metrics[key] = value
        elif isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            kind = float if any(isinstance(v, float) for v in value) else int
            metrics[key] = [kind(v) for v in value]
        else:
            info[key] = value if isinstance(value, str) else str(value)
    return RecordDict({messages.METRICS: MetricRecord(metrics), messages.INFO: ConfigRecord(info)})


def handle(message: Any, context: Any, verb: str) -> Any:
    """Forward one Flower message to this node's group and wrap the outcome as the reply Message. Failures (no
    group, group error, timeout) are replies with info.ok = False and the reason: a failed group, not a lost node."""
    config = dict(message.content.config_records.get(messages.CONFIG, {}))
    timeout = float(config.get("timeout", 600.0))

    def reply(result: Mapping[str, Any], ok: bool = True, error: str = "") -> Any:
        return Message(reply_records(ok, error, result), reply_to=message)

    try:
        if verb == messages.FINISH:
            return reply(_finish(context, config, timeout))
        if verb == messages.PULL:
            applied = None
            if shard_files.SHARDS in message.content:  # a chunk of the mean to apply rides along with this pull
                applied = _apply(find_group(context, config, launch=False)[0], context, message.content, config,
                                 timeout)
            return _pull(message, context, config, applied)
        client, launched = find_group(context, config, launch=verb == messages.HELLO)
        if verb == messages.HELLO:
            return _hello(message, context, config, client, launched, timeout)
        if verb == messages.TRAIN:
            args = {k: v for k, v in config.items() if k not in messages.ROUTING_KEYS}
            return reply(client.call(messages.TRAIN, args, timeout=min(timeout, messages.START_TIMEOUT_S),
                                     detach=True))
        if verb == messages.COLLECT:
            try:
                result = client.collect(str(config["job"]), timeout=timeout)
            except GroupError as exc:
                if exc.result.get("pending"):  # the round still runs: the ServerApp sends another collect
                    return reply({"pending": True})
                raise
            if result.get("export_files"):
                return _train_reply_with_manifest(message, context, result, int(config.get("server-round", 0)))
            return reply(result)
        if verb == messages.APPLY:
            return reply(_apply(client, context, message.content, config, timeout))
        if verb == messages.ABORT:
            args = {k: config[k] for k in ("prefix", "gone", "reason") if k in config}
            return reply(client.call(messages.ABORT, args, timeout=min(timeout, 30.0)))
        return reply(client.call(verb, {}, timeout=timeout))
    except GroupError as exc:
        return reply(exc.result, False, str(exc))
    except (GroupUnavailable, ConfigError, OSError, KeyError, ValueError) as exc:
        return reply({"unavailable": verb != messages.PULL}, False, f"{type(exc).__name__}: {exc}")


def _hello(message: Any, context: Any, config: Mapping[str, Any], client: GroupClient,
           launched: LaunchedGroup | None, timeout: float) -> Any:
    partition_id, num_partitions = _node_partition(context, config)
    args = {"run": config["run"], "run_key": str(config.get("run-key", context.run_id)),
            "partition_id": partition_id, "num_partitions": num_partitions,
            "rejoin": bool(config.get("rejoin", False)),
            "idle_timeout": float(config.get("group-idle-timeout", 0.0)),
            "data_dir": str(context.node_config.get(NODE_DATA_DIR, "")),
            "facility": str(context.node_config.get(NODE_FACILITY, "")),
            "save_dir": str(config.get("save-dir", "")),
            "policy": NodePolicy.from_node_config(context.node_config,
                                                  launched=NODE_ADDRESS not in context.node_config).to_args()}
    result = client.call(messages.HELLO, args, timeout=timeout)
    result["facility"] = args["facility"]
    if launched is not None:
        result["log_file"] = launched.log_file
        if result.get("pids"):
            launched.worker_pids = [int(p) for p in result["pids"]]
            _remember(context, launched)
    ok = bool(result.get("compatible", False))
    return Message(reply_records(ok, "" if ok else str(result.get("error", "incompatible")), result), reply_to=message)


def _train_reply_with_manifest(message: Any, context: Any, result: dict[str, Any], server_round: int) -> Any:
    """The round's reply with the manifest of the group's exported pieces, which the server then pulls in chunks.
    The files stay until the group adopts the round's mean (a new pass pulls them again) or the next export."""
    files = [str(f) for f in result.pop("export_files")]
    weight = float(result.get("facility_tokens", 0))
    _drop_export(context)
    context.state.config_records[EXPORT_KEY] = ConfigRecord({"round": server_round, "weight": weight,
                                                             "files": files})
    try:
        shapes, meta = shard_files.shard_manifest(files)
    except (OSError, ValueError) as exc:
        _drop_export(context)
        return Message(reply_records(False, f"cannot read the exported shards: {exc}", result), reply_to=message)
    content = reply_records(True, "", result)
    for name, record in shard_files.manifest_records(shapes, meta, server_round, weight).items():
        content[name] = record
    return Message(content, reply_to=message)


def _pull(message: Any, context: Any, config: Mapping[str, Any], applied: dict[str, Any] | None = None) -> Any:
    """Reply with the requested rows (`"key|start|stop"` each) of this round's exported pieces, and with the outcome
    of the apply chunk the message also carried, if any."""
    export = context.state.config_records.get(EXPORT_KEY)
    server_round = int(config.get("server-round", 0))
    if export is None or int(export["round"]) != server_round:
        held = "none" if export is None else f"round {export['round']}"
        raise ValueError(f"no exported shards of round {server_round} on this node (it holds {held})")
    requests = [(key, int(start), int(stop)) for key, start, stop in
                (str(text).rsplit("|", 2) for text in config.get("pieces", []))]
    arrays, meta = shard_files.read_shard_rows([str(f) for f in export["files"]], requests)
    content = RecordDict(shard_files.shard_records(arrays, meta, server_round, float(export["weight"])))
    del arrays
    if applied is not None:
        for name, record in reply_records(True, "", applied).items():
            content[name] = record
    return Message(content, reply_to=message)


def _drop_export(context: Any) -> None:
    """Remove the exported hand-off files this node still holds (and their per-round directory, once empty)."""
    export = context.state.config_records.get(EXPORT_KEY)
    if export is None:
        return
    for path in [str(f) for f in export["files"]]:
        for remove, target in ((os.unlink, path), (os.rmdir, os.path.dirname(path))):
            try:
                remove(target)
            except OSError:
                pass
    del context.state.config_records[EXPORT_KEY]


def _apply(client: GroupClient, context: Any, content: Any, config: Mapping[str, Any],
           timeout: float) -> dict[str, Any]:
    """Write one chunk of the server's mean to the apply directory of this round's pass (`attempt`); after the
    pass's last chunk every rank of the group assembles its own rows from the chunk files and adopts them."""
    arrays, meta, info = shard_files.from_records(content)
    server_round, chunk = int(config.get("server-round", 0)), int(config.get("chunk", 0))
    chunks, attempt = int(config.get("chunks", 1)), int(config.get("attempt", 0))
    if int(info.get("round", -1)) != server_round:
        raise ValueError(f"the shards are for round {info.get('round')}, this message is for round {server_round}")
    if not 0 <= chunk < chunks:
        raise ValueError(f"chunk {chunk} of {chunks}")
    handoff_dir = str(client.call(messages.STATUS, {"checksums": False}, timeout=min(timeout, 30.0))["handoff_dir"])
    directory = os.path.join(handoff_dir, f"apply-round{server_round}.{attempt}")
    if chunk == 0:  # chunks of earlier passes, or of rounds whose apply did not finish
        _remove_applies(handoff_dir, keep=directory)
    paths = [os.path.join(directory, f"c{c}.safetensors") for c in range(chunks)]
    shard_files.write_file(paths[chunk], arrays, meta)
    del arrays
    if chunk < chunks - 1:
        return {"chunk": chunk}
    try:
        missing = [p for p in paths if not os.path.isfile(p)]
        if missing:
            raise ValueError(f"{len(missing)} of the {chunks} chunks of round {server_round} did not arrive")
        out = client.call(messages.APPLY, {"server_round": server_round, "paths": paths,
                                           "evaluate": bool(config.get("evaluate", False)),
                                           "checkpoint": bool(config.get("checkpoint", False))}, timeout=timeout)
        _drop_export(context)  # the round's mean is adopted: nothing more will be pulled
        return out
    finally:
        _remove_applies(handoff_dir)


def _remove_applies(handoff_dir: str, keep: str = "") -> None:
    """Remove the apply directories under `handoff_dir` but `keep`."""
    for directory in Path(handoff_dir).glob("apply-round*"):
        if str(directory) != keep:
            shutil.rmtree(directory, ignore_errors=True)


def _finish(context: Any, config: Mapping[str, Any], timeout: float) -> dict[str, Any]:
    """End of the run: a launched group is shut down; a deployment group drops the run (or exits if asked)."""
    save_dir = str(config.get("save-dir", ""))
    if NODE_ADDRESS in context.node_config:
        client, _ = find_group(context, config, launch=False)
        if not config.get("stop-group", False):
            out = client.call(messages.FINISH, {"save_dir": save_dir}, timeout=timeout)
            return {"stopped": 0, "saved": str(out.get("saved", ""))}
        if save_dir:
            client.call(messages.FINISH, {"save_dir": save_dir}, timeout=timeout)
        client.call(messages.SHUTDOWN, timeout=min(timeout, 30.0))
        return {"stopped": 1, "saved": save_dir}
    group = _launched(context)
    if group is None:
        return {"stopped": 1, "saved": ""}  # nothing was launched here
    saved = ""
    if save_dir and pid_alive(group.pid):
        try:
            saved = group.client().call(messages.FINISH, {"save_dir": save_dir}, timeout=timeout).get("saved", "")
        except (GroupUnavailable, GroupError) as exc:
            logger.warning("save before shutdown failed: %s", exc)
    stopped = stop_group(group, timeout=min(timeout, 30.0))
    _remember(context, None)
    for name in (AUTHKEY_FILE, ADDRESS_FILE):  # keep a group.log there for post-mortems
        Path(group.run_dir, name).unlink(missing_ok=True)
    if Path(group.log_file).parent != Path(group.run_dir):  # its log is in the run directory
        shutil.rmtree(group.run_dir, ignore_errors=True)
        try:
            Path(group.run_dir).parent.rmdir()  # run-<id>/, once its last node is done
        except OSError:
            pass
    return {"stopped": int(stopped), "saved": saved}
