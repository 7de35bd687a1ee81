"""Pretrained Hugging Face safetensors checkpoints (`model.safetensors`, or the files of its index; a hub id is
downloaded first), read shard by shard: `check_pretrained` compares the safetensors headers with the model of its
`config.json` before any process group exists, and `load_local_shards` reads each rank's own rows of each tensor."""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flwr_sharded.errors import ConfigError
from flwr_sharded.parallel.shard_transport import row_offset
from flwr_sharded.parallel.sync import local_shard
from flwr_sharded.training.models import build_meta_model, canonical_name, owned_parameters, saved_tensors
from flwr_sharded.training.safetensors_writer import DTYPE_NAMES, INDEX_FILE, SINGLE_FILE
READ_CHUNK_BYTES = 64 << 20
"""Rows of one parameter are read in pieces of about this size (bounded transient memory)."""


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors checkpoint, from its file's header."""

    file: Path
    dtype: str
    shape: tuple[int, ...]


def resolve_pretrained(name: str) -> Path:
    """A local checkpoint directory as is; a hub id downloaded (config, safetensors and JSON files only)."""
    path = Path(name)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as exc:  # network, authentication or a missing repository: all a bad --model
        raise ConfigError(f"--model: cannot download {name!r}: {exc}") from exc


def read_header(file: Path) -> dict[str, Any]:
    """The JSON header of one safetensors file (tensor name -> dtype, shape, data_offsets)."""
    with open(file, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ConfigError(f"--model: {file} is not a safetensors file")
        (length,) = struct.unpack("<Q", raw)
        if length > 100 << 20:
            raise ConfigError(f"--model: {file} has an implausible safetensors header ({length} bytes)")
        header = json.loads(fh.read(length))
    header.pop("__metadata__", None)
    return header


def stored_tensors(directory: Path) -> dict[str, StoredTensor]:
    """Every tensor of the checkpoint in `directory` (one file, or the files of its index) with dtype and shape."""
    index = directory / INDEX_FILE
    if index.is_file():
        files = sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
    elif (directory / SINGLE_FILE).is_file():
        files = [directory / SINGLE_FILE]
    else:
        raise ConfigError(f"--model: {directory} holds no {SINGLE_FILE} nor {INDEX_FILE} (only safetensors "
                          f"checkpoints can be loaded sharded)")
    out: dict[str, StoredTensor] = {}
    for file in files:
        if not file.is_file():
            raise ConfigError(f"--model: {file.name}, listed in {index}, is missing")
        for key, info in read_header(file).items():
            out[key] = StoredTensor(file, info["dtype"], tuple(info["shape"]))
    return out


def expected_tensors(model: nn.Module) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...] | None]]:
    """(name -> full shape of every tensor a checkpoint must hold, name -> shape (None: any) of those it may hold: a
    tied weight under its second name, ignored as `from_pretrained` does, and the non-persistent buffers)."""
    need = {name: tuple(t.shape) for name, t in saved_tensors(model)}
    may: dict[str, tuple[int, ...] | None] = {canonical_name(n): tuple(p.shape) for n, p in
                                              model.named_parameters(remove_duplicate=False)
                                              if canonical_name(n) not in need}
    for module_name, module in model.named_modules():
        for name in module._non_persistent_buffers_set:
            may[canonical_name(f"{module_name}.{name}" if module_name else name)] = None
    return need, may


def ignored(model: nn.Module, name: str) -> bool:
    """A checkpoint tensor that `from_pretrained` drops silently (old rotary buffers, the model's own patterns)."""
    patterns = [r"rotary_emb\.inv_freq$", *(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    return any(re.search(p, name) for p in patterns)


def check_pretrained(name: str, config: Any = None) -> Path:
    """The checkpoint directory of `name` (a directory or hub id), checked to hold every tensor of its model (of
    `config`, default its config.json) with the right shape, from its config.json and safetensors headers alone;
    ConfigError naming --model otherwise."""
    directory = resolve_pretrained(name)
    if config is None:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(directory)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--model: cannot read the config.json of {directory}: {exc}") from exc
    try:
        model = build_meta_model(config)
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"--model: {directory}: its config.json describes no causal LM: {exc}") from exc
    need, optional = expected_tensors(model)
    stored = stored_tensors(directory)
    mismatch = f"--model: the checkpoint in {directory} does not match its {type(model).__name__} " \
               f"({getattr(config, 'model_type', '?')}) architecture"
    missing = sorted(set(need) - set(stored))
    if missing:
        raise ConfigError(f"{mismatch}: {len(missing)} tensor(s) missing, e.g. {missing[:3]}")
    shapes = {**{k: s for k, s in optional.items() if k in stored and s is not None}, **need}
    wrong = [f"{k}: checkpoint {list(stored[k].shape)} != model {list(s)}" for k, s in shapes.items()
             if stored[k].shape != s]
    if wrong:
        raise ConfigError(f"{mismatch}: {len(wrong)} shape mismatch(es), e.g. {'; '.join(wrong[:3])}")
    unexpected = sorted(k for k in set(stored) - set(need) - set(optional) if not ignored(model, k))
    if unexpected:
        raise ConfigError(f"{mismatch}: it holds tensors the model does not have, e.g. {unexpected[:3]}")
    bad = sorted({stored[k].dtype for k in need if stored[k].dtype not in DTYPE_NAMES.values()})
    if bad:
        raise ConfigError(f"--model: the checkpoint in {directory} holds {bad} tensors; only "
                          f"{sorted(DTYPE_NAMES.values())} load")
    return directory


@torch.no_grad()
def load_local_shards(model: nn.Module, directory: str | Path) -> None:
    """Fill this rank's local rows of every parameter (and every persistent buffer) from the checkpoint."""
    from safetensors import safe_open

    stored = stored_tensors(Path(directory))
    need, _ = expected_tensors(model)
    missing = sorted(set(need) - set(stored))
    if missing:
        raise ConfigError(f"--model: the checkpoint in {directory} lacks {missing[:3]}")
    done = set()
    for name, param, _ in owned_parameters(model):
        local = local_shard(param)
        done.add(name)
        if stored[name].shape != tuple(param.shape):
            raise ConfigError(f"--model: {name} is {list(stored[name].shape)} in {directory}, the model's is "
                              f"{list(param.shape)}")
        if local.numel():
            read_rows(stored[name].file, name, local, row_offset(param))
    for name, buffer in model.state_dict(keep_vars=True).items():  # persistent buffers: whole on every rank
        name = canonical_name(name)
        if name in need and name not in done:
            with safe_open(str(stored[name].file), framework="pt", device="cpu") as handle:
                buffer.copy_(handle.get_tensor(name))


def read_rows(file: Path, name: str, local: torch.Tensor, start: int) -> None:
    """Copy rows `[start, start + len(local))` of tensor `name` of a safetensors file into `local`, in pieces of about
    `READ_CHUNK_BYTES`, each through its own `safe_open` (memory map), so at most one piece is ever resident."""
    from safetensors import safe_open

    rows = local.shape[0] if local.dim() else 1
    row_bytes = max(1, local[0].numel() * local.element_size()) if local.dim() else local.element_size()
    step = max(1, READ_CHUNK_BYTES // row_bytes)
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            if local.dim() == 0:
                local.copy_(handle.get_tensor(name))
            else:
                local[lo:hi].copy_(handle.get_slice(name)[start + lo:start + hi])
