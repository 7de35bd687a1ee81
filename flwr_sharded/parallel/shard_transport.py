"""This rank's local shards as self-describing pieces for the server path, and writing pieces back into the shards.

A piece is one parameter's rows `[row_offset, row_offset + rows)` along dim 0 of its global (unsharded) shape, keyed
`"{name}@{row_offset}"`. FSDP2 shards dim 0 (`Shard(0)`, torch.chunk's rule; HSDP adds a `Replicate()` mesh dim that
does not move the offset), so a rank's local tensor is exactly one such row range; the offset comes from DTensor's
own `compute_local_shape_and_global_offset`. Keys by global offset are what lets groups sharded differently (S = 1
and S = 2) be combined at the server.

On the wire (`encode_pieces`): a dict of NumPy arrays plus a dict of string metadata `key -> "dtype|d0,d1,..."`;
`flwr_sharded.flower.shard_files` puts them in hand-off files and Flower records.
bf16 has no NumPy dtype: it travels as the raw int16 view of its bits and is restored bit for bit. No rank ever
gathers the full model: only its own local tensor is read or written.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch
from torch.distributed.tensor import DTensor, Shard

from flwr_sharded.parallel.sync import local_shard

_BITS_VIEW = {torch.bfloat16: torch.int16}
"""dtypes NumPy cannot hold, sent as a same-width integer view of their bits."""
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16)}


class ShardPieceError(ValueError):
    """Pieces that do not match the local shards (unknown key, wrong shape or dtype)."""


@dataclass
class ShardPiece:
    """Rows `[row_offset, row_offset + data.shape[0])` of parameter `name`, whose unsharded shape is `global_shape`."""

    name: str
    row_offset: int
    global_shape: tuple[int, ...]
    data: torch.Tensor

    @property
    def key(self) -> str:
        return piece_key(self.name, self.row_offset)

    @property
    def rows(self) -> int:
        return int(self.data.shape[0]) if self.data.dim() else 1

    @property
    def layout(self) -> PieceLayout:
        return PieceLayout(self.name, self.row_offset, tuple(self.global_shape), tuple(self.data.shape),
                           self.data.dtype)


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


def piece_key(name: str, row_offset: int) -> str:
    return f"{name}@{row_offset}"


def split_key(key: str) -> tuple[str, int]:
    name, sep, offset = key.rpartition("@")
    if not sep or not name or not offset.isdigit():
        raise ShardPieceError(f"malformed shard key {key!r} (expected 'name@row_offset')")
    return name, int(offset)


def row_offset(param: torch.Tensor) -> int:
    """Global row (dim 0) offset of this rank's local shard; 0 for a plain tensor or a replicated DTensor."""
    if not isinstance(param, DTensor):
        return 0
    for placement in param.placements:
        if isinstance(placement, Shard) and placement.dim != 0:
            raise ShardPieceError(f"only dim-0 sharding is supported, got placements {param.placements}")
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return int(offset[0]) if offset else 0


def shard_pieces(named_params: Iterable[tuple[str, torch.Tensor]], *, clone: bool = False) -> list[ShardPiece]:
    """This rank's pieces: one per parameter (the local shard, a view unless `clone`), with its global row offset.

    Empty local shards (uneven sharding: the last ranks may hold 0 rows) are left out. Call it with the parameters
    in their sharded state (FSDP2 registers the unsharded tensors between forward and `reshard()`; a plain tensor
    is sent whole, at offset 0), as for `ShardSync`.
    """
    pieces = []
    for name, param in named_params:
        local = local_shard(param)
        if local.dim() and local.shape[0] == 0:
            continue
        pieces.append(ShardPiece(name, row_offset(param), tuple(param.shape), local.clone() if clone else local))
    return pieces


def check_pieces(named_params: Iterable[tuple[str, torch.Tensor]],
                 pieces: Iterable[ShardPiece]) -> list[tuple[ShardPiece, torch.Tensor]]:
    """Match pieces to this rank's local shards; raise ShardPieceError on any mismatch. Writes nothing.

    Every piece must match a local shard exactly (same name, row offset, local shape and global shape) and appear
    once; returns (piece, local shard) pairs to write.
    """
    targets = {}
    for name, param in named_params:
        local = local_shard(param)
        if local.dim() and local.shape[0] == 0:
            continue
        targets[piece_key(name, row_offset(param))] = (tuple(param.shape), local)
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
    """Piece key -> rows of this rank's (non-empty) local shards."""
    out = {}
    for name, p in named_params:
        local = local_shard(p)
        if not (local.dim() and local.shape[0] == 0):
            out[piece_key(name, row_offset(p))] = local.shape[0] if local.dim() else 1
    return out


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


def parse_tag(key: str, tag: str) -> tuple[torch.dtype, tuple[int, ...]]:
    """(dtype, global shape) of a piece's metadata tag `"dtype|d0,d1,..."`; ShardPieceError if malformed."""
    dtype_name, _, shape = str(tag).partition("|")
    if dtype_name not in _DTYPES:
        raise ShardPieceError(f"piece {key!r}: unknown dtype tag {dtype_name!r}")
    try:
        global_shape = tuple(int(d) for d in shape.split(",")) if shape else ()
    except ValueError:
        raise ShardPieceError(f"piece {key!r}: malformed global shape {shape!r}") from None
    return _DTYPES[dtype_name], global_shape


def decode_layouts(shapes: dict[str, tuple[int, ...]], meta: dict[str, str]) -> list[PieceLayout]:
    """The manifest's pieces (`key -> local shape`, `key -> "dtype|global shape"`); ShardPieceError if malformed."""
    if set(shapes) != set(meta):
        raise ShardPieceError(f"shapes and metadata name different keys: {sorted(set(shapes) ^ set(meta))[:5]}")
    out = []
    for key, shape in shapes.items():
        name, offset = split_key(key)
        dtype, global_shape = parse_tag(key, meta[key])
        out.append(PieceLayout(name, offset, global_shape, tuple(int(d) for d in shape), dtype))
    return out


def decode_pieces(arrays: dict[str, np.ndarray], meta: dict[str, str]) -> list[ShardPiece]:
    """Inverse of `encode_pieces` (zero-copy where possible: the pieces may share read-only memory with `arrays`, so
    they are for reading). Raises ShardPieceError on malformed input."""
    if set(arrays) != set(meta):
        raise ShardPieceError(f"arrays and metadata name different keys: "
                              f"{sorted(set(arrays) ^ set(meta))[:5]}")
    pieces = []
    for key, array in arrays.items():
        name, offset = split_key(key)
        dtype, global_shape = parse_tag(key, meta[key])
        dtype_name = str(dtype).removeprefix("torch.")
        with warnings.catch_warnings():  # read-only views of received bytes: pieces are only ever read
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            tensor = torch.from_numpy(np.ascontiguousarray(array))
        if dtype in _BITS_VIEW:
            if tensor.dtype != _BITS_VIEW[dtype]:
                raise ShardPieceError(f"piece {key!r}: {dtype_name} must travel as {_BITS_VIEW[dtype]}, "
                                      f"got {tensor.dtype}")
            tensor = tensor.view(dtype)
        elif tensor.dtype != dtype:
            raise ShardPieceError(f"piece {key!r}: tagged {dtype_name}, the array is {tensor.dtype}")
        pieces.append(ShardPiece(name, offset, global_shape, tensor))
    return pieces
