"""The server path's shard files and the Flower records that carry their pieces. Torch-free.

    each rank of replica 0 --(a file of its pieces)--> ClientApp --(manifest, then pulled rows)--> ServerApp
    ServerApp --(chunks of the mean)--> ClientApp --(a file per chunk)--> each rank assembles its own rows

Files, because the group's endpoint carries no arrays (rank 0 would gather the model) and each rank reads and writes
its own pieces without a collective. They live in the group's private hand-off directory (`--handoff-dir`), which
the ClientApp and every node of the group must see. Keys are `name@row_offset`; a file's metadata maps each key to
`"dtype|global shape"` (the encoding of `flwr_sharded.parallel.shard_transport`).
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from io import BytesIO
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord
from numpy.lib import format as npy_format
from safetensors import safe_open
from safetensors.numpy import save_file

SHARDS = "shards"
"""ArrayRecord of a message's pieces."""
SHARD_META = "shard-meta"
"""ConfigRecord `key -> "dtype|global shape"` of those pieces."""
SHARD_INFO = "shard-info"
"""MetricRecord with the pieces' `round` and `weight`."""
SHARD_SHAPES = "shard-shapes"
"""ConfigRecord `key -> "d0,d1,..."` (local shapes) of a manifest: the pieces a group holds, without their values."""


def row_key(key: str, start: int) -> str:
    """The key of the rows from `start` on of piece `key` (`name@offset` -> `name@offset+start`)."""
    name, _, offset = key.rpartition("@")
    return f"{name}@{int(offset) + start}"


def write_file(path: str | Path, arrays: Mapping[str, np.ndarray], meta: Mapping[str, str]) -> None:
    """Write pieces to `path` atomically (temporary name, then rename), so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(tmp), metadata=dict(meta))
    os.replace(tmp, path)


def _open_pieces(stack: ExitStack, paths: Iterable[str | Path]) -> dict[str, tuple[Any, str]]:
    """key -> (its open file, its "dtype|global shape") of every piece of the files; ValueError for a key in two."""
    found: dict[str, tuple[Any, str]] = {}
    for path in paths:
        fh = stack.enter_context(safe_open(str(path), framework="np"))
        file_meta = fh.metadata() or {}
        for key in fh.keys():
            if key in found:
                raise ValueError(f"shard piece {key!r} appears in two hand-off files")
            found[key] = (fh, file_meta.get(key, ""))
    return found


def _rows(fh: Any, key: str, start: int, stop: int) -> np.ndarray:
    piece = fh.get_slice(key)
    return piece[start:stop] if piece.get_shape() else fh.get_tensor(key)


def shard_manifest(paths: Iterable[str | Path]) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """(key -> local shape, key -> "dtype|global shape") of the pieces in the files, reading no values."""
    with ExitStack() as stack:
        found = _open_pieces(stack, paths)
        return ({k: tuple(fh.get_slice(k).get_shape()) for k, (fh, _) in found.items()},
                {k: tag for k, (_, tag) in found.items()})


def read_shard_rows(paths: Iterable[str | Path], requests: Iterable[tuple[str, int, int]]
                    ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Rows `[start, stop)` of each requested piece `(key, start, stop)`, keyed by where they start (`row_key`),
    reading only those rows. KeyError for a key no file holds, ValueError for rows outside the piece."""
    requests = list(requests)
    with ExitStack() as stack:
        found = _open_pieces(stack, paths)
        missing = sorted({key for key, _, _ in requests} - set(found))
        if missing:
            raise KeyError(f"no hand-off file holds {len(missing)} requested piece(s), e.g. {missing[:3]}")
        arrays: dict[str, np.ndarray] = {}
        meta: dict[str, str] = {}
        for key, start, stop in requests:
            fh, tag = found[key]
            rows = (fh.get_slice(key).get_shape() or [1])[0]
            if not 0 <= int(start) < int(stop) <= rows:
                raise ValueError(f"rows [{start}, {stop}) are outside piece {key!r} ({rows} rows)")
            arrays[row_key(key, int(start))] = _rows(fh, key, int(start), int(stop))
            meta[row_key(key, int(start))] = tag
    return arrays, meta


def assemble(paths: Iterable[str | Path], pieces: Mapping[str, int]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The pieces `key -> rows` one rank needs, each put together from the files' pieces of that parameter, which
    may be cut anywhere (another group's sharding, the server's chunks) but must cover it without gap or overlap
    and agree on dtype and global shape (KeyError otherwise). Only those rows are read."""
    with ExitStack() as stack:
        found = _open_pieces(stack, paths)
        where: dict[str, list[tuple[int, int, str]]] = {}  # name -> (offset, rows, key)
        for key, (fh, _) in found.items():
            name, _, offset = key.rpartition("@")
            shape = fh.get_slice(key).get_shape()
            where.setdefault(name, []).append((int(offset), shape[0] if shape else 1, key))
        arrays: dict[str, np.ndarray] = {}
        meta: dict[str, str] = {}
        for key, rows in pieces.items():
            name, _, offset = key.rpartition("@")
            begin, end = int(offset), int(offset) + rows
            covered, parts = begin, []
            for start, n, part in sorted(p for p in where.get(name, []) if p[0] < end and p[0] + p[1] > begin):
                if start > covered or start + n <= covered or (parts and found[part][1] != meta[key]):
                    break
                meta[key] = found[part][1]
                parts.append(_rows(found[part][0], part, covered - start, min(end, start + n) - start))
                covered = min(end, start + n)
            if covered != end:
                raise KeyError(f"the server's pieces do not cover this rank's piece {key!r} (rows {begin} to {end}): "
                               f"covered up to row {covered}")
            arrays[key] = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
    return arrays, meta


def _info(round: int, weight: float) -> MetricRecord:
    return MetricRecord({"round": int(round), "weight": float(weight)})


def shard_records(arrays: Mapping[str, np.ndarray], meta: Mapping[str, str], round: int,
                  weight: float) -> dict[str, Any]:
    """The records that carry pieces in a Flower Message (merge them into its RecordDict)."""
    return {SHARDS: ArrayRecord(array_dict={k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()}),
            SHARD_META: ConfigRecord(dict(meta)), SHARD_INFO: _info(round, weight)}


def manifest_records(shapes: Mapping[str, Iterable[int]], meta: Mapping[str, str], round: int,
                     weight: float) -> dict[str, Any]:
    """The records that announce pieces without their values (a train reply of the server path)."""
    return {SHARD_SHAPES: ConfigRecord({k: ",".join(str(int(d)) for d in v) for k, v in shapes.items()}),
            SHARD_META: ConfigRecord(dict(meta)), SHARD_INFO: _info(round, weight)}


def _unpack(content: Any, first: str) -> tuple[Any, dict[str, str], dict[str, float]]:
    """(the `first` record, meta, info) of a RecordDict; ValueError names a missing record."""
    for name in (first, SHARD_META, SHARD_INFO):
        if name not in content:
            raise ValueError(f"the message lacks the {name!r} record")
    return (content[first], {k: str(v) for k, v in content[SHARD_META].items()},
            {k: float(v) for k, v in content[SHARD_INFO].items()})


def from_records(content: Any) -> tuple[dict[str, np.ndarray], dict[str, str], dict[str, float]]:
    """(arrays, meta, info) of a RecordDict made by `shard_records`; ValueError names what is missing."""
    records, meta, info = _unpack(content, SHARDS)
    return {k: array_view(records[k]) for k in records.keys()}, meta, info


def from_manifest_records(content: Any) -> tuple[dict[str, tuple[int, ...]], dict[str, str], dict[str, float]]:
    """(shapes, meta, info) of a RecordDict made by `manifest_records`; ValueError names what is missing or odd."""
    records, meta, info = _unpack(content, SHARD_SHAPES)
    shapes = {k: tuple(int(d) for d in str(v).split(",")) if str(v) else () for k, v in records.items()}
    if shapes.keys() != meta.keys():
        raise ValueError(f"{SHARD_SHAPES!r} and {SHARD_META!r} name different pieces")
    return shapes, meta, info


def array_view(array: Any) -> np.ndarray:
    """A read-only NumPy view of a Flower `Array`'s bytes, without the copy `Array.numpy()` makes; ValueError for
    anything but plain .npy data (no pickled objects)."""
    if getattr(array, "stype", "") != "numpy.ndarray":
        raise ValueError(f"array of serialization type {getattr(array, 'stype', '?')!r}, expected numpy.ndarray")
    header = BytesIO(array.data)
    version = npy_format.read_magic(header)
    read_header = npy_format.read_array_header_1_0 if version == (1, 0) else npy_format.read_array_header_2_0
    shape, fortran, dtype = read_header(header)
    if dtype.hasobject:
        raise ValueError("object arrays are not accepted")
    flat = np.frombuffer(array.data, dtype=dtype, count=int(np.prod(shape, dtype=np.int64)), offset=header.tell())
    return flat.reshape(shape, order="F" if fortran else "C")
