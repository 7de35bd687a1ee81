"""The server path's group side: exporting a facility's shards after its round, adopting the server's mean.

Export: every replica-0 rank writes its own pieces (keyed by parameter name and global row offset) to a hand-off
file; the ClientApp announces them in the round's reply and serves the server's pulls. Apply: every replica-0 rank
assembles its own rows from the chunk files the ClientApp wrote, all ranks check, then all write and the outer rule
steps on each rank's own shards and state.
"""

from __future__ import annotations

import os
import time

import torch

from flwr_sharded.errors import ConfigError
from flwr_sharded.flower import shard_files
from flwr_sharded.flower.group.contract import InstructionError, RoundRuntime
from flwr_sharded.flower.launch import private_dir
from flwr_sharded.training.catch_up import adopt_mean


def check_handoff_dir(rt: RoundRuntime) -> str:
    """'' if every rank can write and see the hand-off directory, else why not (checked at hello)."""
    probe = os.path.join(rt.handoff_dir, f".probe-{rt.pids[0]}")
    error = ""
    if rt.rank == 0:
        try:
            private_dir(rt.handoff_dir)  # still this group's own (made fresh at start)
            with open(probe, "w") as fh:
                fh.write("ok")
        except ConfigError as exc:
            error = f"hand-off directory (--handoff-dir): {exc}"
        except OSError as exc:
            error = f"cannot write the hand-off directory {rt.handoff_dir}: {exc}"
    error = rt.broadcast(error)
    if not error and not os.path.isfile(probe):
        error = (f"rank {rt.rank} does not see the hand-off directory {rt.handoff_dir}; the server path "
                 f"needs it on a filesystem shared by the group's nodes (--handoff-dir)")
    return error


def export(rt: RoundRuntime, prefix: str) -> list[str]:
    """Replica-0 ranks write their own pieces to a hand-off file each; returns every file (rank 0's view).

    Shards holding NaN or Inf are not exported (InstructionError on every rank), so the server refuses the whole
    group before pulling any of it.
    """
    from flwr_sharded.parallel.shard_transport import encode_pieces, shard_pieces

    path, error = "", ""
    if rt.topo.replica_index == 0:
        pieces = shard_pieces(rt.loop.trainer.model.named_parameters())
        bad = [p.key for p in pieces if p.data.is_floating_point() and not bool(torch.isfinite(p.data).all())]
        if bad:
            error = f"rank {rt.rank}: {len(bad)} shard piece(s) hold NaN or Inf, e.g. {bad[:3]}"
        else:
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in prefix)
            path = os.path.join(rt.handoff_dir, safe, f"s{rt.topo.shard_index}.safetensors")
            shard_files.write_file(path, *encode_pieces(pieces))
    outcome = rt.gather((path, error))
    errors = [e for _, e in outcome if e]
    if errors:
        if path:
            os.unlink(path)
        raise InstructionError("not exported: " + errors[0])
    return [p for p, _ in outcome if p]


def apply(rt: RoundRuntime, paths: list[str]) -> float:
    """Adopt the server's mean from the chunk files; returns the seconds it took. Nothing changes unless every
    rank's rows fit (InstructionError)."""
    from flwr_sharded.parallel.shard_transport import check_pieces, decode_pieces, own_pieces

    t = rt.loop.trainer
    error, pairs = "", []
    if rt.topo.replica_index == 0:
        try:
            named = list(t.model.named_parameters())
            arrays, meta = shard_files.assemble(paths, own_pieces(named))
            pairs = check_pieces(named, decode_pieces(arrays, meta))
        except Exception as exc:  # noqa: BLE001 - missing file or keys, bad shapes, NaN: refuse, change nothing
            error = f"rank {rt.rank}: {type(exc).__name__}: {exc}"
    errors = [e for e in rt.gather(error) if e]
    if errors:
        raise InstructionError("the server's shards do not fit this group, nothing changed: " + errors[0])
    start = time.perf_counter()
    with torch.no_grad():
        for piece, local in pairs:
            local.copy_(piece.data)
    adopt_mean(rt.loop)
    return time.perf_counter() - start
