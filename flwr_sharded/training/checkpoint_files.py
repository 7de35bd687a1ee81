"""A checkpoint's files: written fsync'd, listed by size in the manifest of its `meta.json` (written last, at the
commit) and checked against it, and DCP's `.metadata` read without running code. Sizes catch truncated and missing
files (a full disk, a killed writer, a partial copy); a same-size corruption shows only when the load fails (DCP
keeps no checksums), which resume also treats as "not usable".
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import pickle
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from flwr_sharded.parallel.torch_compat import dcp_metadata_path

META_FILE = "meta.json"


def fsync_dir(path: str | Path) -> None:
    """Persist a directory's entries (files created, renamed or removed in it) where the file system can."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_bytes(path: str | Path, write: Callable[[Any], None]) -> None:
    """Create `path`, let `write(file)` fill it, then flush and fsync it before returning."""
    with open(path, "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())


def save_tensors(obj: Any, path: str | Path) -> None:
    """`torch.save` to `path`, fsync'd; only what `torch.load(weights_only=True)` reads back (tensors, containers,
    numbers, strings)."""
    write_bytes(path, lambda fh: torch.save(obj, fh))


def load_tensors(path: str | Path) -> Any:
    """Read a file written by `save_tensors`; nothing is unpickled beyond tensors and plain containers."""
    return torch.load(path, weights_only=True, map_location="cpu")


_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_METADATA_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                     ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("pathlib", "PosixPath"),
                     ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}
"""Beyond the classes of `_METADATA_MODULE` and torch's dtypes, what a DCP `.metadata` file names (torch 2.x)."""
_METADATA_MODULES = {_METADATA_MODULE, "torch", *(module for module, _ in _METADATA_GLOBALS)}
"""The only modules a `.metadata` file may make the unpickler import."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata classes and nothing else: a crafted `.metadata` file cannot run code."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _METADATA_MODULES:
            found = getattr(importlib.import_module(module), name, None)
            if (module, name) in _METADATA_GLOBALS or isinstance(found, torch.dtype) or (
                    module == _METADATA_MODULE and isinstance(found, type) and found.__module__ == module):
                return found
        raise pickle.UnpicklingError(f"a checkpoint's .metadata names {module}.{name}, which is not one of DCP's "
                                     f"metadata classes: refused (a crafted or foreign file?)")


class SafeReader(dcp.FileSystemReader):
    """DCP's file-system reader whose `.metadata` is read by `_MetadataUnpickler` instead of `pickle.load`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(dcp_metadata_path(self, kwargs.get("rank")), "rb") as fh:
            metadata = _MetadataUnpickler(fh).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"a checkpoint's .metadata holds a {type(metadata).__name__}, not DCP "
                                         f"Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def write_json(path: str | Path, value: Any) -> None:
    write_bytes(path, lambda fh: fh.write(json.dumps(value).encode()))


def read_meta(checkpoint: str | Path) -> dict[str, Any]:
    """A checkpoint's `meta.json`."""
    return json.loads((Path(checkpoint) / META_FILE).read_text())


def file_sizes(directory: str | Path, exclude: tuple[str, ...] = ()) -> dict[str, int]:
    """name -> size of every file directly in `directory` (but `exclude`)."""
    return {p.name: p.stat().st_size for p in sorted(Path(directory).iterdir()) if p.is_file()
            and p.name not in exclude}


def incomplete_reason(checkpoint: str | Path) -> str:
    """'' if `checkpoint` is complete, else why not (missing or unreadable meta.json, a missing or truncated file)."""
    path = Path(checkpoint)
    if not path.is_dir():
        return "missing"
    try:
        meta = json.loads((path / META_FILE).read_text())
    except FileNotFoundError:
        return f"no {META_FILE} (never committed)"
    except (OSError, ValueError) as exc:
        return f"{META_FILE} unreadable ({type(exc).__name__}: {exc})"
    if not isinstance(meta, dict) or "step" not in meta:
        return f"{META_FILE} holds no step"
    files = meta.get("files")
    if files is None:  # written before manifests: committed, which is all that can be told
        return ""
    for name, size in files.items():
        try:
            actual = (path / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, the commit recorded {size}"
    return ""
