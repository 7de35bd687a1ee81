"""The model: presets (`flwr_sharded.presets`, built as their family's `transformers` config) or any Hugging Face
causal LM, its transformer blocks, and its parameters as checkpoints name them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flwr_sharded.errors import ConfigError
from flwr_sharded.presets import PRESETS, Preset
from flwr_sharded.training.transformers_adapter import block_class_names

__all__ = ["PRESETS", "Preset", "build_meta_model", "build_model", "canonical_name", "check_hub_cache",
           "check_model_name", "is_preset", "model_config", "owned_parameters", "saved_tensors", "transformer_blocks"]

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def is_preset(name: str) -> bool:
    return name in PRESETS


def check_model_name(name: str) -> None:
    """Fail early for a name that is neither a preset, a local directory, nor shaped like a hub id."""
    if name in PRESETS or Path(name).is_dir():
        return
    parts = name.split("/")
    if len(parts) == 2 and all(parts):
        return  # a hub id; resolved when the model is built
    raise ConfigError(f"--model: unknown model {name!r}; use a preset ({', '.join(PRESETS)}), "
                      f"a Hugging Face id (org/name) or a local model directory")


def check_hub_cache(name: str) -> None:
    """Offline (`HF_HUB_OFFLINE`), a hub id must be in the Hugging Face cache already (its config.json at least)."""
    if name in PRESETS or Path(name).is_dir():
        return
    from huggingface_hub import constants, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE and not isinstance(try_to_load_from_cache(name, "config.json"), str):
        raise ConfigError(f"--model: {name!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                          f"HF_HUB_OFFLINE is set; download it where the hub is reachable (`hf download {name}`) "
                          f"or give a local model directory")


def model_config(name: str, *, vocab_size: int, max_seq_len: int) -> Any:
    """The `transformers` config of a preset (its family's, a `LlamaConfig` by default) or of a Hugging Face id/path
    (its config.json)."""
    from transformers import AutoConfig

    check_model_name(name)
    if name in PRESETS:
        preset = PRESETS[name]
        return AutoConfig.for_model(preset.model_type, **preset.config(vocab_size, max_seq_len))
    try:
        return AutoConfig.from_pretrained(name)
    except OSError as exc:
        raise ConfigError(f"--model: cannot load {name!r}: {exc}") from exc


def build_model(name: str, *, vocab_size: int, max_seq_len: int, pretrained: bool = False,
                device: torch.device | str = "cpu") -> nn.Module:
    """A whole causal LM: a preset with random init, or a Hugging Face id/path (weights if `pretrained`); training
    builds its model sharded instead (`flwr_sharded.training.model_init`)."""
    from transformers import AutoModelForCausalLM

    config = model_config(name, vocab_size=vocab_size, max_seq_len=max_seq_len)
    with torch.device(device):
        try:
            if pretrained and name not in PRESETS:
                return AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)
            return AutoModelForCausalLM.from_config(config)
        except OSError as exc:
            raise ConfigError(f"--model: cannot load {name!r}: {exc}") from exc


def build_meta_model(config: Any) -> nn.Module:
    """The causal LM of a `transformers` config on the meta device, in fp32 (shapes only: no memory, no init)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a Hugging Face model, found from its `_no_split_modules` class names (before or after
    `fully_shard`, which subclasses each block's class)."""
    names = block_class_names(model)
    blocks = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    if not blocks:
        raise ValueError(f"cannot find the transformer blocks of {type(model).__name__}: no module is one of its "
                         f"_no_split_modules ({sorted(names) or 'none declared'})")
    return blocks


def owned_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter, nn.Module]]:
    """(name, parameter, owning module) once per parameter, named by its first occurrence (tied weights once) without
    wrapper modules' segments."""
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for local_name, param in module._parameters.items():
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            yield canonical_name(f"{module_name}.{local_name}" if module_name else local_name), param, module


def saved_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What a Hugging Face checkpoint of `model` holds: each parameter once (tied weights under their first name),
    then the persistent buffers."""
    out = [(name, param) for name, param, _ in owned_parameters(model)]
    names = {n for n, _ in out} | {canonical_name(n) for n, _ in model.named_parameters(remove_duplicate=False)}
    buffers = [(canonical_name(n), t) for n, t in model.state_dict(keep_vars=True).items()]
    return out + [(n, t) for n, t in buffers if n not in names]


def canonical_name(name: str) -> str:
    """A parameter name without wrapper modules' segments (activation checkpointing, FSDP, torch.compile)."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name
