"""Writing a Hugging Face safetensors checkpoint row range by row range, every rank its own rows, so that no rank
holds the model, in the layout the family's `save_pretrained` writes (`hf_conversion.published_layout`). A file is an
8-byte header length, a JSON header (each tensor's dtype, shape and byte range, padded to 8 bytes) and the tensors'
bytes, row-major, so the layout follows from names, shapes and dtype alone (`plan_layout`): one writer creates the
files (`create_files`), any process writes any rows at their offset (`write_rows`; a model tensor's rows into the
checkpoint tensors it is made of: `write_local`), and the files are renamed into place (`commit`), with
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

from flwr_sharded.parallel.alignment import local_shard
from flwr_sharded.parallel.shard_transport import row_offset
from flwr_sharded.parallel.sharding import reshard_all
from flwr_sharded.training.hf_conversion import StoredPart, published_layout
from flwr_sharded.training.hf_reader import CHUNK_BYTES, DTYPE_NAMES, INDEX_FILE, SINGLE_FILE
from flwr_sharded.training.models import saved_tensors

MAX_FILE_BYTES = 50_000_000_000
"""Split the tensors into files of at most this many bytes (Hugging Face's default `max_shard_size`, "50GB")."""
_PART = ".part"
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


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


def write_rows(directory: str | Path, layout: Layout, name: str, start: int, rows: torch.Tensor, *,
               column: int | None = None) -> None:
    """Write `rows` as rows `[start, start + len(rows))` of tensor `name` (converted to the layout's dtype); with
    `column`, as columns `[column, column + rows.shape[1])` of those rows of a 2-D tensor (one write per row)."""
    placed = layout.tensors[name]
    if rows.dim() == 0:
        rows = rows.reshape(1)
    full_rows = placed.shape[0] if placed.shape else 1
    inner = placed.shape[1:] if column is None or len(placed.shape) != 2 else (placed.shape[1] - column,)
    fits = tuple(rows.shape[1:]) == inner if column is None else \
        len(placed.shape) == 2 and rows.dim() == 2 and 0 <= column and rows.shape[1] <= inner[0]
    if not fits or start < 0 or start + rows.shape[0] > full_rows:
        raise ValueError(f"rows {start}..{start + rows.shape[0]} of shape {tuple(rows.shape)}"
                         f"{'' if column is None else f' at column {column}'} do not fit {name} {placed.shape}")
    span = rows[0].numel() * placed.dtype.itemsize
    step = max(1, CHUNK_BYTES // max(1, span))
    fd = os.open(Path(directory) / (placed.file + _PART), os.O_WRONLY)
    try:
        for lo in range(0, rows.shape[0], step):
            piece = rows[lo:lo + step].detach().to("cpu", placed.dtype).contiguous()
            if column is None:
                _pwrite(fd, piece, placed.offset + (start + lo) * placed.row_bytes)
            else:
                skip = column * placed.dtype.itemsize
                for i, row in enumerate(piece):
                    _pwrite(fd, row, placed.offset + (start + lo + i) * placed.row_bytes + skip)
    finally:
        os.close(fd)


def _pwrite(fd: int, tensor: torch.Tensor, offset: int) -> None:
    """Write a contiguous CPU tensor's bytes at `offset`."""
    data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


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


def write_local(directory: str | Path, layout: Layout, pieces: list[StoredPart], local: torch.Tensor,
                start: int) -> None:
    """Write rows `[start, start + len(local))` of a model tensor into the checkpoint tensors it is made of."""
    rows = local.shape[0] if local.dim() else 1
    for piece in pieces:
        if piece.transposed:  # the rows are the checkpoint's columns [start, start + rows)
            write_rows(directory, layout, piece.stored, 0, local.T, column=start)
            continue
        hit = piece.in_rows(layout.tensors[piece.stored].shape, start, start + rows)
        if hit is not None:
            where, first, _ = hit
            write_rows(directory, layout, piece.stored, first, local[where] if where else local)


@torch.no_grad()
def save_sharded_pretrained(model: nn.Module, directory: str | Path, *, group: dist.ProcessGroup | None = None,
                            dtype: torch.dtype | None = None, tokenizer: Any = None,
                            max_file_bytes: int = MAX_FILE_BYTES) -> Path:
    """Write `model` as a Hugging Face checkpoint in `dtype` (default: the parameters') in the layout the family's
    `save_pretrained` writes (`published_layout`), every rank of `group` (one federation group) its own rows; its rank
    0 writes the headers, the config and the tokenizer."""
    reshard_all(model)
    tensors = saved_tensors(model)
    dtype = dtype or tensors[0][1].dtype
    shapes, plan = published_layout(model)
    layout = plan_layout(shapes, dtype, max_file_bytes=max_file_bytes)
    directory = Path(directory)
    rank = dist.get_rank(group)
    if rank == 0:
        create_files(directory, layout)
    dist.barrier(group=group)
    for name, tensor in tensors:
        local = local_shard(tensor)
        if writes_rows(tensor, rank) and local.numel():
            write_local(directory, layout, plan[name], local, row_offset(tensor))
    dist.barrier(group=group)
    if rank == 0:
        commit(directory, layout)
        write_config(directory, model, dtype, tokenizer)
    dist.barrier(group=group)
    return directory
