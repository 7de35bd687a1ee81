"""Wire dtypes of the shard sync (`--sync-dtype`): one `Wire` subclass each, one module each in
`flwr_sharded.parallel.wires`, registered here by name. Everything that lists wires (the option's choices, the quantized
ones, the preflight's device check, the cost and memory models' bytes per value) derives from `WIRES`.

Importing this module (and the wires) does not import torch, so the config, the planner and the Flower run stay
light; a wire's `reduce` imports torch when the sync calls it.

A wire other than the shards' own dtype sends each group's weighted delta from the global model (the outer
gradient) and adds the reduced delta back in fp32: it needs fp32 shards and a linear outer rule, and makes the sync
keep the global shards. Three kinds: the shards as they are (`PlainWire`, float32), the delta cast to a narrower
float and all-reduced in it (`CastWire`, bfloat16), and the delta blockwise quantized (8 or 4 bits a value) and summed
in fp32 around a ring (`BlockwiseWire`, through `flwr_sharded.parallel.quantize`); the kinds and `register` are in
`flwr_sharded.parallel.wire_kinds`.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Literal

from flwr_sharded.errors import ConfigError
from flwr_sharded.parallel.quant_format import QUANT_BLOCK
from flwr_sharded.parallel.sparse import over_dense
from flwr_sharded.parallel.wire_kinds import WIRES, BlockwiseWire, CastWire, PlainWire, Wire, register


def wire_of(dtype: Any) -> Wire:
    """The wire of a torch dtype or a name; ValueError naming the registered ones otherwise."""
    name = str(dtype).removeprefix("torch.")
    wire = WIRES.get(name) or next((w for w in WIRES.values() if w.torch_name == name), None)
    if wire is None:
        raise ValueError(f"{dtype} is not a wire dtype of the shard sync; registered: {', '.join(WIRES)}")
    return wire


def _load_wires() -> None:
    from flwr_sharded.parallel import wires

    for module in sorted(m.name for m in pkgutil.iter_modules(wires.__path__)):
        importlib.import_module(f"{wires.__name__}.{module}")
    ordered = sorted(WIRES.values(), key=lambda w: (w.order, w.name))
    WIRES.clear()
    WIRES.update((w.name, w) for w in ordered)


_load_wires()

SyncDtype = Literal[tuple(WIRES)]  # type: ignore[valid-type]
"""What the cross-group all-reduce carries: one of `WIRES`."""

QUANTIZED: tuple[str, ...] = tuple(name for name, w in WIRES.items() if w.error_feedback)
"""The blockwise quantized wire dtypes (8 or 4 bits a value; error feedback allowed)."""

SYNC_DTYPE_BYTES: dict[str, float] = {name: w.bytes_per_value for name, w in WIRES.items()}
"""Wire bytes per parameter of each sync dtype, in an all-reduce of a large bucket (quantized: one byte, or half of
one for the 4-bit ones, plus its share of the block's fp32 scale). The quantized all-reduce sends 2 (W - 1) / W of them per parameter, as a ring does."""


def sync_wire_ratio(dtype: str, topk: float | None = None, world: int = 2) -> float:
    """What one rank sends in a sync of a large bucket over `world` members through `--sync-dtype` `dtype` (and
    `--sync-topk`), over the fp32 sync's bytes: the wire's bytes per value / 4, times a sparse sync's rows over a
    dense one's (`flwr_sharded.parallel.sparse.over_dense`)."""
    dense = SYNC_DTYPE_BYTES[dtype] / 4
    return dense if topk is None else dense * over_dense(topk, SYNC_DTYPE_BYTES[dtype], world)


def check_wire_dtype(dtype_name: str, device: Any) -> Any:
    """The torch dtype of a quantized `--sync-dtype` on `device` (a torch device or its name); ConfigError if it is
    unknown or this device does not run it."""
    import torch

    allowed = [name for name in QUANTIZED if WIRES[name].unsupported(device) is None]
    if dtype_name not in allowed:
        why = ("is not a quantized wire dtype" if dtype_name not in QUANTIZED
               else WIRES[dtype_name].unsupported(device))
        raise ConfigError(f"--sync-dtype {dtype_name} {why}; quantized wire dtypes on {torch.device(device)}: "
                          f"{', '.join(allowed)}")
    return WIRES[dtype_name].torch_dtype()


__all__ = ["QUANTIZED", "QUANT_BLOCK", "SYNC_DTYPE_BYTES", "WIRES", "BlockwiseWire", "CastWire", "PlainWire",
           "SyncDtype", "Wire", "check_wire_dtype", "register", "sync_wire_ratio", "wire_of"]
