"""Sharded start-up: the model built on the meta device and sharded with FSDP2, then only each rank's rows allocated
and filled, from a pretrained checkpoint or by a seeded init that draws each parameter in fixed blocks of
`INIT_BLOCK_ROWS` rows of its full shape, each seeded by (seed, name, block): the same full parameters for any F, R,
S and device, by Hugging Face's base `_init_weights` rules (Linear, Conv1D and Embedding weights ~ N(0,
initializer_range), biases 0, norm weights 1, the padding row 0). Buffers come from the model's own `_init_weights`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from flwr_sharded.parallel.shard_transport import row_offset
from flwr_sharded.parallel.sharding import apply_activation_checkpointing, apply_fsdp
from flwr_sharded.parallel.alignment import local_shard
from flwr_sharded.training import hf_checkpoint
from flwr_sharded.training.models import build_meta_model, is_preset, model_config, owned_parameters, transformer_blocks
from flwr_sharded.training.partition import seeded_generator

INIT_BLOCK_ROWS = 64
"""Rows of a parameter's full shape drawn from one generator: a fixed grid, whatever the sharding."""


def build_sharded_model(name: str, *, vocab_size: int, max_seq_len: int, mesh: DeviceMesh, seed: int,
                        mp_policy: MixedPrecisionPolicy, device: torch.device | str = "cpu", pretrained: bool = False,
                        reshard_after_forward: bool = True, activation_checkpointing: bool = False) -> nn.Module:
    """Build, shard and initialise by `seed` (or load, if `pretrained` and not a preset) the causal LM `name` (as
    `--model`) on the FSDP `mesh`, ("shard",) or ("rep", "shard"); collective-free. `vocab_size`: the tokenizer's,
    for presets that fix none."""
    directory = hf_checkpoint.resolve_pretrained(name) if pretrained and not is_preset(name) else None
    model = build_meta_model(model_config(str(directory or name), vocab_size=vocab_size, max_seq_len=max_seq_len))
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    apply_fsdp(model, transformer_blocks(model), mesh, mp_policy=mp_policy,
               reshard_after_forward=reshard_after_forward)
    materialize(model, device)
    if directory is not None:
        hf_checkpoint.load_local_shards(model, directory)
    else:
        init_local_shards(model, seed)
    return model


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device | str) -> None:
    """Allocate this rank's local shards (and buffers) on `device` and recompute every buffer; the parameters are left
    for `init_local_shards` or a checkpoint to fill."""
    model.to_empty(device=device)
    reset_buffers(model)


@torch.no_grad()
def reset_buffers(model: nn.Module) -> None:
    """Recompute the buffers of a materialised model with its `_init_weights` (parameters untouched)."""
    init_weights = getattr(model, "_init_weights", None)
    for module in model.modules():
        buffers = [b for b in module._buffers.values() if b is not None]
        if not buffers:
            continue
        for buffer in buffers:
            if buffer.is_floating_point():
                buffer.fill_(float("nan"))  # whatever `_init_weights` does not set is caught below
        own = [p for p in module._parameters.values() if p is not None]
        for param in own:  # Hugging Face's init functions skip tensors marked initialised
            param._is_hf_initialized = True
        try:
            if init_weights is not None:
                init_weights(module)
        finally:
            for param in own:
                del param._is_hf_initialized
        unset = [n for n, b in module._buffers.items() if b is not None and b.is_floating_point() and b.isnan().any()]
        if unset:
            raise NotImplementedError(f"cannot recompute buffers {unset} of {type(module).__name__} after "
                                      f"meta-device initialisation (its _init_weights does not set them)")


def init_rule(module: nn.Module, param_name: str) -> str:
    """'normal', 'zeros' or 'ones': Hugging Face's base `_init_weights` rule for this parameter of `module`."""
    kind = type(module).__name__
    if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d)) or kind == "Conv1D":
        return "normal" if param_name == "weight" else "zeros"
    if "Norm" in kind:
        return "ones" if param_name == "weight" else "zeros"
    raise NotImplementedError(f"no sharded initialisation rule for {kind}.{param_name}")


@torch.no_grad()
def init_local_shards(model: nn.Module, seed: int) -> None:
    """Initialise this rank's rows of every parameter; the full values depend on `seed` alone (module docstring)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    std = float(getattr(text, "initializer_range", None) or 0.02)
    for name, param, module in owned_parameters(model):
        local_name = name.rsplit(".", 1)[-1]
        local = local_shard(param)
        if local.numel() == 0:
            continue
        rule = init_rule(module, local_name)
        if rule != "normal":
            local.fill_(1.0 if rule == "ones" else 0.0)
        else:
            start = row_offset(param)
            fill_normal_rows(local, start=start, full_rows=param.shape[0], std=std, seed=seed, name=name)
            padding = getattr(module, "padding_idx", None) if isinstance(module, nn.Embedding) else None
            if padding is not None and start <= padding < start + local.shape[0]:
                local[padding - start].zero_()


def fill_normal_rows(local: torch.Tensor, *, start: int, full_rows: int, std: float, seed: int, name: str) -> None:
    """Fill `local` (rows `[start, start + len)` of a `full_rows`-row parameter) with its blocks of N(0, std)."""
    rows = local.shape[0]
    for block in range(start // INIT_BLOCK_ROWS, (start + rows - 1) // INIT_BLOCK_ROWS + 1):
        b0, b1 = block * INIT_BLOCK_ROWS, min((block + 1) * INIT_BLOCK_ROWS, full_rows)
        values = torch.empty((b1 - b0, *local.shape[1:]), dtype=torch.float32)
        values.normal_(0.0, std, generator=seeded_generator("init", seed, name, block))
        lo, hi = max(b0, start), min(b1, start + rows)
        local[lo - start:hi - start].copy_(values[lo - b0:hi - b0])

