"""FSDP2 sharding of a Hugging Face causal LM: `fully_shard` on the input embedding, each transformer block, the
[final norm, output head] and the root (torchtitan's layout)."""

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


def final_norm(model: nn.Module, blocks: list[nn.Module]) -> nn.Module | None:
    """The norm the base model applies after its blocks (`norm`, `ln_f`, ...): its one direct child named a norm
    registered after the blocks' container; None if there is not exactly one."""
    base = getattr(model, "base_model", model)
    children = list(base.named_children())
    after = [i for i, (_, child) in enumerate(children) if any(b in child.modules() for b in blocks[:1])]
    norms = [child for _, child in children[(after[0] + 1 if after else 0):] if "Norm" in type(child).__name__]
    return norms[0] if len(norms) == 1 else None


def apply_fsdp(model: nn.Module, blocks: Iterable[nn.Module], mesh: DeviceMesh, *, mp_policy: MixedPrecisionPolicy,
               reshard_after_forward: bool = True) -> nn.Module:
    """Shard the model in units: the input embedding, each of `blocks`, the final norm with the output head, then
    the root (what is left); HSDP when `mesh` is 2-D (rep, shard). Each unit is gathered only while it computes
    (twice per step with `reshard_after_forward`, as the cost model counts). Tied input and output embeddings stay
    in the root, as one unit (gathered for the whole step, as a separate unit would be too)."""
    blocks = list(blocks)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = embed is not None and head is not None and head.weight is embed.weight
    shard = dict(mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    if embed is not None and not tied:
        fully_shard(embed, **shard)
    for block in blocks:
        fully_shard(block, **shard)
    if head is not None and not tied:
        norm = final_norm(model, blocks)
        fully_shard([norm, head] if norm is not None else head, **shard)
    fully_shard(model, **shard)
    return model


def reshard_all(model: nn.Module) -> None:
    """Put every FSDP module's sharded parameters back in place (after a forward without backward)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
