"""Whether the federation groups shard the model alike, so that shard i of one group can be averaged with shard i of
the others: a digest of every parameter's name, global shape, dtype, local shard shape and placements, compared
across the federation group before the first sync with new peers."""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


class ShardAlignmentError(RuntimeError):
    """Federation groups shard the model differently, so their shards cannot be averaged."""


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores for a parameter (the local shard of a DTensor)."""
    return param._local_tensor if isinstance(param, DTensor) else param.data


def _descriptor(name: str, param: torch.Tensor) -> str:
    local = local_shard(param)
    placements = tuple(str(p) for p in param.placements) if isinstance(param, DTensor) else ()
    return f"{name}|{tuple(param.shape)}|{param.dtype}|{tuple(local.shape)}|{placements}"


def fingerprint(names: list[str], params: list[torch.Tensor]) -> str:
    """Digest of parameter names, global shapes, dtypes, local shard shapes and placements."""
    digest = hashlib.sha256()
    for name, p in zip(names, params):
        digest.update(_descriptor(name, p).encode())
    return digest.hexdigest()


def check_alignment(names: list[str], params: list[torch.Tensor], fed_group: dist.ProcessGroup | None,
                    rep_group: dist.ProcessGroup | None) -> None:
    """Compare fingerprints across `fed_group`; raise `ShardAlignmentError` naming the first mismatch. With a
    replication group, replica 0 checks and tells the other replicas the verdict, so all of them raise."""
    descriptors = [_descriptor(n, p) for n, p in zip(names, params)]
    check_descriptors([(descriptors, fed_group)] if fed_group is not None else [], rep_group,
                      local_shard(params[0]).device)


def check_descriptors(channels: list[tuple[list[str], dist.ProcessGroup]], rep_group: dist.ProcessGroup | None,
                      device: torch.device) -> None:
    """Compare each channel's descriptors (what its members sync, in order) across its group, channel by channel;
    raise `ShardAlignmentError` naming the first mismatch, on the replicas too (told by replica 0)."""
    message = ""
    for descriptors, group in channels:
        found = _mismatch(descriptors, group, device)
        message = message or found
    if rep_group is not None:
        verdict = torch.tensor([1 if message else 0], dtype=torch.int64, device=device)
        dist.broadcast(verdict, group=rep_group, group_src=0)
        if verdict.item() and not message:
            message = "replica 0 of this group found shards misaligned with other groups (see its error)"
    if message:
        raise ShardAlignmentError(message)


def _mismatch(descriptors: list[str], group: dist.ProcessGroup, device: torch.device) -> str:
    """'' when every member of `group` has the same descriptors; else the first difference, explained."""
    mine = int(hashlib.sha256("\n".join(descriptors).encode()).hexdigest()[:15], 16)
    gathered = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, torch.tensor([mine], dtype=torch.int64, device=device), group=group)
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


__all__ = ["ShardAlignmentError", "check_alignment", "check_descriptors", "fingerprint", "local_shard"]
