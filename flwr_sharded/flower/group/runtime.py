"""The long-lived group runtime: one torchrun job (R x S ranks) per Flower client.

    torchrun --nproc-per-node R*S -m flwr_sharded.flower.group --authkey-file KEY --address 127.0.0.1:7100 \\
        --method fl-fsdp --replicas 1 --shards 2

Every rank holds a `GroupRuntime`: the group's state and its verbs. Rank 0 serves the local endpoint
(`flwr_sharded.flower.endpoint`) and broadcasts each instruction over a gloo "control" group, where the other ranks
wait between instructions (long timeout); all ranks execute it together (`flwr_sharded.flower.group.control`). The
group exits on `shutdown`, after `--idle-timeout` without an instruction, when `--watch-pid` is gone, and (through
torchrun, every rank also watching its launcher) when any rank dies: no rank is orphaned.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import logging
import os
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from flwr_sharded import host_memory, schema
from flwr_sharded.config import ParallelConfig
from flwr_sharded.validation import validate_parallel
from flwr_sharded.errors import ConfigError
from flwr_sharded.flower import endpoint, messages, rendezvous
from flwr_sharded.flower.group import channels, control, options, server_path_shards
from flwr_sharded.flower.group.contract import InstructionError
from flwr_sharded.flower.group.round import GroupRound
from flwr_sharded.flower.group.round_context import RoundContext
from flwr_sharded.flower.node_policy import NodePolicy
from flwr_sharded.flower.launch import exit_with_parent, fresh_private_dir

logger = logging.getLogger("flwr_sharded.group")

FOREVER_S = 365 * 24 * 3600.0


class GroupRuntime:
    """State and verbs of one group; every rank holds one and executes every instruction. A round's steps see it as
    a `RoundRuntime` (`flwr_sharded.flower.group.contract`)."""

    def __init__(self, args: options.GroupOptions) -> None:
        from flwr_sharded.parallel.topology import init_topology

        self.args = args
        self.pconfig = ParallelConfig(method=args.method, federations=1, replicas=args.replicas, shards=args.shards)
        self.topo = init_topology(self.pconfig, timeout_s=args.collective_timeout, recoverable=True)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        wait_s = args.idle_timeout + 300.0 if args.idle_timeout > 0 else FOREVER_S
        self.ctrl = dist.new_group(backend="gloo", timeout=timedelta(seconds=wait_s))
        self.pids = self.gather(os.getpid())
        self.trainer = None
        self.loop = None  # the trainer's sync loop (`flwr_sharded.training.sync_loop.SyncLoop`), built at hello
        self.run = None  # the FlowerRun of the current trainer (this group's S)
        self.policy = NodePolicy()  # what the last hello's node config allowed (nothing until a hello)
        self.resumed_round = 0
        # the hand-off directory is a fresh private one (mkdtemp) under --handoff-dir, never a path someone made
        self.handoff_dir = self.broadcast(fresh_private_dir("flwr_sharded-handoff-", args.handoff_dir or None)
                                          if self.rank == 0 else None)
        self.key = ""
        self.run_idle_s = 0.0
        """The run's group-idle-timeout (from its hello): drop the run after that long without an instruction."""
        self.tokens, self.syncs = 0, 0
        self.started = time.time()
        self.store: rendezvous.StoreServer | None = None
        """Rank 0: the rendezvous store of the rounds this group hosts (member 0)."""
        self.offer_ports: list[int] = []
        if self.rank == 0:
            ports = [int(p) for p in args.rendezvous_ports.split(",")] if args.rendezvous_ports else None
            if ports is not None and len(ports) != args.shards:
                raise ConfigError(f"--rendezvous-ports needs {args.shards} ports (one per shard index), got {ports}")
            self.store = rendezvous.serve_stores(args.rendezvous_host, args.shards, ports)
            self.offer_ports = self.store.ports

    # ----- collectives on the control group (gloo, CPU) -------------------------------------------------------
    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.ctrl)
        return out

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.ctrl)
        return box[0]

    def execute(self, verb: str, args: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """Run one instruction's verb on this rank: (reply, exit code; 1 when the ranks may be out of step)."""
        handler: Callable[[dict[str, Any]], dict[str, Any]] = getattr(self, f"do_{verb}")
        try:
            return messages.reply_ok(handler(args)), 0
        except (InstructionError, messages.ArgumentError) as exc:
            return messages.reply_error(str(exc)), 0
        except Exception as exc:  # noqa: BLE001 - anything else leaves the ranks possibly out of step: exit
            logger.error("rank %d failed in %s:\n%s", self.rank, verb, traceback.format_exc())
            return messages.reply_error(f"group rank {self.rank} failed in {verb}: {type(exc).__name__}: {exc}; "
                                 f"the group exits"), 1

    # ----- verbs -----------------------------------------------------------------------------------------------
    def _layout(self) -> dict[str, Any]:
        return {"method": self.args.method, "replicas": self.args.replicas, "shards": self.args.shards,
                "world": self.world, "rendezvous_host": self.args.rendezvous_host,
                "rendezvous_ports": self.offer_ports, "pids": self.pids, "handoff_dir": self.handoff_dir}

    def do_status(self, args: dict[str, Any]) -> dict[str, Any]:
        """The group's layout and state; `checksums=False` skips the shard and optimizer checksums, a read of every
        rank's whole state (the server path's apply asks for the layout once per chunk)."""
        t = self.trainer
        sums = t is not None and bool(args.get("checksums", True))
        return {**self._layout(), "run_key": self.key, "steps": t.step_count if t else 0,
                "checksums": self.checksums() if sums else [], "syncs": self.syncs,
                "optimizer_checksums": self.checksums(optimizer=True) if sums else [],
                "lr": t.scheduler.get_last_lr()[0] if t else 0.0,
                "uptime_s": time.time() - self.started}

    def do_hello(self, args: dict[str, Any]) -> dict[str, Any]:
        from flwr_sharded.flower.run_config import FlowerRun

        layout = messages.GroupLayout(self.args.method, self.args.replicas, self.args.shards, self.world)
        out = {**self._layout(), "compatible": False, "error": "", "fingerprint": "", "tokens": 0, "steps": 0}
        run = cfg = None
        try:
            partition = (int(args["partition_id"]), int(args["num_partitions"]))
            run = FlowerRun.from_json(str(args["run"])).for_group(partition[0], str(args.get("facility", "")),
                                                                  own_shards=self.args.shards)
            mismatch = layout.mismatch(run)
            if mismatch:
                raise ConfigError(mismatch)
            policy = NodePolicy.from_args(args.get("policy"))  # before anything imports a rule or touches a path
            policy.check_run(run, save_dir=str(args.get("save_dir", "")))
            run.validate()
            if args.get("data_dir") or self.args.data_dir:  # the node config's, else the group's own
                run.train.data.data_dir = str(args.get("data_dir") or self.args.data_dir)
            if not 0 <= partition[0] < partition[1]:
                raise ConfigError(f"partition-id {partition[0]} outside 0..{partition[1] - 1}")
            cfg = run.group_config()
            cfg.timeout_s = self.args.collective_timeout
            self._check_group(cfg, partition[0], rejoin=bool(args.get("rejoin")))
        except (ConfigError, KeyError, ValueError, TypeError) as exc:
            out["error"] = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
        errors = [e for e in self.gather(out["error"]) if e]  # every rank must agree before building anything
        if not errors and run.federation.aggregation == "server":  # (collective: once every rank got this far)
            errors = [e for e in self.gather(server_path_shards.check_handoff_dir(self)) if e]
        if errors:
            out["error"] = errors[0]
            return out
        key = f"{args.get('run_key', '')}|{partition}|{run.to_json()}|{cfg.checkpoint.resume}"
        self.policy = policy
        if self.trainer is None or key != self.key:
            self._build(cfg, partition, key)
            self.run = run
        self.run_idle_s = max(0.0, float(args.get("idle_timeout", 0.0) or 0.0))
        fingerprints = self.gather(self.loop.fingerprint())
        out.update(compatible=True, fingerprint=hashlib.sha256("|".join(fingerprints).encode()).hexdigest()[:32],
                   tokens=self.tokens, steps=self.trainer.step_count, resumed_round=self.resumed_round,
                   partition_id=partition[0], num_partitions=partition[1], **channels.model_facts(self.trainer.model))
        return out

    def _check_group(self, cfg: Any, partition_id: int, *, rejoin: bool) -> None:
        """The checks of the engine (`preflight`) and of this group's checkpoint series, their messages in the run
        config's spelling; a restarted group rejoining resumes from its own checkpoint."""
        from flwr_sharded.config import respelled
        from flwr_sharded.flower.run_config import RUN_CONFIG
        from flwr_sharded.training.preflight import preflight

        try:
            preflight(cfg, self.world)
            if cfg.checkpoint.dir:  # series <dir>/group-<partition id>: it follows the data, whichever node trains
                from flwr_sharded.training.checkpoint_resume import check_resumable
                from flwr_sharded.training.checkpoint_series import group_dir, latest_checkpoint

                if cfg.checkpoint.resume:
                    check_resumable(cfg, cfg.checkpoint.dir, groups=[partition_id])
                elif rejoin and latest_checkpoint(group_dir(cfg.checkpoint.dir, partition_id)):
                    cfg.checkpoint.resume = True  # a restarted group rejoining: its own data position and state
        except ConfigError as exc:
            raise respelled(exc, RUN_CONFIG) from None

    def _build(self, cfg: Any, partition: tuple[int, int], key: str) -> None:
        from flwr_sharded.training.sync_loop import SyncLoop
        from flwr_sharded.training.trainer import Trainer

        self._drop_trainer()
        start = time.perf_counter()
        self.trainer = Trainer(cfg, self.topo, partition=partition)
        self.loop = SyncLoop(self.trainer)
        host_memory.after_load()  # the load's transient buffers
        self.key, self.tokens, self.syncs, self.resumed_round = key, 0, 0, 0
        if cfg.checkpoint.resume:
            meta = self.loop.resume()
            self.resumed_round = int(meta.get("round", 0))
            logger.info("resumed from %s: round %d, step %d", cfg.checkpoint.dir, self.resumed_round,
                        self.trainer.step_count)
        self.loop.keep_rollback_point()
        logger.info("built the trainer for partition %d/%d in %.1f s", *partition, time.perf_counter() - start)

    def _need_trainer(self):
        if self.trainer is None:
            raise InstructionError("this group has no run set up: send hello first")
        return self.trainer

    def do_train(self, args: dict[str, Any]) -> dict[str, Any]:
        """One round (`GroupRound`) of its `RoundContext`, built once (layouts checked, sync plan, seat, steps, lr,
        mu); on the server path, the facility's first member then exports its shards."""
        t = self._need_trainer()
        a = messages.TrainArgs.from_config(args)
        on_server_path = self.run.federation.aggregation == "server"
        if a.export and not on_server_path:
            raise InstructionError("export asks for the server path, but this run's aggregation is decentralized")
        ctx = RoundContext.of(a, self.run, channels.model_shapes(t.model), replicas=self.args.replicas,
                              shards=self.args.shards, shard=self.topo.shard_index)
        channels.prepare(self, ctx)  # the sync loop configured for the round
        with self._hosting(ctx):
            result = GroupRound(self, ctx).run(apply_rule=not on_server_path)
        failed = result["sync_failed"]
        if a.checkpoint and not failed:
            result.update(self._checkpoint(a.server_round))
        if a.export and not failed:
            start = time.perf_counter()
            files = server_path_shards.export(self, a.prefix)
            result.update(export_files=files, export_s=time.perf_counter() - start)
        eval_s = 0.0
        if a.evaluate:
            start = time.perf_counter()
            result.update(t.evaluate())
            eval_s = time.perf_counter() - start
        result["eval_s"] = eval_s
        return result

    @contextmanager
    def _hosting(self, ctx: RoundContext) -> Iterator[None]:
        """Rank 0 of the round's member 0: the round's scopes open on this group's store while the round runs (the
        members prove the round's secret there); its keys are dropped when it ends."""
        hosting = self.store is not None and ctx.member_index == 0
        if hosting:
            self.store.open_scopes(list(ctx.scopes), ctx.args.secret)
        try:
            yield
        finally:
            if hosting:
                self.store.close_scopes(list(ctx.scopes))

    def do_apply(self, args: dict[str, Any]) -> dict[str, Any]:
        """Server path: adopt the server's mean from the chunk files, then checkpoint and evaluate if asked."""
        t = self._need_trainer()
        result: dict[str, Any] = {"apply_s": server_path_shards.apply(self, [str(p) for p in args.get("paths", [])])}
        result.update(checksums=self.checksums(), step=t.step_count)
        if args.get("checkpoint", False):
            result.update(self._checkpoint(int(args.get("server_round", 0))))
        if args.get("evaluate", False):
            start = time.perf_counter()
            result.update(t.evaluate())
            result["eval_s"] = time.perf_counter() - start
        return result

    def _checkpoint(self, server_round: int) -> dict[str, Any]:
        """Checkpoint the group (collective) as of `server_round`'s end: {"checkpoint_s"}, plus {"checkpoint_error"}
        if the write failed (a full disk: the previous one stays, the group trains on; the ServerApp logs it)."""
        t = self._need_trainer()
        if t.checkpointer is None:
            raise InstructionError("checkpoint asked for, but the run config has no checkpoint-dir")
        start = time.perf_counter()
        error = t.checkpoint_or_report(lambda: self.loop.save_checkpoint({"round": server_round}))
        out: dict[str, Any] = {"checkpoint_s": time.perf_counter() - start}
        if error:
            out["checkpoint_error"] = error
        return out

    def checksums(self, *, optimizer: bool = False) -> list[float]:
        """Every rank's checksum of its local shards (or of its optimizer state)."""
        from flwr_sharded.training.trainer import local_shards_checksum, optimizer_checksum

        t = self.trainer
        mine = optimizer_checksum(t.optimizer) if optimizer else local_shards_checksum(t.model)
        return [float(c) for c in self.gather(mine)]

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
        refused = self.policy.save_dir_refusal(str(directory))
        if refused:
            raise InstructionError(refused)
        t.save_pretrained(str(directory))
        return {"directory": str(directory)}

    def do_finish(self, args: dict[str, Any]) -> dict[str, Any]:
        saved = ""
        steps = self.trainer.step_count if self.trainer is not None else 0
        try:
            if args.get("save_dir") and self.trainer is not None:
                saved = self.do_save({"directory": args["save_dir"]})["directory"]  # refused unless allowed
        finally:
            self._drop_trainer()
        return {"steps": steps, "saved": saved}

    def do_collect(self, args: dict[str, Any]) -> dict[str, Any]:
        raise InstructionError("collect is answered by the endpoint, not the group's main loop")

    def do_shutdown(self, args: dict[str, Any]) -> dict[str, Any]:
        return {"pids": self.pids, "reason": args.get("reason", "requested")}

    def _drop_trainer(self) -> None:
        if self.trainer is None:
            return
        self.trainer, self.loop, self.run, self.key = None, None, None, ""
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# -------------------------------------------------------------------------------------------------------------- CLI

def runtime_parser() -> argparse.ArgumentParser:
    """The runtime's command line, its --help this module's doc; the flags, from `GroupOptions`
    (`flwr_sharded.flower.group.options`)."""
    return options.group_parser(__doc__)


def main(argv: Sequence[str] | None = None) -> int:
    parsed = runtime_parser().parse_args(argv)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s [group rank {rank}] %(levelname)s %(message)s")
    if "RANK" in os.environ:
        exit_with_parent()
    try:
        args = schema.apply_arguments(options.GroupOptions(), parsed)
        if args.shards is None:
            args.shards = max(1, world // max(1, args.replicas))
        validate_parallel(ParallelConfig(method=args.method, federations=1, replicas=args.replicas,
                                         shards=args.shards), world)
        endpoint.read_authkey(args.authkey_file)
        endpoint.loopback_address(args.address, "--address")
    except ConfigError as exc:
        if rank == 0:
            print(f"flwr_sharded.flower.group: error: {exc}", file=sys.stderr)
        return 2
    runtime = GroupRuntime(args)
    code = control.serve(runtime) if runtime.rank == 0 else control.follow(runtime)
    if code == 0:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - leaving anyway
            pass
    return code
