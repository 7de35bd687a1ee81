"""A model's parameters as its checkpoints name them: each once, under its first name (tied weights once), without
the segments that wrapper modules add (activation checkpointing, FSDP, torch.compile)."""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def owned_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter, nn.Module]]:
    """(name, parameter, owning module) once per parameter, named by its first occurrence (tied weights once)."""
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for local_name, param in module._parameters.items():
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            yield canonical_name(f"{module_name}.{local_name}" if module_name else local_name), param, module


def canonical_name(name: str) -> str:
    """A parameter name without wrapper modules' segments (activation checkpointing, torch.compile)."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name
