"""Whether the federation groups shard the model alike, so that shard i of one group can be averaged with shard i of
the others: a digest of every parameter's name, global shape, dtype, local shard shape and placements, compared
across the federation group before the first sync with new peers."""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from flwr_sharded.parallel.collectives import bounded


class ShardAlignmentError(RuntimeError):
    """Federation groups shard the model differently, so their shards cannot be averaged."""


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores for a parameter (the local shard of a DTensor)."""
    return param._local_tensor if isinstance(param, DTensor) else param.data


def _descriptor(name: str, param: torch.Tensor) -> str:
    local = local_shard(param)
    placements = tuple(str(p) for p in param.placements) if isinstance(param, DTensor) else ()
    return f"{name}|{tuple(param.shape)}|{param.dtype}|{tuple(local.shape)}|{placements}"


def describe(names: list[str], params: list[torch.Tensor]) -> list[str]:
    """One descriptor per parameter: name, global shape, dtype, local shard shape and placements."""
    return [_descriptor(n, p) for n, p in zip(names, params)]


def fingerprint(names: list[str], params: list[torch.Tensor]) -> str:
    """Digest of parameter names, global shapes, dtypes, local shard shapes and placements."""
    return hashlib.sha256("".join(describe(names, params)).encode()).hexdigest()


def check_descriptors(channels: list[tuple[list[str], dist.ProcessGroup]], device: torch.device) -> None:
    """Compare each channel's descriptors (what its members sync, in order) across its group, channel by channel;
    raise `ShardAlignmentError` naming the first mismatch."""
    message = ""
    for descriptors, group in channels:
        message = message or _mismatch(descriptors, group, device)
    if message:
        raise ShardAlignmentError(message)


def _mismatch(descriptors: list[str], group: dist.ProcessGroup, device: torch.device) -> str:
    """'' when every member of `group` has the same descriptors; else the first difference, explained."""
    mine = int(hashlib.sha256("\n".join(descriptors).encode()).hexdigest()[:15], 16)
    gathered = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(group))]
    bounded(dist.all_gather, gathered, torch.tensor([mine], dtype=torch.int64, device=device), group=group)
    if all(int(g.item()) == mine for g in gathered):
        return ""
    everyone: list[list[str] | None] = [None] * len(gathered)
    dist.all_gather_object(everyone, descriptors, group=group)
    return _first_mismatch(everyone)


def _first_mismatch(everyone: list[list[str] | None]) -> str:
    reference = everyone[0] or []
    for member, descriptors in enumerate(everyone[1:], start=1):
        descriptors = descriptors or []
        for i in range(max(len(reference), len(descriptors))):
            a = reference[i] if i < len(reference) else "<missing>"
            b = descriptors[i] if i < len(descriptors) else "<missing>"
            if a != b:
                return (f"federation groups shard the model differently at parameter #{i}: "
                        f"member 0 has {_explain(a)}, member {member} has {_explain(b)}; every group must use the "
                        f"same model, dtype and number of shards S")
    return "federation groups' shard fingerprints differ"


def _explain(descriptor: str) -> str:
    if descriptor == "<missing>":
        return "no such parameter"
    name, shape, dtype, local, placements = descriptor.split("|")
    return f"'{name}' shape {shape} {dtype} local shard {local} placements {placements}"


__all__ = ["ShardAlignmentError", "check_descriptors", "describe", "fingerprint", "local_shard"]
