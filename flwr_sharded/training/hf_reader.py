"""Reading a Hugging Face safetensors checkpoint (`model.safetensors`, or the files of its index; a hub id is
downloaded first) row range by row range, so that no rank holds the model: the files' headers (`stored_tensors`:
each tensor's file, dtype and shape), checked against the model of its `config.json` before any process group exists
(`check_pretrained`), then each rank's own rows of every model tensor read from the checkpoint rows they are made of
(`load_local_shards`, through `hf_conversion`'s plan), in pieces of about `CHUNK_BYTES`, each through its own memory
map (`read_file_rows`). The file names, dtypes and chunk size here are the writer's (`hf_writer`) too.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flwr_sharded.errors import ConfigError
from flwr_sharded.parallel.alignment import local_shard
from flwr_sharded.parallel.shard_transport import row_offset
from flwr_sharded.training.hf_conversion import (StoredPart, conversion_plan, expected_tensors, mismatch_message,
                                                 published_layout, reference_model)
from flwr_sharded.training.models import build_meta_model, canonical_name, owned_parameters

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CHUNK_BYTES = 64 << 20
"""Rows are read, converted and written in pieces of about this size (bounded transient memory)."""
DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}
"""The floating-point dtypes a checkpoint holds, by their safetensors names."""


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


def check_pretrained(name: str, config: Any = None) -> Path:
    """The checkpoint directory of `name` (a directory or hub id), checked to hold every tensor of its model (of
    `config`, default its config.json) with the right shape, under the names and conversions `from_pretrained` applies,
    and the model to have a published layout to export to, from its config.json and safetensors headers alone;
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
    stored = stored_tensors(directory)
    plan, unexpected = conversion_plan(model, {k: t.shape for k, t in stored.items()}, f" in {directory}")
    mismatch = mismatch_message(model, f" in {directory}")
    need, _ = expected_tensors(model)
    missing = sorted(set(need) - set(plan))
    if missing:
        raise ConfigError(f"{mismatch}: {len(missing)} tensor(s) missing, e.g. {missing[:3]}")
    if unexpected:
        raise ConfigError(f"{mismatch}: it holds tensors the model does not have, e.g. {unexpected[:3]}")
    bad = sorted({stored[p.stored].dtype for n in need for p in plan[n]} - set(DTYPE_NAMES.values()))
    if bad:
        raise ConfigError(f"--model: the checkpoint in {directory} holds {bad} tensors; only "
                          f"{sorted(DTYPE_NAMES.values())} load")
    published_layout(model)  # the run's model/ is written in it: refused now rather than after training
    return directory


@torch.no_grad()
def load_local_shards(model: nn.Module, directory: str | Path) -> None:
    """Fill this rank's local rows of every parameter (and every persistent buffer) from the checkpoint, each model row
    from the checkpoint rows it is made of (`conversion_plan`), in pieces of about `CHUNK_BYTES`."""
    stored = stored_tensors(Path(directory))
    shapes = {k: t.shape for k, t in stored.items()}
    plan, _ = conversion_plan(reference_model(model), shapes, f" in {directory}")
    need, _ = expected_tensors(model)
    missing = sorted(set(need) - set(plan))
    if missing:
        raise ConfigError(f"--model: the checkpoint in {directory} lacks {missing[:3]}")
    done = set()
    for name, param, _ in owned_parameters(model):
        done.add(name)
        _read_local(plan[name], stored, local_shard(param), row_offset(param))
    for name, buffer in model.state_dict(keep_vars=True).items():  # persistent buffers: whole on every rank
        name = canonical_name(name)
        if name in need and name not in done:
            _read_local(plan[name], stored, buffer, 0)


def _read_local(pieces: list[StoredPart], stored: dict[str, StoredTensor], local: torch.Tensor, start: int) -> None:
    """Rows `[start, start + len(local))` of a model tensor, from its pieces."""
    if local.numel() == 0:
        return
    rows = local.shape[0] if local.dim() else 1
    for piece in pieces:
        file = stored[piece.stored].file
        if piece.transposed:  # the rank's rows are the checkpoint's columns [start, start + rows)
            read_file_rows(file, piece.stored, local.T, 0, column=start)
            continue
        hit = piece.in_rows(stored[piece.stored].shape, start, start + rows)
        if hit is not None:
            where, first, _ = hit
            read_file_rows(file, piece.stored, local[where] if where else local, first)


def read_file_rows(file: Path, name: str, local: torch.Tensor, start: int, *, column: int | None = None) -> None:
    """Copy rows `[start, start + len(local))` of tensor `name` of a safetensors file into `local` (with `column`:
    only columns `[column, column + local.shape[1])` of a 2-D tensor), in pieces of about `CHUNK_BYTES`, each through
    its own `safe_open` (memory map), so at most one piece is ever resident."""
    from safetensors import safe_open

    rows = local.shape[0] if local.dim() else 1
    row_bytes = max(1, local[0].numel() * local.element_size()) if local.dim() else local.element_size()
    step = max(1, CHUNK_BYTES // row_bytes)
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            if local.dim() == 0:
                local.copy_(handle.get_tensor(name))
            elif column is not None:
                local[lo:hi].copy_(handle.get_slice(name)[start + lo:start + hi, column:column + local.shape[1]])
            else:
                local[lo:hi].copy_(handle.get_slice(name)[start + lo:start + hi])
