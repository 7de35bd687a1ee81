"""This rank's local shards as pieces keyed by global row offset, for the server path, and their wire encoding.

A piece is one parameter's rows `[row_offset, row_offset + rows)` of dim 0, keyed `"{name}@{row_offset}"`: FSDP2
shards dim 0 (HSDP's `Replicate()` does not move the offset), so groups sharded differently combine row by row and no
rank gathers the model. On the wire (`encode_pieces`): NumPy arrays by key and `key -> "dtype|d0,d1,..."` strings
(`flwr_sharded.flower.shard_files` puts them in files and Flower records); bf16, which NumPy lacks, as its int16 bits.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import torch
from torch.distributed.tensor import DTensor, Shard

from flwr_sharded.parallel.alignment import local_shard

_BITS_VIEW = {torch.bfloat16: torch.int16}
"""dtypes NumPy cannot hold, sent as a same-width integer view of their bits."""
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16)}


class ShardPieceError(ValueError):
    """Pieces that do not match the local shards or the wire format (unknown key, wrong shape or dtype)."""


def piece_key(name: str, row_offset: int) -> str:
    return f"{name}@{row_offset}"


@dataclass(frozen=True)
class PieceLayout:
    """Where a piece sits and what it holds, without its values (an entry of a group's manifest)."""

    name: str
    row_offset: int
    global_shape: tuple[int, ...]
    shape: tuple[int, ...]
    """Local shape: rows first."""
    dtype: torch.dtype

    @property
    def key(self) -> str:
        return piece_key(self.name, self.row_offset)

    @property
    def rows(self) -> int:
        return int(self.shape[0]) if self.shape else 1


@dataclass
class ShardPiece:
    """Rows `[row_offset, row_offset + data.shape[0])` of parameter `name`, whose unsharded shape is `global_shape`."""

    name: str
    row_offset: int
    global_shape: tuple[int, ...]
    data: torch.Tensor

    @property
    def layout(self) -> PieceLayout:
        return PieceLayout(self.name, self.row_offset, tuple(self.global_shape), tuple(self.data.shape),
                           self.data.dtype)

    key = property(lambda self: self.layout.key)
    rows = property(lambda self: self.layout.rows)


def row_offset(param: torch.Tensor) -> int:
    """Global row (dim 0) offset of this rank's local shard (DTensor's own); 0 for a plain or replicated tensor."""
    if not isinstance(param, DTensor):
        return 0
    for placement in param.placements:
        if isinstance(placement, Shard) and placement.dim != 0:
            raise ShardPieceError(f"only dim-0 sharding is supported, got placements {param.placements}")
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return int(offset[0]) if offset else 0


def _local_shards(named_params: Iterable[tuple[str, torch.Tensor]]
                  ) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, parameter, local shard) where the local shard holds rows (uneven sharding leaves the last ranks empty)."""
    for name, param in named_params:
        local = local_shard(param)
        if not (local.dim() and local.shape[0] == 0):
            yield name, param, local


def shard_pieces(named_params: Iterable[tuple[str, torch.Tensor]], *, clone: bool = False) -> list[ShardPiece]:
    """This rank's pieces: its local shard of each parameter (a view unless `clone`; a plain tensor whole) at its
    global row offset. Call it with the parameters sharded (not between FSDP2's forward and `reshard()`)."""
    return [ShardPiece(name, row_offset(param), tuple(param.shape), local.clone() if clone else local)
            for name, param, local in _local_shards(named_params)]


def check_pieces(named_params: Iterable[tuple[str, torch.Tensor]],
                 pieces: Iterable[ShardPiece]) -> list[tuple[ShardPiece, torch.Tensor]]:
    """(piece, local shard) pairs to write, each piece matching a local shard exactly (name, row offset, local and
    global shape), once, finite; ShardPieceError otherwise. Writes nothing."""
    targets = {piece_key(name, row_offset(param)): (tuple(param.shape), local)
               for name, param, local in _local_shards(named_params)}
    pairs = []
    seen = set()
    for piece in pieces:
        if piece.key not in targets:
            raise ShardPieceError(f"piece {piece.key!r} matches no local shard of this rank "
                                  f"(local keys: {sorted(targets)[:5]}...)")
        if piece.key in seen:
            raise ShardPieceError(f"piece {piece.key!r} given twice")
        seen.add(piece.key)
        global_shape, local = targets[piece.key]
        if tuple(piece.global_shape) != global_shape or tuple(piece.data.shape) != tuple(local.shape):
            raise ShardPieceError(f"piece {piece.key!r} has shape {tuple(piece.data.shape)} of global "
                                  f"{tuple(piece.global_shape)}, the local shard is {tuple(local.shape)} of "
                                  f"global {global_shape}")
        if piece.data.is_floating_point() and not bool(torch.isfinite(piece.data).all()):
            raise ShardPieceError(f"piece {piece.key!r} holds NaN or Inf")
        pairs.append((piece, local))
    return pairs


def own_pieces(named_params: Iterable[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """Piece key -> rows of this rank's local shards."""
    return {piece_key(name, row_offset(param)): local.shape[0] if local.dim() else 1
            for name, param, local in _local_shards(named_params)}


def encode_pieces(pieces: Iterable[ShardPiece]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(arrays, meta): NumPy arrays keyed `name@offset` (bf16 as an int16 bit view) and `key -> "dtype|shape"`."""
    arrays, meta = {}, {}
    for piece in pieces:
        data = piece.data.detach()
        if data.dtype not in _DTYPES.values():
            raise ShardPieceError(f"piece {piece.key!r}: dtype {data.dtype} is not supported on the wire")
        dtype_name = str(data.dtype).removeprefix("torch.")
        if data.dtype in _BITS_VIEW:
            data = data.contiguous().view(_BITS_VIEW[data.dtype])
        arrays[piece.key] = data.cpu().numpy()
        meta[piece.key] = f"{dtype_name}|{','.join(str(d) for d in piece.global_shape)}"
    return arrays, meta


def _decoded_keys(keys: Iterable[str],
                  meta: dict[str, str]) -> Iterator[tuple[str, str, int, torch.dtype, tuple[int, ...]]]:
    """(key, name, row offset, dtype, global shape) of each key and its tag `"dtype|d0,d1,..."`; ShardPieceError if
    the keys are not those of `meta` or one is malformed."""
    keys = list(keys)
    if set(keys) != set(meta):
        raise ShardPieceError(f"pieces and metadata name different keys: {sorted(set(keys) ^ set(meta))[:5]}")
    for key in keys:
        name, sep, offset = key.rpartition("@")
        if not sep or not name or not offset.isdigit():
            raise ShardPieceError(f"malformed shard key {key!r} (expected 'name@row_offset')")
        dtype_name, _, shape = str(meta[key]).partition("|")
        if dtype_name not in _DTYPES:
            raise ShardPieceError(f"piece {key!r}: unknown dtype tag {dtype_name!r}")
        try:
            global_shape = tuple(int(d) for d in shape.split(",")) if shape else ()
        except ValueError:
            raise ShardPieceError(f"piece {key!r}: malformed global shape {shape!r}") from None
        yield key, name, int(offset), _DTYPES[dtype_name], global_shape


def decode_layouts(shapes: dict[str, tuple[int, ...]], meta: dict[str, str]) -> list[PieceLayout]:
    """The manifest's pieces (`key -> local shape`, `key -> "dtype|global shape"`); ShardPieceError if malformed."""
    return [PieceLayout(name, offset, global_shape, tuple(int(d) for d in shapes[key]), dtype)
            for key, name, offset, dtype, global_shape in _decoded_keys(shapes, meta)]


def decode_pieces(arrays: dict[str, np.ndarray], meta: dict[str, str]) -> list[ShardPiece]:
    """Inverse of `encode_pieces`, zero-copy where possible (the pieces may share read-only memory with `arrays`:
    they are for reading); ShardPieceError on malformed input."""
    pieces = []
    for key, name, offset, dtype, global_shape in _decoded_keys(arrays, meta):
        with warnings.catch_warnings():  # read-only views of received bytes: pieces are only ever read
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            tensor = torch.from_numpy(np.ascontiguousarray(arrays[key]))
        dtype_name = str(dtype).removeprefix("torch.")
        if dtype in _BITS_VIEW:
            if tensor.dtype != _BITS_VIEW[dtype]:
                raise ShardPieceError(f"piece {key!r}: {dtype_name} must travel as {_BITS_VIEW[dtype]}, "
                                      f"got {tensor.dtype}")
            tensor = tensor.view(dtype)
        elif tensor.dtype != dtype:
            raise ShardPieceError(f"piece {key!r}: tagged {dtype_name}, the array is {tensor.dtype}")
        pieces.append(ShardPiece(name, offset, global_shape, tensor))
    return pieces
