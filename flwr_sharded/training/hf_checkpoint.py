"""Hugging Face safetensors checkpoints, read and written row range by row range, so that no rank holds the model.

Reading (`model.safetensors`, or the files of its index; a hub id is downloaded first): `check_pretrained` compares
the safetensors headers with the model of its `config.json` before any process group exists, and
`load_local_shards` reads each rank's own rows. Writing: a file is an 8-byte header length, a JSON header (each
tensor's dtype, shape and byte range, padded to 8 bytes) and the tensors' bytes, row-major, so the layout follows from
names, shapes and dtype alone (`plan_layout`): one writer creates the files (`create_files`), any process writes any
rows at their offset (`write_rows`), and the files are renamed into place (`commit`), with
`model.safetensors.index.json` over several files. `save_sharded_pretrained` does it collectively over a group.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from flwr_sharded.errors import ConfigError
from flwr_sharded.parallel.shard_transport import row_offset
from flwr_sharded.parallel.sharding import reshard_all
from flwr_sharded.parallel.alignment import local_shard
from flwr_sharded.training.models import build_meta_model, canonical_name, owned_parameters, saved_tensors

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_FILE_BYTES = 50_000_000_000
"""Split the tensors into files of at most this many bytes (Hugging Face's default `max_shard_size`, "50GB")."""
CHUNK_BYTES = 64 << 20
"""Rows are read, converted and written in pieces of about this size (bounded transient memory)."""
DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}
"""The floating-point dtypes a checkpoint holds, by their safetensors names."""
_PART = ".part"
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


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
    `CHUNK_BYTES`, each through its own `safe_open` (memory map), so at most one piece is ever resident."""
    from safetensors import safe_open

    rows = local.shape[0] if local.dim() else 1
    row_bytes = max(1, local[0].numel() * local.element_size()) if local.dim() else local.element_size()
    step = max(1, CHUNK_BYTES // row_bytes)
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            if local.dim() == 0:
                local.copy_(handle.get_tensor(name))
            else:
                local[lo:hi].copy_(handle.get_slice(name)[start + lo:start + hi])


# ----------------------------------------------------------------------------------------------------------- writing

@dataclass(frozen=True)
class Placed:
    """Where one tensor's bytes go: file and absolute byte offset of its first element."""

    file: str
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize


@dataclass
class Layout:
    """The files of a checkpoint: their headers and sizes, and where every tensor sits."""

    tensors: dict[str, Placed]
    headers: dict[str, bytes]
    """File name -> the header bytes (length prefix included)."""
    sizes: dict[str, int]
    """File name -> total size in bytes."""
    total_bytes: int
    num_parameters: int


def plan_layout(shapes: Iterable[tuple[str, tuple[int, ...]]], dtype: torch.dtype, *,
                max_file_bytes: int = MAX_FILE_BYTES, metadata: dict[str, str] | None = None) -> Layout:
    """Place the tensors, in the given order, into files of at most `max_file_bytes` (a bigger tensor alone)."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"cannot write {dtype} tensors to safetensors here; use one of {list(DTYPE_NAMES)}")
    groups: list[list[tuple[str, tuple[int, ...], int]]] = [[]]
    used = 0
    for name, shape in shapes:
        shape = tuple(int(d) for d in shape)
        nbytes = dtype.itemsize * math.prod(shape)
        if groups[-1] and used + nbytes > max_file_bytes:
            groups.append([])
            used = 0
        groups[-1].append((name, shape, nbytes))
        used += nbytes
    names = [SINGLE_FILE] if len(groups) == 1 else \
        [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    tensors, headers, sizes = {}, {}, {}
    for file, group in zip(names, groups):
        offsets = list(itertools.accumulate((nbytes for *_, nbytes in group), initial=0))
        table: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        table.update({name: {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [begin, begin + n]}
                      for (name, shape, n), begin in zip(group, offsets)})
        text = json.dumps(table, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        headers[file] = struct.pack("<Q", len(text)) + text
        sizes[file] = len(headers[file]) + offsets[-1]
        tensors.update({name: Placed(file, len(headers[file]) + begin, shape, dtype)
                        for (name, shape, _), begin in zip(group, offsets)})
    total = sum(nbytes for group in groups for *_, nbytes in group)
    return Layout(tensors, headers, sizes, total, total // dtype.itemsize)


def create_files(directory: str | Path, layout: Layout) -> None:
    """Create the (temporary) files with their headers, sized to hold every tensor; remove stale model files."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.iterdir():
        stale = old.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_FILE.fullmatch(old.name)
        if (stale and old.name not in layout.headers) or old.name.endswith(".safetensors" + _PART):
            old.unlink()
    for file, header in layout.headers.items():
        with open(directory / (file + _PART), "wb") as fh:
            fh.write(header)
            fh.truncate(layout.sizes[file])


def write_rows(directory: str | Path, layout: Layout, name: str, start: int, rows: torch.Tensor) -> None:
    """Write `rows` as rows `[start, start + len(rows))` of tensor `name` (converted to the layout's dtype)."""
    placed = layout.tensors[name]
    if rows.dim() == 0:
        rows = rows.reshape(1)
    full_rows = placed.shape[0] if placed.shape else 1
    if tuple(rows.shape[1:]) != placed.shape[1:] or start < 0 or start + rows.shape[0] > full_rows:
        raise ValueError(f"rows {start}..{start + rows.shape[0]} of shape {tuple(rows.shape)} do not fit {name} "
                         f"{placed.shape}")
    step = max(1, CHUNK_BYTES // max(1, placed.row_bytes))
    fd = os.open(Path(directory) / (placed.file + _PART), os.O_WRONLY)
    try:
        for lo in range(0, rows.shape[0], step):
            piece = rows[lo:lo + step].detach().to("cpu", placed.dtype).contiguous()
            data = memoryview(piece.reshape(-1).view(torch.uint8).numpy())
            offset = placed.offset + (start + lo) * placed.row_bytes
            while data:
                written = os.pwrite(fd, data, offset)
                data, offset = data[written:], offset + written
    finally:
        os.close(fd)


def commit(directory: str | Path, layout: Layout) -> None:
    """Rename the written files into place; write the index when there are several."""
    directory = Path(directory)
    for file in layout.headers:
        os.replace(directory / (file + _PART), directory / file)
    if len(layout.headers) > 1:
        index = {"metadata": {"total_parameters": layout.num_parameters, "total_size": layout.total_bytes},
                 "weight_map": {name: placed.file for name, placed in layout.tensors.items()}}
        tmp = directory / (INDEX_FILE + _PART)
        tmp.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, directory / INDEX_FILE)


def write_config(directory: str | Path, model: nn.Module, dtype: torch.dtype, tokenizer: Any = None) -> None:
    """config.json (architecture, saved dtype), generation_config.json if the model generates, the tokenizer."""
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__.removeprefix("FSDP")]
    config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(directory)
    generation = getattr(model, "generation_config", None)
    if generation is not None and getattr(model, "can_generate", lambda: False)():
        generation.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def writes_rows(tensor: torch.Tensor, group_rank: int) -> bool:
    """Whether this rank writes its rows of `tensor`: replica 0 of a DTensor's mesh; group rank 0 for a plain one."""
    if not isinstance(tensor, DTensor):
        return group_rank == 0
    coordinate = tensor.device_mesh.get_coordinate()
    return coordinate is not None and all(c == 0 for c, p in zip(coordinate, tensor.placements)
                                          if isinstance(p, Replicate))


@torch.no_grad()
def save_sharded_pretrained(model: nn.Module, directory: str | Path, *, group: dist.ProcessGroup | None = None,
                            dtype: torch.dtype | None = None, tokenizer: Any = None,
                            max_file_bytes: int = MAX_FILE_BYTES) -> Path:
    """Write `model` as a Hugging Face checkpoint in `dtype` (default: the parameters'), every rank of `group` (one
    federation group) its own rows; its rank 0 writes the headers, the config and the tokenizer."""
    reshard_all(model)
    tensors = saved_tensors(model)
    dtype = dtype or tensors[0][1].dtype
    layout = plan_layout([(n, tuple(t.shape)) for n, t in tensors], dtype, max_file_bytes=max_file_bytes)
    directory = Path(directory)
    rank = dist.get_rank(group)
    if rank == 0:
        create_files(directory, layout)
    dist.barrier(group=group)
    for name, tensor in tensors:
        local = local_shard(tensor)
        if writes_rows(tensor, rank) and local.numel():
            write_rows(directory, layout, name, row_offset(tensor), local)
    dist.barrier(group=group)
    if rank == 0:
        commit(directory, layout)
        write_config(directory, model, dtype, tokenizer)
    dist.barrier(group=group)
    return directory
