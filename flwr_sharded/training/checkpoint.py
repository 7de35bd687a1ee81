"""Sharded checkpoints with `torch.distributed.checkpoint`, one series per federation group.

Layout of `DIR/group-<f>/`:

    step-00000100/        DCP files (model and optimizer shards, each rank writes its own) + rank-<i>.pt
                          (data position, RNG states, tokens since the last sync) + meta.json (step, schedule, config)
    latest                name of the newest complete checkpoint

A checkpoint is written into `step-N.tmp/` and renamed once every rank of the group has finished, then `latest` is
replaced atomically: a crash mid-write leaves the previous checkpoint usable. Saves can run in the background
(`async_save`), in which case the commit happens at the next save or at the end of training.

Fault injection (tests only): `$FLWR_SHARDED_FAULT_COMMIT_DELAY_S` seconds of sleep on every rank between writing a
checkpoint and committing it, so a test can kill the job while `step-N.tmp/` is complete but not yet renamed.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from flwr_sharded.config import TrainConfig, config_to_dict

from flwr_sharded.errors import ConfigError

LATEST = "latest"
FAULT_COMMIT_DELAY_ENV = "FLWR_SHARDED_FAULT_COMMIT_DELAY_S"
"""Fault-injection hook for tests: seconds to sleep between writing a checkpoint and committing it (unset: none)."""


def group_dir(root: str | Path, fed_index: int) -> Path:
    return Path(root) / f"group-{fed_index}"


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete checkpoint of one group's series, or None."""
    pointer = Path(directory) / LATEST
    if not pointer.is_file():
        return None
    path = Path(directory) / pointer.read_text().strip()
    return path if (path / "meta.json").is_file() else None


def read_meta(checkpoint: str | Path) -> dict[str, Any]:
    return json.loads((Path(checkpoint) / "meta.json").read_text())


def check_resumable(cfg: TrainConfig, root: str | Path, fed_index: int = 0) -> Path:
    """Before any work: the newest checkpoint of group `fed_index` exists and was written by a compatible run."""
    checkpoint = latest_checkpoint(group_dir(root, fed_index))
    if checkpoint is None:
        raise ConfigError(f"--resume: no complete checkpoint in {group_dir(root, fed_index)}")
    saved = read_meta(checkpoint)["config"]
    mine = config_to_dict(cfg)
    for section, keys in (("parallel", ("method", "federations", "replicas", "shards", "outer")), ("model", ("name",)),
                          ("data", ("dataset", "seq_len", "partition"))):
        for key in keys:
            if saved[section][key] != mine[section][key]:
                raise ConfigError(f"--resume: the checkpoint in {root} was written with {section}.{key}="
                                  f"{saved[section][key]!r}, this run has {mine[section][key]!r}")
    # the outer state's layout: a reduced wire keeps the global shards (fp32 fedavg never did), fragments have their
    # own, error feedback its residuals; checkpoints from before an option hold its default
    for key, default in (("sync_dtype", "float32"), ("sync_fragments", 1), ("sync_error_feedback", False)):
        saved_value = saved["parallel"].get(key, default)
        if saved_value != getattr(cfg.parallel, key):
            raise ConfigError(f"--resume: the checkpoint in {root} was written with parallel.{key}={saved_value!r}, "
                              f"this run has {getattr(cfg.parallel, key)!r}")
    for key in ("batch_size", "grad_accum", "seed"):
        if saved[key] != mine[key]:
            raise ConfigError(f"--resume: the checkpoint was written with {key}={saved[key]!r}, this run has "
                              f"{mine[key]!r}")
    return checkpoint


@dataclass
class _Pending:
    future: Future | None
    tmp: Path
    final: Path


class Checkpointer:
    """Saves and restores one group's model, optimizer, schedule, data position and RNG state."""

    def __init__(self, root: str | Path, *, fed_index: int, group_rank: int, group_pg: dist.ProcessGroup,
                 keep: int = 2, async_save: bool = False) -> None:
        self.directory = group_dir(root, fed_index)
        self.group_rank, self.group_pg = group_rank, group_pg
        self.keep, self.async_save = keep, async_save
        self._pending: _Pending | None = None

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
             meta: dict[str, Any], rank_state: dict[str, Any]) -> None:
        """Write checkpoint `step` (collective over the group); commit it now, or at the next call if async."""
        self.wait()
        final = self.directory / step_name(step)
        tmp = final.with_name(final.name + ".tmp")
        if self.group_rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier(group=self.group_pg)
        torch.save(rank_state, tmp / f"rank-{self.group_rank}.pt")
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        future = None
        if self.async_save:
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group_pg)
        else:
            dcp.save(state, checkpoint_id=str(tmp), process_group=self.group_pg)
        if self.group_rank == 0:
            (tmp / "meta.json.part").write_text(json.dumps({"step": step, **meta}))
        self._pending = _Pending(future, tmp, final)
        if not self.async_save:
            self.wait()

    def wait(self) -> None:
        """Finish the pending save: wait for its writes on every rank, then rename it into place and prune."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.future is not None:
            pending.future.result()
        _fault_commit_delay()
        dist.barrier(group=self.group_pg)
        if self.group_rank == 0:
            os.replace(pending.tmp / "meta.json.part", pending.tmp / "meta.json")
            shutil.rmtree(pending.final, ignore_errors=True)
            os.replace(pending.tmp, pending.final)
            pointer = self.directory / (LATEST + ".tmp")
            pointer.write_text(pending.final.name)
            os.replace(pointer, self.directory / LATEST)
            self._prune()
        dist.barrier(group=self.group_pg)

    def _prune(self) -> None:
        complete = sorted(p for p in self.directory.glob("step-*") if not p.name.endswith(".tmp"))
        for old in complete[:-self.keep] if self.keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, checkpoint: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[
            dict[str, Any], dict[str, Any]]:
        """Restore model and optimizer shards in place; return (meta, this rank's own state)."""
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(checkpoint), process_group=self.group_pg)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        rank_state = torch.load(checkpoint / f"rank-{self.group_rank}.pt", weights_only=False)
        return read_meta(checkpoint), rank_state


def _fault_commit_delay() -> None:
    """The test-only fault-injection hook (`FAULT_COMMIT_DELAY_ENV`); a no-op unless the variable is set."""
    delay = float(os.environ.get(FAULT_COMMIT_DELAY_ENV) or 0)
    if delay > 0:
        time.sleep(delay)


def export_pretrained(checkpoint: str | Path, out: str | Path, *, dtype: torch.dtype | None = None,
                      max_file_bytes: int | None = None) -> Path:
    """Write a checkpoint's model as a Hugging Face model (safetensors, config, tokenizer), one tensor at a time.

    A single process, no process group: each tensor is read alone from the DCP files (only its chunks), converted
    to `dtype` (default: as stored) and written at its offset in the pre-sized safetensors file(s), then freed. The
    peak memory is about one full tensor (the largest, usually the embedding), whatever the model's size or the
    number of ranks that wrote the checkpoint.
    """
    from flwr_sharded.config import config_from_dict
    from flwr_sharded.training import safetensors_writer as writer
    from flwr_sharded.training.data import load_tokenizer
    from flwr_sharded.training.model_init import build_meta_model
    from flwr_sharded.training.models import model_config

    checkpoint = Path(checkpoint)
    if not (checkpoint / "meta.json").is_file():
        found = latest_checkpoint(checkpoint)
        if found is None:
            raise ConfigError(f"--checkpoint: {checkpoint} is neither a checkpoint nor a series with a '{LATEST}'")
        checkpoint = found
    meta = read_meta(checkpoint)
    cfg = config_from_dict(meta["config"])
    model = build_meta_model(model_config(cfg.model.name, vocab_size=meta["vocab_size"],
                                          max_seq_len=cfg.data.seq_len))  # names and shapes only
    stored = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    tensors = [name for name, _ in writer.saved_tensors(model)]
    missing = [name for name in tensors if f"model.{name}" not in stored]
    if missing:
        raise ConfigError(f"--checkpoint: {checkpoint} lacks the model's {missing[:3]}")
    dtype = dtype or stored[f"model.{tensors[0]}"].properties.dtype
    layout = writer.plan_layout([(n, tuple(stored[f"model.{n}"].size)) for n in tensors], dtype,
                                max_file_bytes=max_file_bytes or writer.MAX_FILE_BYTES)
    writer.create_files(out, layout)
    for name in tensors:
        info = stored[f"model.{name}"]
        tensor = torch.empty(tuple(info.size), dtype=info.properties.dtype)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # single-process by design
            dcp.load({"model": {name: tensor}}, checkpoint_id=str(checkpoint), no_dist=True)
        writer.write_rows(out, layout, name, 0, tensor)
        del tensor
    writer.commit(out, layout)
    writer.write_config(out, model, dtype, load_tokenizer(cfg.data, cfg.model.name))
    return Path(out)


def register(subparsers: Any) -> None:
    """Add the `export` sub-command."""
    parser = subparsers.add_parser("export", help="merge a checkpoint's shards into a Hugging Face model",
                                   description="Write the model of a sharded checkpoint as a Hugging Face model, one "
                                   "tensor at a time.")
    parser.add_argument("--checkpoint", required=True,
                        help="a checkpoint directory (step-N) or a group's series (uses its newest)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="dtype of the written tensors (default: as in the checkpoint)")
    parser.set_defaults(func=_export_command)


def _export_command(args: Any) -> int:
    try:
        path = export_pretrained(args.checkpoint, args.out, dtype=getattr(torch, args.dtype) if args.dtype else None)
    except ConfigError as exc:
        print(f"flwr-sharded export: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
