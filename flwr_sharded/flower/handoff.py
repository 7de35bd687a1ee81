"""How shards move between a group's ranks, its ClientApp and the Flower server (server path). Torch-free.

    rank r of replica 0 --(safetensors file, its own pieces)--> ClientApp --(ArrayRecord)--> ServerApp
    ServerApp --(ArrayRecord)--> ClientApp --(one safetensors file)--> every rank reads only its own keys

Files are the hand-off because the group's JSON endpoint must not carry arrays (rank 0 would gather the model) and
because each rank can write and read its own pieces without any collective. The files live in the group's hand-off
directory (`--handoff-dir`), which must be visible to the ClientApp and, for a multi-node group, to every node (a
shared filesystem). Arrays are the encoded pieces of `flwr_sharded.parallel.shard_transport` (keys `name@row_offset`,
bf16 as an int16 bit view) and the file's metadata maps each key to `"dtype|global shape"`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

SHARDS = "shards"
"""ArrayRecord of a message's pieces."""
SHARD_META = "shard-meta"
"""ConfigRecord `key -> "dtype|global shape"` of those pieces."""
SHARD_INFO = "shard-info"
"""MetricRecord with the pieces' `round` and `weight`."""


def write_file(path: str | Path, arrays: Mapping[str, np.ndarray], meta: Mapping[str, str]) -> None:
    """Write pieces to `path` atomically (temporary name, then rename), so a reader never sees half a file."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(tmp), metadata=dict(meta))
    os.replace(tmp, path)


def read_files(paths: Iterable[str | Path]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """All pieces of the given files: (arrays, meta). Raises ValueError if two files name the same key."""
    from safetensors import safe_open

    arrays: dict[str, np.ndarray] = {}
    meta: dict[str, str] = {}
    for path in paths:
        with safe_open(str(path), framework="np") as fh:
            file_meta = fh.metadata() or {}
            for key in fh.keys():
                if key in arrays:
                    raise ValueError(f"shard piece {key!r} appears in two hand-off files")
                arrays[key] = fh.get_tensor(key)
                meta[key] = file_meta.get(key, "")
    return arrays, meta


def read_keys(path: str | Path, keys: Iterable[str]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Only the named pieces of one file (what one rank needs); a key missing from the file raises KeyError."""
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as fh:
        file_meta = fh.metadata() or {}
        present = set(fh.keys())
        missing = [k for k in keys if k not in present]
        if missing:
            raise KeyError(f"the server's reply lacks {len(missing)} of this rank's pieces, e.g. {missing[:3]}")
        return {k: fh.get_tensor(k) for k in keys}, {k: file_meta.get(k, "") for k in keys}


def to_records(arrays: Mapping[str, np.ndarray], meta: Mapping[str, str], round: int, weight: float) -> dict[str, Any]:
    """The three records that carry pieces in a Flower Message (merge them into its RecordDict)."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord

    return {SHARDS: ArrayRecord(array_dict={k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()}),
            SHARD_META: ConfigRecord(dict(meta)),
            SHARD_INFO: MetricRecord({"round": int(round), "weight": float(weight)})}


def from_records(content: Any) -> tuple[dict[str, np.ndarray], dict[str, str], dict[str, float]]:
    """(arrays, meta, info) of a RecordDict made by `to_records`; ValueError names what is missing."""
    for name in (SHARDS, SHARD_META, SHARD_INFO):
        if name not in content:
            raise ValueError(f"the message lacks the {name!r} record")
    records = content[SHARDS]
    arrays = {k: records[k].numpy() for k in records.keys()}
    meta = {k: str(v) for k, v in content[SHARD_META].items()}
    info = {k: float(v) for k, v in content[SHARD_INFO].items()}
    return arrays, meta, info


__all__ = ["SHARDS", "SHARD_META", "SHARD_INFO", "write_file", "read_files", "read_keys", "to_records",
           "from_records"]
