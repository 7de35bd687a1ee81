"""How shards move between a group's ranks, its ClientApp and the Flower server (server path). Torch-free.

    rank r of replica 0 --(safetensors file, its own pieces)--> ClientApp --(manifest, then pulled chunks)--> ServerApp
    ServerApp --(chunks)--> ClientApp --(a safetensors file per chunk)--> every rank assembles only its own rows

The server never holds a whole group's model in a message: the train reply carries a manifest (each piece's key,
dtype, global and local shape), the server pulls row ranges in chunks of bounded size (`read_rows`), and sends the
mean back in chunks that the ClientApp writes as they come; each rank then assembles its own pieces from the chunk
files (`assemble`), wherever the server cut them.

Files are the hand-off because the group's JSON endpoint must not carry arrays (rank 0 would gather the model) and
because each rank can write and read its own pieces without any collective. The files live in the group's hand-off
directory (`--handoff-dir`), which must be visible to the ClientApp and, for a multi-node group, to every node (a
shared filesystem). Arrays are the encoded pieces of `flwr_sharded.parallel.shard_transport` (keys `name@row_offset`,
bf16 as an int16 bit view) and the file's metadata maps each key to `"dtype|global shape"`.
"""

from __future__ import annotations

import os
import stat
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import numpy as np

from flwr_sharded.errors import ConfigError

SHARDS = "shards"
"""ArrayRecord of a message's pieces."""
SHARD_META = "shard-meta"
"""ConfigRecord `key -> "dtype|global shape"` of those pieces."""
SHARD_INFO = "shard-info"
"""MetricRecord with the pieces' `round` and `weight`."""
SHARD_SHAPES = "shard-shapes"
"""ConfigRecord `key -> "d0,d1,..."` (local shapes) of a manifest: the pieces a group holds, without their values."""


def private_dir(path: str | Path) -> Path:
    """`path` as a directory only this user can enter: made with mode 700 if missing (its parent must exist). An
    existing one must be a real directory (not a link) owned by this user that nobody else may write to (someone who
    can could swap the files in it: keys, shards); ConfigError otherwise. One that others may read is made 700."""
    path = Path(path)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{path} exists and is not a directory (a link or a file); remove it or choose another")
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise ConfigError(f"directory {path} is not private to this user (owner uid {info.st_uid}, mode "
                          f"{info.st_mode & 0o777:03o}: others may write to it); use a directory of your own with "
                          f"mode 700 or remove it")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def fresh_private_dir(prefix: str, parent: str | Path | None = None) -> str:
    """A new directory (mode 700, never one that existed before: `mkdtemp`) under `parent` (default: the temp dir);
    ConfigError if `parent` is not a directory this user can create one in."""
    try:
        return tempfile.mkdtemp(prefix=prefix, dir=None if parent is None else str(parent))
    except OSError as exc:
        raise ConfigError(f"cannot make a private directory under {parent or tempfile.gettempdir()}: {exc}; it must "
                          f"be an existing directory this user can write to") from None


def _shape_text(shape: Iterable[int]) -> str:
    return ",".join(str(int(d)) for d in shape)


def parse_shape(text: str) -> tuple[int, ...]:
    """Inverse of the manifest's shape text ('' is a scalar)."""
    return tuple(int(d) for d in text.split(",")) if text else ()


def row_key(key: str, start: int) -> str:
    """The key of the rows from `start` on of piece `key` (`name@offset` -> `name@offset+start`)."""
    name, _, offset = key.rpartition("@")
    return f"{name}@{int(offset) + start}"


def write_file(path: str | Path, arrays: Mapping[str, np.ndarray], meta: Mapping[str, str]) -> None:
    """Write pieces to `path` atomically (temporary name, then rename), so a reader never sees half a file."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(tmp), metadata=dict(meta))
    os.replace(tmp, path)


def _each_piece(paths: Iterable[str | Path]) -> Iterator[tuple[Any, str, str]]:
    """(open file, key, its "dtype|global shape") of every piece of the files; ValueError for a key seen twice."""
    from safetensors import safe_open

    seen: set[str] = set()
    for path in paths:
        with safe_open(str(path), framework="np") as fh:
            file_meta = fh.metadata() or {}
            for key in fh.keys():
                if key in seen:
                    raise ValueError(f"shard piece {key!r} appears in two hand-off files")
                seen.add(key)
                yield fh, key, file_meta.get(key, "")


def manifest(paths: Iterable[str | Path]) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """(key -> local shape, key -> "dtype|global shape") of the pieces in the given files, reading no values."""
    shapes: dict[str, tuple[int, ...]] = {}
    meta: dict[str, str] = {}
    for fh, key, tag in _each_piece(paths):
        shapes[key], meta[key] = tuple(fh.get_slice(key).get_shape()), tag
    return shapes, meta


def read_rows(paths: Iterable[str | Path], requests: Iterable[tuple[str, int, int]]
              ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Rows `[start, stop)` of each requested piece `(key, start, stop)`, keyed by where they start (`row_key`).

    Reads only those rows. KeyError for a key no file holds, ValueError for rows outside the piece.
    """
    from safetensors import safe_open

    wanted: dict[str, list[tuple[int, int]]] = {}
    for key, start, stop in requests:
        wanted.setdefault(key, []).append((int(start), int(stop)))
    arrays: dict[str, np.ndarray] = {}
    meta: dict[str, str] = {}
    for path in paths:
        with safe_open(str(path), framework="np") as fh:
            file_meta = fh.metadata() or {}
            for key in wanted.keys() & set(fh.keys()):
                piece = fh.get_slice(key)
                rows = (piece.get_shape() or [1])[0]
                for start, stop in wanted.pop(key):
                    if not 0 <= start < stop <= rows:
                        raise ValueError(f"rows [{start}, {stop}) are outside piece {key!r} ({rows} rows)")
                    out = row_key(key, start)
                    arrays[out] = fh.get_tensor(key) if not piece.get_shape() else piece[start:stop]
                    meta[out] = file_meta.get(key, "")
    if wanted:
        raise KeyError(f"no hand-off file holds {len(wanted)} requested piece(s), e.g. {sorted(wanted)[:3]}")
    return arrays, meta


def assemble(paths: Iterable[str | Path], pieces: Mapping[str, int]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The pieces `key -> rows` one rank needs, each cut and put together from the files' pieces of that parameter.

    The files may cut a parameter anywhere (another group's sharding, the server's chunks): piece `name@offset`
    with n rows is read from the file pieces `name@o` that overlap `[offset, offset + n)`, which must cover it
    without gap or overlap and agree on dtype and global shape (KeyError otherwise). Only those rows are read.
    """
    from safetensors import safe_open

    paths = [str(p) for p in paths]
    where: dict[str, list[tuple[int, int, int, str]]] = {}  # name -> (offset, rows, file index, key)
    meta: dict[str, str] = {}
    for i, path in enumerate(paths):
        with safe_open(path, framework="np") as fh:
            file_meta = fh.metadata() or {}
            for key in fh.keys():
                name, _, offset = key.rpartition("@")
                shape = fh.get_slice(key).get_shape()
                where.setdefault(name, []).append((int(offset), shape[0] if shape else 1, i, key))
                meta[key] = file_meta.get(key, "")
    plan: dict[str, list[tuple[int, str, int, int]]] = {}  # key -> (file index, file key, start, stop)
    for key, rows in pieces.items():
        name, _, offset_text = key.rpartition("@")
        begin, end = int(offset_text), int(offset_text) + rows
        covered, chosen = begin, []
        for start, n, index, part in sorted(p for p in where.get(name, []) if p[0] < end and p[0] + p[1] > begin):
            if start > covered or start + n <= covered or (chosen and meta[part] != meta[chosen[0][1]]):
                break
            chosen.append((index, part, covered - start, min(end, start + n) - start))
            covered = min(end, start + n)
        if covered != end:
            raise KeyError(f"the server's pieces do not cover this rank's piece {key!r} (rows {begin} to {end}): "
                           f"covered up to row {covered}")
        plan[key] = chosen
    arrays: dict[str, np.ndarray] = {}
    out_meta: dict[str, str] = {}
    with ExitStack() as stack:
        opened = [stack.enter_context(safe_open(p, framework="np")) for p in paths]
        for key, chosen in plan.items():
            parts = []
            for index, part, start, stop in chosen:
                piece = opened[index].get_slice(part)
                parts.append(piece[start:stop] if piece.get_shape() else opened[index].get_tensor(part))
            arrays[key] = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
            out_meta[key] = meta[chosen[0][1]]
    return arrays, out_meta


def to_records(arrays: Mapping[str, np.ndarray], meta: Mapping[str, str], round: int, weight: float) -> dict[str, Any]:
    """The three records that carry pieces in a Flower Message (merge them into its RecordDict)."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord

    return {SHARDS: ArrayRecord(array_dict={k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()}),
            SHARD_META: ConfigRecord(dict(meta)),
            SHARD_INFO: MetricRecord({"round": int(round), "weight": float(weight)})}


def array_view(array: Any) -> np.ndarray:
    """A read-only NumPy view of a Flower `Array`'s bytes, without the copy `Array.numpy()` makes.

    Only plain .npy data (no pickled objects) is accepted; ValueError otherwise.
    """
    from io import BytesIO

    from numpy.lib import format as npy

    if getattr(array, "stype", "") != "numpy.ndarray":
        raise ValueError(f"array of serialization type {getattr(array, 'stype', '?')!r}, expected numpy.ndarray")
    data = array.data
    header = BytesIO(data)
    version = npy.read_magic(header)
    read_header = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
    shape, fortran, dtype = read_header(header)
    if dtype.hasobject:
        raise ValueError("object arrays are not accepted")
    count = int(np.prod(shape, dtype=np.int64))
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=header.tell())
    return flat.reshape(shape, order="F" if fortran else "C")


def from_records(content: Any) -> tuple[dict[str, np.ndarray], dict[str, str], dict[str, float]]:
    """(arrays, meta, info) of a RecordDict made by `to_records`; ValueError names what is missing."""
    for name in (SHARDS, SHARD_META, SHARD_INFO):
        if name not in content:
            raise ValueError(f"the message lacks the {name!r} record")
    records = content[SHARDS]
    arrays = {k: array_view(records[k]) for k in records.keys()}
    meta = {k: str(v) for k, v in content[SHARD_META].items()}
    info = {k: float(v) for k, v in content[SHARD_INFO].items()}
    return arrays, meta, info


def manifest_records(shapes: Mapping[str, Iterable[int]], meta: Mapping[str, str], round: int,
                     weight: float) -> dict[str, Any]:
    """The records that announce pieces without their values (a train reply of the server path)."""
    from flwr.app import ConfigRecord, MetricRecord

    return {SHARD_SHAPES: ConfigRecord({k: _shape_text(v) for k, v in shapes.items()}),
            SHARD_META: ConfigRecord(dict(meta)),
            SHARD_INFO: MetricRecord({"round": int(round), "weight": float(weight)})}


def from_manifest_records(content: Any) -> tuple[dict[str, tuple[int, ...]], dict[str, str], dict[str, float]]:
    """(shapes, meta, info) of a RecordDict made by `manifest_records`; ValueError names what is missing or odd."""
    for name in (SHARD_SHAPES, SHARD_META, SHARD_INFO):
        if name not in content:
            raise ValueError(f"the message lacks the {name!r} record")
    shapes = {k: parse_shape(str(v)) for k, v in content[SHARD_SHAPES].items()}
    meta = {k: str(v) for k, v in content[SHARD_META].items()}
    if shapes.keys() != meta.keys():
        raise ValueError(f"{SHARD_SHAPES!r} and {SHARD_META!r} name different pieces")
    info = {k: float(v) for k, v in content[SHARD_INFO].items()}
    return shapes, meta, info


__all__ = ["private_dir", "fresh_private_dir", "SHARDS", "SHARD_META", "SHARD_INFO", "SHARD_SHAPES", "write_file",
           "manifest", "read_rows", "assemble", "row_key", "parse_shape", "to_records", "from_records",
           "manifest_records", "from_manifest_records", "array_view"]
