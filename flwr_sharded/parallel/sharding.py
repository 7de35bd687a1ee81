"""FSDP2 sharding of a Hugging Face causal LM: `fully_shard` on each transformer block and the root."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def mixed_precision_policy(precision: str, device: str) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 gradient reduction on GPU by default; plain fp32 on CPU."""
    if precision == "auto":
        precision = "bf16" if device == "cuda" else "fp32"
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each transformer block's activations in backward (Hugging Face gradient checkpointing)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def apply_fsdp(model: nn.Module, blocks: Iterable[nn.Module], mesh: DeviceMesh, *, mp_policy: MixedPrecisionPolicy,
               reshard_after_forward: bool = True) -> nn.Module:
    """Shard each of `blocks`, then the root (embeddings, final norm, head); HSDP when `mesh` is 2-D (rep, shard)."""
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    return model


def reshard_all(model: nn.Module) -> None:
    """Put every FSDP module's sharded parameters back in place (after a forward without backward)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
