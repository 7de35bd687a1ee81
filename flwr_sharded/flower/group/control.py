"""The group's instruction loop: rank 0 takes instructions from the local endpoint and broadcasts each over the
runtime's gloo control group; the other ranks follow; every rank executes it (`GroupRuntime.execute`). A detached
instruction (a train round) is acknowledged first and its result kept for the `collect` that follows. The loop ends
on `shutdown`, after `--idle-timeout` without an instruction, when `--watch-pid` is gone, or when a verb fails."""

from __future__ import annotations

import logging
import os
import queue
import shutil
import time
from typing import TYPE_CHECKING

from flwr_sharded.flower import endpoint, messages
from flwr_sharded.flower.group import aborts
from flwr_sharded.flower.launch import pid_alive

if TYPE_CHECKING:
    from flwr_sharded.flower.group.runtime import GroupRuntime

logger = logging.getLogger("flwr_sharded.group")


def serve(runtime: GroupRuntime) -> int:
    """Rank 0: take instructions from the endpoint until shutdown, idle timeout or watched process exit."""
    args = runtime.args
    server = endpoint.EndpointServer(endpoint.parse_address(args.address), endpoint.read_authkey(args.authkey_file))
    server.on_abort = aborts.abort_round
    address = endpoint.format_address(*server.address)
    if args.address_file:
        tmp = f"{args.address_file}.tmp"
        with open(tmp, "w") as fh:
            fh.write(address)
        os.replace(tmp, args.address_file)
    logger.info("group %s R=%d x S=%d (%d ranks, pids %s) serving on %s; rendezvous offer %s:%s", args.method,
                args.replicas, args.shards, runtime.world, runtime.pids, address, args.rendezvous_host,
                runtime.offer_ports)
    last = time.monotonic()
    try:
        while True:
            try:
                request = server.incoming.get(timeout=1.0)
            except queue.Empty:
                last = max(last, server.last_request)  # collects and aborts count as signs of life
                reason = _stop_reason(runtime, last)
                if reason:
                    logger.info("shutting down: %s", reason)
                    runtime.broadcast(messages.instruction(messages.SHUTDOWN, {"reason": reason}))
                    return 0
                if runtime.trainer is not None and runtime.run_idle_s and time.monotonic() - last > runtime.run_idle_s:
                    _drop_idle_run(runtime, time.monotonic() - last)
                continue
            code = _serve_request(runtime, server, request)
            last = time.monotonic()
            if request.verb == messages.SHUTDOWN or code:
                return code
    finally:
        server.close()
        if runtime.store is not None:
            runtime.store.close()
        shutil.rmtree(runtime.handoff_dir, ignore_errors=True)  # made for this group alone


def follow(runtime: GroupRuntime) -> int:
    """Ranks > 0: execute whatever rank 0 broadcasts, until shutdown."""
    while True:
        try:
            verb, args = messages.check_instruction(runtime.broadcast(None))
        except Exception as exc:  # rank 0 gone or timed out: torchrun tears the rest down
            logger.error("lost rank 0 (%s); exiting", exc)
            return 1
        _, code = runtime.execute(verb, args)
        if verb == messages.SHUTDOWN or code:
            return code


def _drop_idle_run(runtime: GroupRuntime, idle: float) -> None:
    """No instruction for the run's `group-idle-timeout`: its ServerApp is gone (a SuperLink restart, a killed run).
    Every rank drops the trainer and its memory; the group serves on (a new hello rebuilds it, resuming)."""
    logger.warning("no instruction for %.0f s (group-idle-timeout %.0f s of run %s): its ServerApp is gone; "
                   "dropping the run to free this group's memory", idle, runtime.run_idle_s, runtime.key.split("|")[0])
    runtime.broadcast(messages.instruction(messages.FINISH, {"reason": "idle"}))
    runtime.execute(messages.FINISH, {"reason": "idle"})


def _stop_reason(runtime: GroupRuntime, last: float) -> str:
    idle, watched = runtime.args.idle_timeout, runtime.args.watch_pid
    if idle > 0 and time.monotonic() - last > idle:
        return f"no instruction for {idle:.0f} s (--idle-timeout)"
    if watched and not pid_alive(watched):
        return f"watched process {watched} is gone"
    return ""


def _serve_request(runtime: GroupRuntime, server: endpoint.EndpointServer, request: endpoint.Request) -> int:
    verb, args = request.verb, request.args
    job = str(args.get("job", "")) if request.detach else ""
    if request.detach:
        if not job:
            request.reply(messages.reply_error("a detached instruction needs a job name"))
            return 0
        server.job_started(job)
        request.reply(messages.reply_ok({"job": job}))
    start = time.monotonic()
    logger.info("received %s%s", verb, f" ({args['prefix']})" if "prefix" in args else "")
    runtime.broadcast(messages.instruction(verb, args))
    reply, code = runtime.execute(verb, args)
    logger.info("%s -> %s in %.2f s", verb, "ok" if reply["ok"] else f"error: {reply['error']}",
                time.monotonic() - start)
    if request.detach:
        server.job_finished(job, reply)
    else:
        request.reply(reply)
    return code
