"""Every codec by name (`CODECS`), and the codec of a torch dtype or a name (`codec_of`)."""

from __future__ import annotations

import torch

from flwr_sharded.parallel.codecs.base import BlockCodec, Codec
from flwr_sharded.parallel.codecs.codebook import CodebookCodec
from flwr_sharded.parallel.codecs.floats import Float4Codec, Float8Codec
from flwr_sharded.parallel.codecs.integers import Int4Codec, Int8Codec
from flwr_sharded.parallel.codecs.levels import Int2LevelsCodec

CODECS: dict[str, Codec] = {c.name: c for c in (
    Int8Codec("int8", 127.0),
    Float8Codec("float8_e4m3fn", float(torch.finfo(torch.float8_e4m3fn).max)),
    Float8Codec("float8_e5m2", float(torch.finfo(torch.float8_e5m2).max)),
    Int4Codec("int4", 7.0),
    Float4Codec("float4_e2m1", 6.0),
    Int2LevelsCodec("int2", 1.5),
    CodebookCodec(),
)}
"""Every codec by name: a quantized wire's own (its name), and the top-k rows' codebook."""
BLOCK_CODECS: tuple[str, ...] = tuple(name for name, c in CODECS.items() if isinstance(c, BlockCodec))
"""The blockwise scaled codecs: the formats of the quantized ring."""
_BY_TORCH_NAME = {c.torch_name: c for c in CODECS.values() if isinstance(c, BlockCodec) and c.torch_name}


def codec_of(dtype: torch.dtype | str | Codec) -> Codec:
    """The codec of a torch dtype (torch.int8, a float8, torch.int4), a name ("int4", "codebook2") or a codec itself;
    ValueError for anything else."""
    if isinstance(dtype, Codec):
        return dtype
    name = str(dtype).removeprefix("torch.")
    codec = CODECS.get(name) or _BY_TORCH_NAME.get(name)
    if codec is None:
        raise ValueError(f"quantized wire dtype must be one of {', '.join(BLOCK_CODECS)}, got {dtype}")
    return codec
