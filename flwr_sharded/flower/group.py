"""The long-lived group runtime: one torchrun job (R x S ranks) per Flower client.

    torchrun --nproc-per-node R*S -m flwr_sharded.flower.group --authkey-file KEY --address 127.0.0.1:7100 \
        --method fl-fsdp --replicas 1 --shards 2

Rank 0 serves a local endpoint (`multiprocessing.connection`, authkey challenge/response, JSON payloads; one
instruction per connection) and broadcasts each instruction to every rank over a gloo "control" group; all ranks then
execute it together. Between instructions the other ranks wait in that broadcast, with a long timeout.

The group exits cleanly on the `shutdown` verb, after `--idle-timeout` seconds without an instruction, when the
process given by `--watch-pid` is gone, and, through torchrun, when any of its ranks dies (every rank also exits
when its torchrun launcher disappears, so no rank is orphaned).

Verbs (see `protocol.py`): hello (build or reuse the run's trainer, report layout/fingerprint/rendezvous offer),
train (K periods of A local steps, each followed by a shard sync with the members the server named; a failed sync
restores the shards of the last successful sync), evaluate, status, save, finish, shutdown.
"""

from __future__ import annotations

import argparse
import copy
import gc
import hashlib
import logging
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from flwr_sharded.config import ParallelConfig, config_from_dict, validate_parallel

from flwr_sharded.errors import ConfigError
from flwr_sharded.flower import handoff
from flwr_sharded.flower import protocol as P
from flwr_sharded.flower import rendezvous as rdv
from flwr_sharded.flower.processes import pid_alive
from flwr_sharded.parallel.sync import local_shard

logger = logging.getLogger("flwr_sharded.group")

FOREVER_S = 365 * 24 * 3600.0
REQUEST_TIMEOUT_S = 10.0
"""A connection that does not send its instruction within this time after the handshake is dropped."""


class InstructionError(Exception):
    """An instruction this group refuses, identically on every rank (checked before any collective)."""



# ---------------------------------------------------------------------------------------------------------- helpers

def _watch_parent() -> None:
    """Exit this rank as soon as its parent (the torchrun agent) is gone: no orphaned ranks after a `kill -9`."""
    parent = os.getppid()

    def loop() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=loop, name="parent-watch", daemon=True).start()


class _Endpoint:
    """Rank 0's authenticated local endpoint: accepted + authenticated connections arrive on `incoming`."""

    def __init__(self, address: tuple[str, int], authkey: bytes) -> None:
        self._authkey = authkey
        self.listener = Listener(address, family="AF_INET")  # the challenge runs per connection, below
        self.address = self.listener.address
        self.incoming: queue.Queue[Connection] = queue.Queue()
        self._closed = False
        threading.Thread(target=self._accept_loop, name="endpoint-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn = self.listener.accept()
            except OSError:
                if self._closed:
                    return
                continue
            # One thread per handshake, so a caller that stalls mid-handshake blocks nobody else.
            threading.Thread(target=self._handshake, args=(conn,), name="endpoint-auth", daemon=True).start()

    def _handshake(self, conn: Connection) -> None:
        try:
            deliver_challenge(conn, self._authkey)
            answer_challenge(conn, self._authkey)
        except Exception as exc:  # AuthenticationError, EOFError, OSError
            logger.warning("rejected a connection to the group endpoint: %s", type(exc).__name__)
            conn.close()
            return
        self.incoming.put(conn)

    def close(self) -> None:
        self._closed = True
        try:
            self.listener.close()
        except OSError:
            pass


# ---------------------------------------------------------------------------------------------------------- runtime

class GroupRuntime:
    """State and verbs of one group; every rank holds one and executes every instruction."""

    def __init__(self, args: argparse.Namespace) -> None:
        from flwr_sharded.parallel.topology import init_topology

        self.args = args
        self.pconfig = ParallelConfig(method=args.method, federations=1, replicas=args.replicas, shards=args.shards)
        self.topo = init_topology(self.pconfig, timeout_s=args.collective_timeout)
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        wait_s = args.idle_timeout + 300.0 if args.idle_timeout > 0 else FOREVER_S
        self.ctrl = dist.new_group(backend="gloo", timeout=timedelta(seconds=wait_s))
        self.pids = self._gather(os.getpid())
        self.trainer = None
        self.spec: P.RunSpec | None = None
        self.resumed_round = 0
        self.handoff_dir = self._broadcast(args.handoff_dir or os.path.join(
            tempfile.gettempdir(), f"flwr_sharded-{os.getuid()}", f"handoff-{os.getpid()}") if self.rank == 0 else None)
        self.key = ""
        self.tokens = 0
        self.syncs = 0
        self.snapshot: list[torch.Tensor] = []
        self.started = time.time()
        self.stores: list[dist.TCPStore] = []
        self.offer_ports: list[int] = []
        if self.rank == 0:
            ports = [int(p) for p in args.rendezvous_ports.split(",")] if args.rendezvous_ports else None
            if ports is not None and len(ports) != args.shards:
                raise ConfigError(f"--rendezvous-ports needs {args.shards} ports (one per shard index), got {ports}")
            self.stores = rdv.serve_stores(args.rendezvous_host, args.shards, ports)
            self.offer_ports = [s.port for s in self.stores]

    # ----- collectives on the control group (gloo, CPU) -------------------------------------------------------
    def _gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.ctrl)
        return out

    def _broadcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.ctrl)
        return box[0]

    # ----- the two loops -------------------------------------------------------------------------------------
    def serve(self) -> int:
        """Rank 0: take instructions from the endpoint until shutdown, idle timeout or watched process exit."""
        authkey = P.read_authkey(self.args.authkey_file)
        host, port = P.parse_address(self.args.address)
        endpoint = _Endpoint((host, port), authkey)
        address = P.format_address(*endpoint.address)
        if self.args.address_file:
            tmp = f"{self.args.address_file}.tmp"
            with open(tmp, "w") as fh:
                fh.write(address)
            os.replace(tmp, self.args.address_file)
        logger.info("group %s R=%d x S=%d (%d ranks, pids %s) serving on %s; rendezvous offer %s:%s",
                    self.args.method, self.args.replicas, self.args.shards, self.world, self.pids, address,
                    self.args.rendezvous_host, self.offer_ports)
        last = time.monotonic()
        code = 0
        try:
            while True:
                try:
                    conn = endpoint.incoming.get(timeout=1.0)
                except queue.Empty:
                    reason = self._stop_reason(last)
                    if reason:
                        logger.info("shutting down: %s", reason)
                        self._broadcast(P.instruction(P.SHUTDOWN, {"reason": reason}))
                        return 0
                    continue
                verb, code = self._serve_connection(conn)
                last = time.monotonic()
                if verb == P.SHUTDOWN or code:
                    return code
        finally:
            endpoint.close()
            if not self.args.handoff_dir:  # the default, private one
                shutil.rmtree(self.handoff_dir, ignore_errors=True)

    def _stop_reason(self, last: float) -> str:
        idle = self.args.idle_timeout
        if idle > 0 and time.monotonic() - last > idle:
            return f"no instruction for {idle:.0f} s (--idle-timeout)"
        if self.args.watch_pid and not pid_alive(self.args.watch_pid):
            return f"watched process {self.args.watch_pid} is gone"
        return ""

    def _serve_connection(self, conn: Connection) -> tuple[str, int]:
        with conn:
            try:
                if not conn.poll(REQUEST_TIMEOUT_S):
                    return "", 0
                verb, args = P.check_instruction(P.decode(conn.recv_bytes(P.MAX_MESSAGE_BYTES)))
            except (EOFError, OSError, P.ProtocolError) as exc:
                logger.warning("bad request on the endpoint: %s", exc)
                try:
                    conn.send_bytes(P.encode(P.reply_error(f"bad request: {exc}")))
                except OSError:
                    pass
                return "", 0
            start = time.monotonic()
            logger.info("received %s%s", verb, f" ({args['prefix']})" if "prefix" in args else "")
            self._broadcast(P.instruction(verb, args))
            reply, code = self._execute(verb, args)
            logger.info("%s -> %s in %.2f s", verb, "ok" if reply["ok"] else f"error: {reply['error']}",
                        time.monotonic() - start)
            try:
                conn.send_bytes(P.encode(reply))
            except OSError as exc:
                logger.warning("could not deliver the %s reply (caller gone?): %s", verb, exc)
            return verb, code

    def follow(self) -> int:
        """Ranks > 0: execute whatever rank 0 broadcasts, until shutdown."""
        while True:
            try:
                verb, args = P.check_instruction(self._broadcast(None))
            except Exception as exc:  # rank 0 gone or timed out: torchrun tears the rest down
                logger.error("lost rank 0 (%s); exiting", exc)
                return 1
            _, code = self._execute(verb, args)
            if verb == P.SHUTDOWN or code:
                return code

    def _execute(self, verb: str, args: dict[str, Any]) -> tuple[dict[str, Any], int]:
        handler: Callable[[dict[str, Any]], dict[str, Any]] = getattr(self, f"do_{verb}")
        try:
            return P.reply_ok(handler(args)), 0
        except InstructionError as exc:
            return P.reply_error(str(exc)), 0
        except Exception as exc:  # noqa: BLE001 - anything else leaves the ranks possibly out of step: exit
            logger.error("rank %d failed in %s:\n%s", self.rank, verb, traceback.format_exc())
            return P.reply_error(f"group rank {self.rank} failed in {verb}: {type(exc).__name__}: {exc}; "
                                 f"the group exits"), 1

    # ----- verbs -----------------------------------------------------------------------------------------------
    def _layout(self) -> dict[str, Any]:
        return {"method": self.args.method, "replicas": self.args.replicas, "shards": self.args.shards,
                "world": self.world, "rendezvous_host": self.args.rendezvous_host,
                "rendezvous_ports": self.offer_ports, "pids": self.pids, "handoff_dir": self.handoff_dir}

    def do_status(self, args: dict[str, Any]) -> dict[str, Any]:
        t = self.trainer
        return {**self._layout(), "run_key": self.key, "steps": t.step_count if t else 0,
                "checksums": self._checksums() if t else [], "syncs": self.syncs,
                "uptime_s": time.time() - self.started}

    def do_hello(self, args: dict[str, Any]) -> dict[str, Any]:
        from flwr_sharded.train import preflight

        layout = P.GroupLayout(self.args.method, self.args.replicas, self.args.shards, self.world)
        out = {**self._layout(), "compatible": False, "error": "", "fingerprint": "", "tokens": 0, "steps": 0}
        try:
            spec = P.RunSpec.from_json(args["spec"]).for_group(int(args["partition_id"]), str(args.get("facility", "")))
            mismatch = layout.mismatch(spec)
            if mismatch:
                raise ConfigError(mismatch)
            spec.validate()
            if self.args.data_dir and not args.get("data_dir"):
                spec.data_dir = self.args.data_dir
            if args.get("data_dir"):
                spec.data_dir = str(args["data_dir"])
            cfg = config_from_dict(spec.train_config_dict())
            cfg.timeout_s = self.args.collective_timeout
            partition = (int(args["partition_id"]), int(args["num_partitions"]))
            if not 0 <= partition[0] < partition[1]:
                raise ConfigError(f"partition-id {partition[0]} outside 0..{partition[1] - 1}")
            preflight(cfg, self.world)
            if spec.checkpoint_dir:  # series <dir>/group-<partition id>: it follows the data, whichever node trains
                from flwr_sharded.training.checkpoint import check_resumable, group_dir, latest_checkpoint

                cfg.checkpoint_dir = spec.checkpoint_dir
                if spec.resume:
                    check_resumable(cfg, spec.checkpoint_dir, fed_index=partition[0])
                elif args.get("rejoin") and latest_checkpoint(group_dir(spec.checkpoint_dir, partition[0])):
                    spec.resume = True  # a restarted group rejoining: its own data position and optimizer state
        except (ConfigError, KeyError, ValueError, TypeError) as exc:
            out["error"] = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
        errors = [e for e in self._gather(out["error"]) if e]  # every rank must agree before building anything
        if not errors and spec.aggregation == "server":  # (collective: only once every rank got this far)
            errors = [e for e in self._gather(self._check_handoff_dir()) if e]
        if errors:
            out["error"] = errors[0]
            return out
        key = f"{args.get('run_key', '')}|{partition}|{spec.to_json()}"
        if self.trainer is None or key != self.key:
            self._drop_trainer()
            from flwr_sharded.training.trainer import Trainer

            start = time.perf_counter()
            self.trainer = Trainer(cfg, self.topo, static_sync=False, partition=partition)
            self.key, self.tokens, self.syncs, self.spec = key, 0, 0, spec
            self.resumed_round = 0
            if spec.resume:
                meta = self.trainer.resume()
                self.resumed_round = int(meta.get("round", 0))
                logger.info("resumed from %s: round %d, step %d", cfg.checkpoint_dir, self.resumed_round,
                            self.trainer.step_count)
            self._take_snapshot()
            logger.info("built the trainer for partition %d/%d in %.1f s", *partition, time.perf_counter() - start)
        fingerprints = self._gather(self.trainer.shard_sync.fingerprint())
        out.update(compatible=True, fingerprint=hashlib.sha256("|".join(fingerprints).encode()).hexdigest()[:32],
                   tokens=self.tokens, steps=self.trainer.step_count, resumed_round=self.resumed_round,
                   partition_id=partition[0],
                   num_partitions=partition[1])
        return out

    def _need_trainer(self):
        if self.trainer is None:
            raise InstructionError("this group has no run set up: send hello first")
        return self.trainer

    def do_train(self, args: dict[str, Any]) -> dict[str, Any]:
        t = self._need_trainer()
        try:
            periods, steps = int(args["syncs"]), int(args["steps"])
            members = [str(m) for m in args["members"]]
            me = int(args["member_index"])
            host, ports = str(args["rendezvous_host"]), [int(p) for p in args["rendezvous_ports"]]
            prefix = str(args["prefix"])
            rdv_timeout, sync_timeout = float(args["rendezvous_timeout"]), float(args["sync_timeout"])
            evaluate = bool(args.get("evaluate", True))
            export = bool(args.get("export", False))
            checkpoint, server_round = bool(args.get("checkpoint", False)), int(args.get("server_round", 0))
            catch_up = bool(args.get("catch_up", False))
        except (KeyError, ValueError, TypeError) as exc:
            raise InstructionError(f"malformed train instruction: {exc!r}") from None
        server_path = self.spec is not None and self.spec.aggregation == "server"
        if export and not server_path:
            raise InstructionError("export asks for the server path, but this run's aggregation is decentralized")
        if periods < 1 or steps < 1:
            raise InstructionError(f"train needs syncs >= 1 and steps >= 1, got {periods} and {steps}")
        if not 0 <= me < len(members) or len(ports) != self.args.shards:
            raise InstructionError(f"member index {me} of {len(members)} members, {len(ports)} rendezvous ports for "
                                   f"{self.args.shards} shard indices")
        spec_cfg = t.cfg
        cuda = t.device.type == "cuda"
        losses: list[torch.Tensor] = []
        train_s = sync_s = rendezvous_s = eval_s = 0.0
        syncs_done, failure, weight = 0, "", 0.0
        checksums: list[float] = []
        caught_up: list[float] = []
        groups: list[rdv.FederationGroup] = []
        try:
            if catch_up:  # a member (re)joined: everyone adopts member 0's state before training
                start = time.perf_counter()
                ok, failure, rendezvous_s = self._catch_up(t, groups, members, me, host, ports, prefix, rdv_timeout,
                                                           sync_timeout)
                sync_s += time.perf_counter() - start
                if not ok:
                    logger.warning("catch-up of round %s failed: %s", prefix, failure)
                    periods = 0
                else:
                    caught_up = self._checksums()
            for k in range(periods):
                start = time.perf_counter()
                for _ in range(steps):
                    losses.append(t.step())
                if cuda:
                    torch.cuda.synchronize()
                train_s += time.perf_counter() - start
                start = time.perf_counter()
                ok, failure, rdv_s, period_weight = self._sync(t, k, groups, members, me, host, ports, prefix,
                                                               rdv_timeout, sync_timeout, apply_rule=not server_path)
                rendezvous_s += rdv_s
                if not ok:
                    self._restore_snapshot()
                    t.tokens_since_sync = 0
                    sync_s += time.perf_counter() - start
                    logger.warning("sync %d of round %s failed, restored the last synced shards: %s", k + 1, prefix,
                                   failure)
                    break
                self._take_snapshot()
                sync_s += time.perf_counter() - start
                syncs_done += 1
                weight += period_weight
                self.syncs += 1
                checksums.extend(self._checksums())
                if self.args.debug_exit_after_syncs and self.syncs >= self.args.debug_exit_after_syncs:
                    logger.error("--debug-exit-after-syncs %d reached: exiting abruptly", self.syncs)
                    os._exit(17)  # fault injection for tests: a crash between two syncs
        finally:
            for g in groups:
                g.destroy()
        n_steps = len(losses)
        group_losses: list[float] = []
        if losses:
            stacked = torch.stack(losses).to(torch.float64)
            dist.all_reduce(stacked)
            group_losses = (stacked / self.world).tolist()
        tokens = n_steps * spec_cfg.batch_size * spec_cfg.grad_accum * spec_cfg.data.seq_len * self.world
        self.tokens += tokens
        result: dict[str, Any] = {
            "steps": n_steps, "losses": group_losses, "tokens": tokens, "total_tokens": self.tokens,
            "train_s": train_s, "sync_s": sync_s, "rendezvous_s": rendezvous_s, "syncs": syncs_done,
            "sync_failed": bool(failure), "sync_error": failure, "checksums": checksums,
            "step": t.step_count, "lr": t.scheduler.get_last_lr()[0], "members": len(members),
            "catch_up_checksums": caught_up}
        if checkpoint and not failure:
            result["checkpoint_s"] = self._checkpoint(server_round)
        if export and not failure:
            start = time.perf_counter()
            result.update(export_files=self._export(prefix), facility_tokens=weight,
                          export_s=time.perf_counter() - start)
        if evaluate:
            start = time.perf_counter()
            result.update(t.evaluate())
            eval_s = time.perf_counter() - start
        result["eval_s"] = eval_s
        return result

    def _sync(self, t, k: int, groups: list[rdv.FederationGroup], members: list[str], me: int, host: str,
              ports: list[int], prefix: str, rdv_timeout: float, sync_timeout: float,
              apply_rule: bool = True) -> tuple[bool, str, float, float]:
        """One shard sync with the round's members; returns (every rank succeeded, error, rendezvous s, weight).

        `weight` is the members' total weight (tokens) of this period, as replica 0 knows it; `apply_rule=False`
        stops at the weighted mean (the facility level of the server path).

        Replica 0 of each shard index joins the round's federation group (on the round's first sync) and runs the
        trainer's ShardSync over it; with R > 1 the result is then broadcast to the other replicas, but only once
        every rank of the group knows that all shard indices succeeded. A group alone in a round still runs the
        sync (over a group of one): a no-op for FedAvg, the outer step for outer optimizers.
        """
        rdv_s, error, weight = 0.0, "", 0.0
        sync = t.shard_sync
        saved_outer = None
        if self.topo.replica_index == 0:
            try:
                if k == 0 and not groups:  # first sync of the round: form the federation group of this shard index
                    rdv_s = self._join(t, groups, members, me, host, ports, prefix, rdv_timeout, sync_timeout)
                if not groups:
                    raise rdv.RendezvousError("no federation group (the round's first sync failed)")
                if sync.keeps_global:  # global shards and outer state, restored if any shard index fails
                    saved_outer = copy.deepcopy(sync.outer_state_dict())
                weight = t.sync(apply_rule=apply_rule).total_weight  # token-weighted FedAvg (or outer rule)
            except Exception as exc:  # noqa: BLE001 - rendezvous, timeout, peer gone, misaligned shards
                error = f"shard {self.topo.shard_index}: {rdv.first_line(exc)}"
        else:  # a replica > 0 receives the result by broadcast below
            t.tokens_since_sync = 0
            if t.cfg.parallel.reset_optimizer_state:
                t.optimizer.state.clear()
        errors = [e for e in self._gather(error) if e]
        if errors:
            if saved_outer is not None:
                sync.load_outer_state_dict(saved_outer)
            return False, "; ".join(sorted(set(errors))), rdv_s, weight
        if self.topo.rep_group is not None:
            sync.broadcast(self.topo.rep_group)
        return True, "", rdv_s, weight

    # ----- server path ----------------------------------------------------------------------------------------
    def _check_handoff_dir(self) -> str:
        """'' if every rank can write and see the hand-off directory, else why not (checked at hello)."""
        probe = os.path.join(self.handoff_dir, f".probe-{self.pids[0]}")
        error = ""
        if self.rank == 0:
            try:
                os.makedirs(self.handoff_dir, mode=0o700, exist_ok=True)
                with open(probe, "w") as fh:
                    fh.write("ok")
            except OSError as exc:
                error = f"cannot write the hand-off directory {self.handoff_dir}: {exc}"
        error = self._broadcast(error)
        if not error and not os.path.isfile(probe):
            error = (f"rank {self.rank} does not see the hand-off directory {self.handoff_dir}; the server path "
                     f"needs it on a filesystem shared by the group's nodes (--handoff-dir)")
        return error

    def _export(self, prefix: str) -> list[str]:
        """Replica-0 ranks write their own pieces to a hand-off file each; returns every file (rank 0's view).

        Shards holding NaN or Inf are not exported (InstructionError on every rank), so the server refuses the
        whole group before pulling any of it.
        """
        from flwr_sharded.parallel.shard_transport import encode_pieces, shard_pieces

        path, error = "", ""
        if self.topo.replica_index == 0:
            pieces = shard_pieces(self.trainer.model.named_parameters())
            bad = [p.key for p in pieces if p.data.is_floating_point() and not bool(torch.isfinite(p.data).all())]
            if bad:
                error = f"rank {self.rank}: {len(bad)} shard piece(s) hold NaN or Inf, e.g. {bad[:3]}"
            else:
                safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in prefix)
                path = os.path.join(self.handoff_dir, safe, f"s{self.topo.shard_index}.safetensors")
                handoff.write_file(path, *encode_pieces(pieces))
        outcome = self._gather((path, error))
        errors = [e for _, e in outcome if e]
        if errors:
            if path:
                os.unlink(path)
            raise InstructionError("not exported: " + errors[0])
        return [p for p, _ in outcome if p]

    def do_apply(self, args: dict[str, Any]) -> dict[str, Any]:
        """Adopt the server's mean: each replica-0 rank assembles its own rows from the chunk files, all ranks
        check, then all write."""
        from flwr_sharded.parallel.shard_transport import check_pieces, decode_pieces, own_pieces

        t = self._need_trainer()
        paths = [str(p) for p in args.get("paths", [])]
        error, pairs = "", []
        if self.topo.replica_index == 0:
            try:
                named = list(t.model.named_parameters())
                arrays, meta = handoff.assemble(paths, own_pieces(named))
                pairs = check_pieces(named, decode_pieces(arrays, meta))
            except Exception as exc:  # noqa: BLE001 - missing file or keys, bad shapes, NaN: refuse, change nothing
                error = f"rank {self.rank}: {type(exc).__name__}: {exc}"
        errors = [e for e in self._gather(error) if e]
        if errors:
            raise InstructionError("the server's shards do not fit this group, nothing changed: " + errors[0])
        start = time.perf_counter()
        with torch.no_grad():
            for piece, local in pairs:
                local.copy_(piece.data)
        if self.topo.replica_index == 0:
            t.shard_sync.step_rule()  # the outer optimizer, on this rank's own shards and state
        if self.topo.rep_group is not None:
            t.shard_sync.broadcast(self.topo.rep_group)
        t.tokens_since_sync = 0
        if t.cfg.parallel.reset_optimizer_state:
            t.optimizer.state.clear()
        self._take_snapshot()
        result: dict[str, Any] = {"apply_s": time.perf_counter() - start, "checksums": self._checksums(),
                                  "step": t.step_count}
        if args.get("checkpoint", False):
            result["checkpoint_s"] = self._checkpoint(int(args.get("server_round", 0)))
        if args.get("evaluate", False):
            start = time.perf_counter()
            result.update(t.evaluate())
            result["eval_s"] = time.perf_counter() - start
        return result

    def _checkpoint(self, server_round: int) -> float:
        """Checkpoint the group (collective) as the state at the end of `server_round`; returns the seconds."""
        t = self._need_trainer()
        if t.checkpointer is None:
            raise InstructionError("checkpoint asked for, but the run config has no checkpoint-dir")
        start = time.perf_counter()
        t.save_checkpoint({"round": server_round})
        return time.perf_counter() - start

    def _join(self, t, groups: list[rdv.FederationGroup], members: list[str], me: int, host: str, ports: list[int],
              prefix: str, rdv_timeout: float, sync_timeout: float) -> float:
        """Replica 0: form the round's federation group of this rank's shard index; returns the seconds it took."""
        start = time.perf_counter()
        s = self.topo.shard_index
        backend = rdv.backend_for_device(t.device, self.args.sync_backend)
        group = rdv.join(host=host, port=ports[s], prefix=f"{prefix}/s{s}", rank=me, size=len(members),
                         rendezvous_timeout=rdv_timeout, sync_timeout=sync_timeout, backend=backend)
        groups.append(group)
        t.shard_sync.rebind(group.pg, None)
        return time.perf_counter() - start

    def _catch_up(self, t, groups: list[rdv.FederationGroup], members: list[str], me: int, host: str,
                  ports: list[int], prefix: str, rdv_timeout: float, sync_timeout: float) -> tuple[bool, str, float]:
        """Every member adopts member 0's shards, outer state and schedule position (a group (re)joined the run).

        Replica 0 of each shard index joins the round's federation group and receives member 0's shards and outer
        state by broadcast; the step count travels on shard index 0; FL+HSDP replicas then copy replica 0.
        """
        rdv_s, error, step = 0.0, "", t.step_count
        saved_outer = None
        if self.topo.replica_index == 0:
            try:
                rdv_s = self._join(t, groups, members, me, host, ports, prefix, rdv_timeout, sync_timeout)
                pg = groups[0].pg
                saved_outer = copy.deepcopy(t.shard_sync.outer_state_dict())  # restored if the catch-up fails
                t.shard_sync.broadcast(pg)
                t.shard_sync.broadcast_outer_state(pg)
                box = torch.tensor([t.step_count], dtype=torch.int64, device=t.device)
                dist.broadcast(box, group=pg, group_src=0)
                step = int(box.item())
            except Exception as exc:  # noqa: BLE001 - rendezvous, timeout, peer gone
                error = f"shard {self.topo.shard_index}: {rdv.first_line(exc)}"
        errors = [e for e in self._gather(error) if e]
        if errors:
            self._restore_snapshot()
            if saved_outer is not None:
                t.shard_sync.load_outer_state_dict(saved_outer)
            return False, "; ".join(sorted(set(errors))), rdv_s
        if self.topo.rep_group is not None:
            t.shard_sync.broadcast(self.topo.rep_group)
        step = self._broadcast(step)  # rank 0 (replica 0, shard 0) knows member 0's step count
        if step != t.step_count:
            logger.info("caught up: step %d -> %d (member 0's)", t.step_count, step)
            t.step_count = step
            t.scheduler.last_epoch = step - 1
            t.scheduler.step()  # the learning rate of step `step`
        self._take_snapshot()
        return True, "", rdv_s

    def _take_snapshot(self) -> None:
        """Copy this rank's local shards to CPU: the state a failed sync rolls back to."""
        params = list(self.trainer.model.parameters())
        if len(self.snapshot) != len(params):
            self.snapshot = [torch.empty(local_shard(p).shape, dtype=local_shard(p).dtype, device="cpu",
                                         pin_memory=torch.cuda.is_available()) for p in params]
        with torch.no_grad():
            for p, snap in zip(params, self.snapshot):
                snap.copy_(local_shard(p))

    def _restore_snapshot(self) -> None:
        with torch.no_grad():
            for p, snap in zip(self.trainer.model.parameters(), self.snapshot):
                local_shard(p).copy_(snap)

    def _checksums(self) -> list[float]:
        from flwr_sharded.training.trainer import local_shards_checksum

        return [float(c) for c in self._gather(local_shards_checksum(self.trainer.model))]

    def do_evaluate(self, args: dict[str, Any]) -> dict[str, Any]:
        t = self._need_trainer()
        start = time.perf_counter()
        out = t.evaluate()
        return {**out, "eval_s": time.perf_counter() - start, "step": t.step_count}

    def do_save(self, args: dict[str, Any]) -> dict[str, Any]:
        t = self._need_trainer()
        directory = args.get("directory")
        if not directory:
            raise InstructionError("save needs a directory")
        t.save_pretrained(str(directory))
        return {"directory": str(directory)}

    def do_finish(self, args: dict[str, Any]) -> dict[str, Any]:
        saved = ""
        if args.get("save_dir") and self.trainer is not None:
            saved = self.do_save({"directory": args["save_dir"]})["directory"]
        steps = self.trainer.step_count if self.trainer is not None else 0
        self._drop_trainer()
        return {"steps": steps, "saved": saved}

    def do_shutdown(self, args: dict[str, Any]) -> dict[str, Any]:
        return {"pids": self.pids, "reason": args.get("reason", "requested")}

    def _drop_trainer(self) -> None:
        if self.trainer is None:
            return
        self.trainer, self.key, self.snapshot = None, "", []
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# -------------------------------------------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flwr_sharded.flower.group", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--authkey-file", required=True, help="file holding the endpoint's shared secret (mode 600)")
    parser.add_argument("--address", default="127.0.0.1:0", help="host:port of the endpoint (port 0: any free one)")
    parser.add_argument("--address-file", help="write the endpoint's actual host:port here once it listens")
    parser.add_argument("--method", default="fl-fsdp", choices=["fl-fsdp", "fl-hsdp"])
    parser.add_argument("--replicas", type=int, default=1, help="R (fl-hsdp: > 1)")
    parser.add_argument("--shards", type=int, default=None, help="S (default: all ranks / R)")
    parser.add_argument("--rendezvous-host", default="127.0.0.1",
                        help="address the other groups reach this group's rendezvous stores at")
    parser.add_argument("--rendezvous-ports", default="",
                        help="comma-separated store port per shard index (default: free ports)")
    parser.add_argument("--data-dir", default="", help="prepared data directory (overrides the run config's)")
    parser.add_argument("--handoff-dir", default="",
                        help="where ranks and the ClientApp exchange shard files on the server path; must be shared "
                             "by the group's nodes (default: a private directory under the system's temp dir)")
    parser.add_argument("--idle-timeout", type=float, default=600.0,
                        help="exit after this many seconds without an instruction (0: never)")
    parser.add_argument("--watch-pid", type=int, default=0, help="exit when this process is gone")
    parser.add_argument("--collective-timeout", type=float, default=1800.0,
                        help="timeout of the group's own collectives (FSDP, evaluation) in seconds")
    parser.add_argument("--debug-exit-after-syncs", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--sync-backend", default="auto", choices=["auto", "gloo", "nccl"],
                        help="backend of the cross-group shard sync (auto: NCCL for CUDA, else gloo)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s [group rank {rank}] %(levelname)s %(message)s")
    if "RANK" in os.environ:
        _watch_parent()
    if args.shards is None:
        args.shards = max(1, world // max(1, args.replicas))
    try:
        validate_parallel(ParallelConfig(method=args.method, federations=1, replicas=args.replicas,
                                         shards=args.shards), world)
        P.read_authkey(args.authkey_file)
        P.parse_address(args.address)
    except ConfigError as exc:
        if rank == 0:
            print(f"flwr_sharded.flower.group: error: {exc}", file=sys.stderr)
        return 2
    runtime = GroupRuntime(args)
    code = runtime.serve() if runtime.rank == 0 else runtime.follow()
    if code == 0:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - leaving anyway
            pass
    return code


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: background store/accept threads must not delay the exit
