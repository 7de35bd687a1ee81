"""Files that survive a crash or a power loss: fsync'd writes, directory syncs, and a checkpoint's file manifest.

A checkpoint directory is complete when its `meta.json` (written last, at the commit) parses and every file its
manifest lists (`meta["files"]`: name -> bytes) is there with that size. Sizes catch truncated and missing files,
the usual damage of a full disk, a killed writer or a partial copy; a same-size corruption is caught only when the
load fails (DCP keeps no checksums), which resume also treats as "not usable".
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import torch

META = "meta.json"


def fsync_file(path: str | Path) -> None:
    """Flush a file's data to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | Path) -> None:
    """Persist a directory's entries (files created, renamed or removed in it)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # a file system without directory handles: nothing more to do
        return
    try:
        os.fsync(fd)
    except OSError:  # e.g. EINVAL on file systems that do not sync directories
        pass
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


def write_json(path: str | Path, value: Any) -> None:
    write_bytes(path, lambda fh: fh.write(json.dumps(value).encode()))


def read_meta(checkpoint: str | Path) -> dict[str, Any]:
    """A checkpoint's `meta.json`."""
    return json.loads((Path(checkpoint) / META).read_text())


def manifest(directory: str | Path, exclude: tuple[str, ...] = ()) -> dict[str, int]:
    """name -> size of every file directly in `directory` (but `exclude`)."""
    return {p.name: p.stat().st_size for p in sorted(Path(directory).iterdir()) if p.is_file()
            and p.name not in exclude}


def incomplete_reason(checkpoint: str | Path) -> str:
    """'' if `checkpoint` is complete, else why it is not (missing or unreadable meta.json, a missing or truncated
    file)."""
    path = Path(checkpoint)
    if not path.is_dir():
        return "missing"
    try:
        meta = json.loads((path / META).read_text())
    except FileNotFoundError:
        return f"no {META} (never committed)"
    except (OSError, ValueError) as exc:
        return f"{META} unreadable ({type(exc).__name__}: {exc})"
    if not isinstance(meta, dict) or "step" not in meta:
        return f"{META} holds no step"
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
