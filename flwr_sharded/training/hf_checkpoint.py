"""Hugging Face safetensors checkpoints, read and written row range by row range, so that no rank holds the model.

Reading (`model.safetensors`, or the files of its index; a hub id is downloaded first): the checkpoint's names and
layout are those `from_pretrained` reads, through transformers' own conversion mapping (key renames, per-expert
tensors fused into 3-D ones), planned from the headers alone (`conversion_plan`: each model tensor as the checkpoint
tensors it is made of); `check_pretrained` checks the plan against the model of its `config.json` before any process
group exists, and `load_local_shards` reads each rank's own rows through it. Writing is in the layout the family's
`save_pretrained` writes (`published_layout`, the mapping reversed): a file is an 8-byte header length, a JSON
header (each tensor's dtype, shape and byte range, padded to 8 bytes) and the tensors' bytes, row-major, so the
layout follows from names, shapes and dtype alone (`plan_layout`): one writer creates the files (`create_files`), any
process writes any rows at their offset (`write_rows`), and the files are renamed into place (`commit`), with
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


@dataclass(frozen=True)
class StoredPart:
    """One checkpoint tensor inside a model tensor: `model_tensor[index]` is `stored`, whole (`index`: an int for each
    dimension the tensor is stacked along, a slice for each of the others, one entry per model dimension), or its
    transpose (`transposed`: a 2-D tensor alone, the model's row r its column r)."""

    stored: str
    index: tuple[int | slice, ...]
    transposed: bool = False


Plan = dict[str, list[StoredPart]]
"""Model tensor name -> the checkpoint tensors it is made of (one, or several a conversion fuses)."""

ROW_WISE_OPS = ("MergeModulelist", "Concatenate")
"""The conversions of transformers' mapping that are read row by row: stacking per-expert tensors (a model row of a
3-D expert tensor is one expert) and concatenating along any dimension (each model row is a row of one source, or
the concatenation of the same row of each)."""
COLUMN_OPS = ("Transpose",)
"""The conversion that is not row-wise but is read (and written) with bounded memory: a 2-D tensor's transpose, whose
model rows are checkpoint columns, read in pieces of checkpoint rows, each cut to the rank's columns."""


def _full(shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in shape)


def _shift(entry: int | slice, offset: int) -> int | slice:
    return entry + offset if isinstance(entry, int) else slice(entry.start + offset, entry.stop + offset)


def _assemble(converter: Any, target: str, sources: dict[str, list[str]], shapes: dict[str, tuple[int, ...]],
              expected: tuple[int, ...] | None) -> tuple[tuple[int, ...], list[StoredPart]]:
    """(shape, pieces) of `target` (model shape `expected`) as transformers' `converter` builds it from the checkpoint
    keys `sources` (by source pattern, in checkpoint order); ConfigError for an operation that is neither row-wise
    (`ROW_WISE_OPS`) nor a transpose (`COLUMN_OPS`)."""
    parts = {pattern: [(shapes[k], [StoredPart(k, _full(shapes[k]))]) for k in keys]
             for pattern, keys in sources.items()}
    for op in converter.operations:
        kind, dim = type(op).__name__, getattr(op, "dim", 0)
        if kind == "MergeModulelist":
            for pattern, group in parts.items():
                _check_numbered(target, pattern, sources.get(pattern, []))
                if len({shape for shape, _ in group}) != 1:
                    raise ConfigError(f"--model: {target} stacks tensors of different shapes "
                                      f"({sorted({shape for shape, _ in group})})")
                shape = group[0][0]
                pieces = [StoredPart(p.stored, p.index[:dim] + (i,) + p.index[dim:])
                          for i, (_, ps) in enumerate(group) for p in ps]
                parts[pattern] = [(shape[:dim] + (len(group),) + shape[dim:], pieces)]
        elif kind == "Concatenate":
            group = [part for pattern in converter.source_patterns for part in parts.get(pattern, [])]
            if len({shape[:dim] + shape[dim + 1:] for shape, _ in group}) != 1:
                raise ConfigError(f"--model: {target} concatenates tensors of incompatible shapes "
                                  f"({[list(shape) for shape, _ in group]})")
            offset, pieces = 0, []
            for shape, ps in group:
                pieces += [StoredPart(p.stored, p.index[:dim] + (_shift(p.index[dim], offset),) + p.index[dim + 1:])
                           for p in ps]
                offset += shape[dim]
            parts = {converter.target_patterns[0]: [(group[0][0][:dim] + (offset,) + group[0][0][dim + 1:], pieces)]}
        elif kind == "Transpose" and _transposable(parts, op):
            [(pattern, [(shape, [piece])])] = parts.items()
            if not (op.check_dims and shape == expected):  # check_dims: transformers transposes only a misfit
                parts = {pattern: [(shape[::-1], [StoredPart(piece.stored, _full(shape[::-1]), transposed=True)])]}
        else:
            raise ConfigError(f"--model: {target} is converted from {sorted(sources)} by transformers' {kind}, which "
                              f"the sharded loader does not read (it reads {', '.join(ROW_WISE_OPS)} row by row and "
                              f"a 2-D tensor's {', '.join(COLUMN_OPS)} column by column)")
    result = [part for group in parts.values() for part in group]
    if len(result) != 1:
        raise ConfigError(f"--model: {target}: its conversion leaves {len(result)} tensors, not one")
    return result[0]


def _check_numbered(target: str, pattern: str, keys: list[str]) -> None:
    """Tensors stacked by the number in their pattern's `*` (experts: the key's last numeric segment, after the
    layer's) must be numbered 0, 1, ... in order, as stacking them in key order assumes."""
    numbers = [[int(part) for part in key.split(".") if part.isdigit()] for key in keys]
    if "*" not in pattern or not all(numbers):
        return
    found = [n[-1] for n in numbers]
    if found != list(range(len(keys))):
        raise ConfigError(f"--model: {target} stacks the checkpoint's {pattern} numbered {found}, not 0 to "
                          f"{len(keys) - 1}")


def _transposable(parts: dict[str, list[tuple[tuple[int, ...], list[StoredPart]]]], op: Any) -> bool:
    """Whether a Transpose applies to one whole 2-D checkpoint tensor (the one transpose read column by column)."""
    group = [part for parts_of in parts.values() for part in parts_of]
    if len(group) != 1 or len(group[0][1]) != 1 or {op.dim0 % 2, op.dim1 % 2} != {0, 1}:
        return False
    shape, [piece] = group[0]
    return len(shape) == 2 and not piece.transposed and piece.index == _full(shape)


def _conversions(model: nn.Module, *, legacy: bool) -> tuple[list[Any], list[Any]]:
    """(renamings, converters): transformers' own conversion mapping of `model`'s class and model type, as
    `from_pretrained` (`legacy`: with its legacy renamings) or `save_pretrained` (without) applies it."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    transforms = get_model_conversion_mapping(model, add_legacy=legacy)
    return ([t for t in transforms if isinstance(t, WeightRenaming)],
            [t for t in transforms if isinstance(t, WeightConverter)])


def conversion_plan(model: nn.Module, stored: dict[str, tuple[int, ...]], where: str = "") -> tuple[Plan, list[str]]:
    """(plan, unexpected): each model tensor's checkpoint tensors, named and converted as `from_pretrained` does
    (transformers' conversion mapping: key renames, per-expert tensors fused; `model`: an unwrapped model, e.g. on
    meta), and the checkpoint tensors no model tensor takes. ConfigError for a shape that does not fit or a conversion
    that is not row-wise. `where` names the checkpoint in errors."""
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    need, may = expected_tensors(model)
    targets: dict[str, tuple[int, ...] | None] = {**may, **need}
    present = {k: v if v is not None else () for k, v in targets.items()}  # what transformers' lookup needs
    renamings, converters = _conversions(model, legacy=True)
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", None)
    plan: Plan = {}
    fused: dict[str, tuple[Any, dict[str, list[str]]]] = {}
    unexpected = []
    for key in sorted(stored, key=dot_natural_key):
        name, pattern = rename_source_key(key, renamings, converters, prefix, present)
        if name not in targets and key in targets:  # as from_pretrained: a name that needs no renaming
            name, pattern = key, None
        if name not in targets:
            if not (ignored(model, key) or ignored(model, name)):
                unexpected.append(key)
        elif name in plan:
            raise ConfigError(f"--model: the checkpoint{where} holds {name} twice ({plan[name][0].stored}, {key})")
        elif pattern is None:
            plan[name] = [StoredPart(key, _full(stored[key]))]
        else:
            fused.setdefault(name, (by_pattern[pattern], {}))[1].setdefault(pattern, []).append(key)
    wrong = []
    for name, (converter, sources) in fused.items():
        if name in plan:
            raise ConfigError(f"--model: the checkpoint{where} holds {name} both whole and as {sorted(sources)}")
        shape, pieces = _assemble(converter, name, sources, stored, targets[name])
        plan[name] = pieces
        if targets[name] is not None and shape != targets[name]:
            wrong.append(f"{name}: checkpoint {list(shape)} (from {len(pieces)} tensors) != model "
                         f"{list(targets[name])}")
    wrong = [f"{n}: checkpoint {list(stored[p[0].stored])} != model {list(targets[n])}" for n, p in plan.items()
             if n not in fused and targets[n] is not None and stored[p[0].stored] != targets[n]] + wrong
    if wrong:
        raise ConfigError(f"{_mismatch(model, where)}: {len(wrong)} shape mismatch(es), e.g. {'; '.join(wrong[:3])}")
    return plan, unexpected


def _mismatch(model: nn.Module, where: str) -> str:
    return f"--model: the checkpoint{where} does not match its {type(model).__name__} " \
           f"({getattr(model.config, 'model_type', '?')}) architecture"


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
    mismatch = _mismatch(model, f" in {directory}")
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


def reference_model(model: nn.Module) -> nn.Module:
    """`model`'s architecture on the meta device, unwrapped (FSDP renames the classes transformers' mapping is keyed
    by): what the conversion plans are made from."""
    return build_meta_model(model.config)


def _overlap(index: tuple[int | slice, ...], shape: tuple[int, ...], lo: int,
             hi: int) -> tuple[tuple[int | slice, ...], int, int] | None:
    """Where a piece at `index` meets rows `[lo, hi)` of its model tensor: (index into the local rows, the piece's
    first and last + 1 row), or None. Scalars: rows `[0, 1)`."""
    if not index:
        return ((), 0, 1) if lo == 0 else None
    first = index[0]
    if isinstance(first, int):
        if not lo <= first < hi:
            return None
        return (first - lo, *index[1:]), 0, shape[0] if shape else 1
    a, b = max(lo, first.start), min(hi, first.stop)
    if a >= b:
        return None
    return (slice(a - lo, b - lo), *index[1:]), a - first.start, b - first.start


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
        hit = _overlap(piece.index, stored[piece.stored].shape, start, start + rows)
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
        hit = _overlap(piece.index, layout.tensors[piece.stored].shape, start, start + rows)
        if hit is not None:
            where, first, _ = hit
            write_rows(directory, layout, piece.stored, first, local[where] if where else local)


def published_layout(model: nn.Module) -> tuple[list[tuple[str, tuple[int, ...]]], Plan]:
    """(names and shapes, plan): the tensors `save_pretrained` writes for `model`, in the family's published layout
    (transformers' conversion mapping reversed, as `save_pretrained` does: e.g. GPT-NeoX's `embed_out.weight`,
    Mixtral's per-expert `block_sparse_moe.experts.{i}.w1.weight`), found on meta tensors, and the plan that reads
    them back (`conversion_plan`): which rows of which model tensor each is."""
    from transformers.core_model_loading import revert_weight_conversion

    reference = reference_model(model)
    tensors = saved_tensors(reference)
    try:
        reverted = revert_weight_conversion(reference, {n: torch.empty(t.shape, device="meta") for n, t in tensors})
    except (ValueError, RuntimeError, NotImplementedError) as exc:  # an operation without a reverse, or not on meta
        raise ConfigError(f"--model: cannot plan {type(reference).__name__}'s published layout (transformers' reverse "
                          f"conversion): {exc}") from exc
    shapes = [(name, tuple(t.shape)) for name, t in reverted.items()]
    plan, unexpected = conversion_plan(reference, dict(shapes), " save_pretrained writes")
    missing = sorted({name for name, _ in tensors} - set(plan))
    if missing or unexpected:
        raise ConfigError(f"--model: {type(reference).__name__}'s published layout does not read back: "
                          f"{missing[:3]} missing, {unexpected[:3]} unexpected")
    return shapes, plan


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
