"""Wire dtypes of the shard sync (`--sync-dtype`) and what they cost: the one declaration the sync, the cost model,
the planner and the benchmarks read (no torch import, so the planner stays light)."""

from __future__ import annotations

import typing
from typing import Literal

SyncDtype = Literal["float32", "bfloat16", "int8", "float8_e4m3fn"]
"""What the cross-group all-reduce carries: the shards (float32), or each group's weighted delta from the last
global model in bfloat16, or blockwise quantized to 8 bits (int8, float8_e4m3fn) and summed in fp32."""

QUANT_BLOCK = 256
"""Elements per fp32 scale of an 8-bit wire (`flwr_sharded.parallel.quantize`)."""

QUANTIZED: tuple[str, ...] = ("int8", "float8_e4m3fn")
"""The 8-bit wire dtypes."""

SYNC_DTYPE_BYTES: dict[str, float] = {"float32": 4.0, "bfloat16": 2.0,
                                      **{name: 1.0 + 4.0 / QUANT_BLOCK for name in QUANTIZED}}
"""Wire bytes per parameter of each sync dtype, in an all-reduce of a large bucket (8-bit: one byte plus its share
of the block's fp32 scale). The quantized all-reduce sends 2 (W - 1) / W of them per parameter, as a ring does."""

assert tuple(SYNC_DTYPE_BYTES) == typing.get_args(SyncDtype)
