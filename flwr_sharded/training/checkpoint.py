"""Writing and loading one group's sharded checkpoints with `torch.distributed.checkpoint` (the series' layout and
which checkpoints are complete: `checkpoint_series`; whether a run may resume: `checkpoint_resume`):

    step-00000100/   DCP files (model and optimizer shards, one per rank) + rank-<i>.pt (data position, RNG states,
                     tokens since the last sync; loaded with `weights_only=True`) + meta.json (step, schedule,
                     config, file manifest)
    latest           name of the newest committed checkpoint

A checkpoint is written, fsync'd, into `step-N.tmp/`; once every rank has written, group rank 0 commits (meta.json
with every file's size; rename to `step-N/`, an existing `step-N/` kept as `step-N.old/` until then; `latest`
replaced atomically; each step fsync'd), so a complete checkpoint is on disk at every moment. A write that fails on
any rank (a full disk) removes `step-N.tmp/` and raises `CheckpointWriteError` on every rank of the group (the static
engine stops there; a Flower group reports it to the ServerApp). An async save writes from a thread over a gloo group
of the group's ranks (`write_group`) that carries nothing else: DCP needs a CPU backend for it, and a group the main
thread also uses (the NCCL group, a control group) would interleave the two threads' collectives. Rotation (`prune`)
keeps the `keep` newest committed checkpoints; a restore loads the newest step every rank of the job holds complete.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from flwr_sharded.training import checkpoint_files
from flwr_sharded.training.checkpoint_files import META_FILE, read_meta
from flwr_sharded.training.checkpoint_series import LATEST, OLD, TMP, group_dir, holdings, intact_steps, \
    latest_checkpoint, step_name, step_of

META_PART = META_FILE + ".part"


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written on some rank of the group (e.g. a full disk). Raised on every rank; the
    partial checkpoint is removed and the previous one is unchanged."""


def failure_line(exc: BaseException) -> str:
    """One line for an error of a write or load; DCP's gathered failures name the group rank each happened on."""
    if isinstance(exc, CheckpointException):
        return "; ".join(f"group rank {rank}: {type(e).__name__}: {e}" for rank, (e, _) in exc.failures.items())
    return f"{type(exc).__name__}: {exc}"


def cpu_capable(pg: dist.ProcessGroup) -> bool:
    """Whether `pg` has a CPU backend (gloo), which DCP's async save needs."""
    return torch.device("cpu") in pg._device_types


def write_group(group_ranks: Sequence[Sequence[int]], own: int, timeout_s: float) -> dist.ProcessGroup:
    """A gloo group over each federation group's ranks, this rank's (`group_ranks[own]`) returned: what async
    checkpoints are written over. A collective of the world: every rank makes every group's, in the same order."""
    groups = [dist.new_group(list(ranks), backend="gloo", timeout=timedelta(seconds=timeout_s))
              for ranks in group_ranks]
    return groups[own]


@dataclass
class _Pending:
    future: Future | None
    tmp: Path
    final: Path
    meta: dict[str, Any]
    error: str = ""
    """Why starting the write failed on this rank ('' if it did not)."""


class Checkpointer:
    """Saves and restores one group's model, optimizer, schedule, data position and RNG state.

    Args:
        group_pg: all ranks of the group (loads, synchronous saves, the ranks' agreement on a write).
        async_pg: the group an async save writes over from its thread (`write_group`): a CPU backend, used by
            nothing else. Needed for `async_save` (ValueError without one).
    """

    def __init__(self, root: str | Path, *, fed_index: int, group_rank: int, group_pg: dist.ProcessGroup,
                 keep: int = 2, async_save: bool = False, async_pg: dist.ProcessGroup | None = None) -> None:
        self.directory = group_dir(root, fed_index)
        self.fed_index = fed_index
        self.group_rank, self.group_pg, self.async_pg = group_rank, group_pg, async_pg
        self.keep, self.async_save = keep, async_save
        self._pending: _Pending | None = None
        if async_save and self._async_refusal():
            raise ValueError(self._async_refusal())

    def _async_refusal(self) -> str:
        """Why an async save cannot run over `async_pg` ('' if it can)."""
        if self.async_pg is None:
            return "--async-checkpoint: no process group to write over (a gloo group of the group's ranks)"
        if not cpu_capable(self.async_pg):
            return (f"--async-checkpoint: its process group has no CPU backend (devices "
                    f"{[str(d) for d in self.async_pg._device_types]}); async saves need gloo")
        return ""

    # ----- agreement within the group --------------------------------------------------------------------------
    def _errors(self, error: str, group: Any = None) -> list[str]:
        """Every rank's `error` ('' for none) over `group` (default: the group's ranks), each once: as is when every
        rank has the same, else named by its rank in `group` (a collective)."""
        group = self.group_pg if group is None else group
        size = dist.get_world_size(group)
        label = "group rank" if size == dist.get_world_size(self.group_pg) else "rank"  # one group: the same ranks
        out: list[Any] = [None] * size
        dist.all_gather_object(out, error, group=group)
        if out[0] and all(e == out[0] for e in out) and not out[0].startswith("group rank "):
            return [out[0]]
        named = [e if e.startswith("group rank ") else f"{label} {r}: {e}" for r, e in enumerate(out) if e]
        return list(dict.fromkeys(named))

    def _phase(self, what: str, tmp: Path, action: Callable[[], Any]) -> None:
        """Run `action` on every rank; if it failed on any, remove `tmp` and raise CheckpointWriteError on all."""
        error = ""
        try:
            action()
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported on every rank of the group
            error = failure_line(exc)
        self._agree(what, tmp, error)

    def _agree(self, what: str, tmp: Path, error: str) -> None:
        errors = self._errors(error)
        if not errors:
            return
        if self.group_rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # frees what the partial write took
        dist.barrier(group=self.group_pg)
        kept = latest_checkpoint(self.directory)
        raise CheckpointWriteError(f"checkpoint {tmp.name[:-len(TMP)]} not written ({what} failed on "
                                   f"{'; '.join(errors)}); the previous checkpoint "
                                   f"{kept.name if kept else '(none)'} is kept")

    # ----- saving ----------------------------------------------------------------------------------------------
    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
             meta: dict[str, Any], rank_state: dict[str, Any]) -> None:
        """Write checkpoint `step` (collective over the group), committed now or, if async, at the next call;
        CheckpointWriteError on every rank if any rank could not write it or commit the pending one."""
        earlier: CheckpointWriteError | None = None
        try:
            self.wait()
        except CheckpointWriteError as exc:  # the async one before: still try this one, then report that one
            earlier = exc
        final = self.directory / step_name(step)
        tmp = final.with_name(final.name + TMP)

        def create() -> None:
            if self.group_rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
                checkpoint_files.fsync_dir(self.directory)

        self._phase("creating its directory", tmp, create)
        self._phase("writing the rank state", tmp,
                    lambda: checkpoint_files.save_tensors(rank_state, tmp / f"rank-{self.group_rank}.pt"))
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        future, error = None, ""
        try:  # DCP fsyncs its files; a failed write raises on every rank (its results are gathered)
            if self.async_save:
                refusal = self._async_refusal()
                if refusal:
                    raise ValueError(refusal)
                future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.async_pg)
            else:
                dcp.save(state, checkpoint_id=str(tmp), process_group=self.group_pg)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - agreed on in `wait`
            error = failure_line(exc)
        # no collective of ours on `async_pg`: an async save's own collectives run there, in its thread
        self._pending = _Pending(future, tmp, final, {"step": step, **meta}, error)
        if not self.async_save:
            self.wait()
        if earlier is not None:
            raise earlier

    def wait(self) -> None:
        """Finish the pending save: wait for its writes on every rank, record its files, then commit it (`prune`
        rotates the series after)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        error = pending.error
        if pending.future is not None:
            try:
                pending.future.result()
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - agreed on below
                error = failure_line(exc)
        self._agree("writing the model and optimizer shards", pending.tmp, error)
        self._phase("syncing the directory", pending.tmp, lambda: checkpoint_files.fsync_dir(pending.tmp))

        def record() -> None:
            if self.group_rank == 0:  # every rank's files are there: the manifest of what resume must find
                files = checkpoint_files.file_sizes(pending.tmp, exclude=(META_PART,))
                checkpoint_files.write_json(pending.tmp / META_PART, {**pending.meta, "files": files})

        self._phase("recording its files", pending.tmp, record)
        self._phase("committing", pending.tmp, lambda: self._commit(pending) if self.group_rank == 0 else None)

    def _commit(self, pending: _Pending) -> None:
        """Group rank 0: put the written checkpoint in place, with a complete one on disk at every moment."""
        tmp, final = pending.tmp, pending.final
        old = final.with_name(final.name + OLD)
        os.replace(tmp / META_PART, tmp / META_FILE)
        checkpoint_files.fsync_dir(tmp)
        if final.exists():  # the same step written again (after a resume from an earlier checkpoint)
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)  # still a complete checkpoint (`candidates` looks at .old too)
        try:
            os.replace(tmp, final)
        except OSError:
            if old.exists() and not final.exists():
                os.replace(old, final)
            raise
        checkpoint_files.fsync_dir(self.directory)
        pointer = self.directory / (LATEST + TMP)
        checkpoint_files.write_bytes(pointer, lambda fh: fh.write(final.name.encode()))
        os.replace(pointer, self.directory / LATEST)
        checkpoint_files.fsync_dir(self.directory)
        shutil.rmtree(old, ignore_errors=True)

    def prune(self) -> None:
        """Rotate the series (group rank 0) once the newest checkpoint is committed, and in the static engine
        committed by every federation group (the caller's agreement): never before, so that the newest step every
        group holds complete is never the one removed."""
        if self.group_rank != 0:
            return
        newest = latest_checkpoint(self.directory)
        if newest is not None:
            self._prune(step_of(newest) or 0)

    def _prune(self, committed: int) -> None:
        """Keep the `keep` newest checkpoints up to `committed`; drop later ones (a timeline abandoned by a resume
        from an earlier checkpoint), leftovers of commits cut short and partial writes (not an async save's still
        being written)."""
        writing = self._pending.tmp if self._pending is not None else None
        for path in self.directory.glob("step-*"):
            step = step_of(path)
            if path == writing:
                continue
            if path.name.endswith(TMP) or path.name.endswith(OLD) or (step is not None and step > committed):
                shutil.rmtree(path, ignore_errors=True)
        complete = sorted((p for p in self.directory.glob("step-*") if step_of(p) is not None), key=step_of)
        for old in complete[:-self.keep] if self.keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)

    # ----- loading ---------------------------------------------------------------------------------------------
    def load(self, checkpoint: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[
            dict[str, Any], dict[str, Any]]:
        """Restore model and optimizer shards in place; return (meta, this rank's own state)."""
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, storage_reader=checkpoint_files.SafeReader(str(checkpoint)), process_group=self.group_pg)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        rank_state = checkpoint_files.load_tensors(checkpoint / f"rank-{self.group_rank}.pt")
        return read_meta(checkpoint), rank_state

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                check: Callable[[Path], None] | None = None) -> tuple[Path, dict[str, Any], dict[str, Any], list[str]]:
        """Load the newest step that every rank of the job holds complete and loads (collective over the default
        group: in the static engine every federation group resumes from the same step; `check` passes). Returns
        (its path, meta, this rank's state, what was skipped and why); RuntimeError on every rank if none is."""
        intact, skipped = intact_steps(self.directory)
        held: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(held, (self.fed_index, list(intact)))
        common = set.intersection(*(set(steps) for _, steps in held))
        skipped += [f"{path.name} (not complete in every federation group)" for s, path in intact.items()
                    if s not in common]
        for step in [s for s in held[0][1] if s in common]:  # rank 0's preference, the same on every rank
            path = intact[step]
            if check is not None:
                check(path)  # the same on every rank (it reads meta.json)
            error = ""
            try:
                meta, rank_state = self.load(path, model, optimizer)
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - agreed on below; the next
                error = failure_line(exc)                         # candidate overwrites it all
            errors = self._errors(error, dist.group.WORLD)
            if not errors:
                return path, meta, rank_state, skipped
            skipped.append(f"{path.name} (failed to load on {errors[0]})")
        raise RuntimeError(f"no checkpoint step that every rank of the run holds complete and loads, in "
                           f"{self.directory.parent} ({holdings(held)})"
                           + (f"; skipped {'; '.join(skipped)}" if skipped else ""))
