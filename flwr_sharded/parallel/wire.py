"""The wire dtypes of the shard sync (`--sync-dtype`): the kinds (plain, cast, blockwise quantized), one class per
wire in `WIRES`, and everything that lists them (the option's choices and docs, the quantized ones, the device check,
the cost and memory models' bytes), and the wire a sync is built with (`sync_wire`). A new wire is a `register_wire`ed
subclass of a kind; torch-free to import."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from flwr_sharded.errors import ConfigError
from flwr_sharded.parallel.sparse import DEFAULT_ERROR_DECAY, DEFAULT_MERGE, SparseWire, TopkMerge, over_dense
from flwr_sharded.parallel.wire_base import CODEBOOK_BINS, CODEBOOK_BLOCK, QUANT_BLOCK, SCALE_BYTES, Wire


class PlainWire(Wire):
    """The shards in their own dtype: each rank's weighted shards, all-reduced (SUM)."""

    delta: ClassVar[bool] = False

    def sum(self, x, group, workspace, residual=None) -> int:
        import torch.distributed as dist

        from flwr_sharded.parallel.collectives import bounded

        bounded(dist.all_reduce, x, group=group)
        return x.numel() * x.element_size()


class CastWire(Wire):
    """The weighted delta from the global model, rounded once to `name`, all-reduced in it, added back in fp32."""

    def reserve(self, workspace, numel, device) -> None:
        workspace.get("wire", numel, self.torch_dtype(), device)

    def sum(self, x, group, workspace, residual=None) -> int:
        import torch.distributed as dist

        from flwr_sharded.parallel.collectives import bounded

        wire = workspace.get("wire", x.numel(), self.torch_dtype(), x.device)
        wire.copy_(x)  # rounded once
        bounded(dist.all_reduce, wire, group=group)
        x.copy_(wire)
        return wire.numel() * wire.element_size()


class BlockwiseWire(Wire):
    """The weighted delta, blockwise quantized (one fp32 scale per `QUANT_BLOCK` values, absmax -> the format's
    largest code; the format is the codec of the wire's name, `flwr_sharded.parallel.codecs`), summed in fp32 around a
    ring (`flwr_sharded.parallel.ring.quantized_all_reduce`), added back in fp32. One byte a value unless a wire says
    otherwise."""

    bytes_per_value: ClassVar[float] = 1.0 + SCALE_BYTES / QUANT_BLOCK
    error_feedback: ClassVar[bool] = True
    probe: ClassVar[tuple[float, ...]] = ()
    """Values the cast must carry exactly on a CPU for it to run there (none: integer codes, rounded by torch)."""
    short: ClassVar[str] = ""
    """The format's short name in messages (e.g. e4m3)."""
    row_codec_name: ClassVar[str | None] = None
    """The codec its values take in a top-k row where it is not the wire's own (None: the wire's)."""

    def row_codec(self) -> Any:
        from flwr_sharded.parallel.codecs.registry import codec_of

        return codec_of(self.row_codec_name or self.name)

    def row_side_bytes(self, kept: int) -> int:
        return SCALE_BYTES * -(-kept // QUANT_BLOCK)

    def unsupported(self, device: Any) -> str | None:
        if not self.probe:
            return None
        import torch

        from flwr_sharded.parallel.codecs import floats

        if floats.fp8_supported(device, self.torch_dtype(), self.probe):
            return None
        return (f"needs a CPU whose torch casts to {self.short} or CUDA compute capability >= 8.9, not "
                f"{torch.device(device)}")

    def sum(self, x, group, workspace, residual=None) -> int:
        from flwr_sharded.parallel.ring import quantized_all_reduce

        return quantized_all_reduce(x, group, dtype=self.torch_dtype(), residual=residual, workspace=workspace)


WIRES: dict[str, Wire] = {}
"""Every wire dtype by name, in `order`."""


def register_wire(cls: type[Wire]) -> type[Wire]:
    """Class decorator: add a wire to `WIRES`, in its `order`."""
    if cls.name in WIRES:
        raise ValueError(f"wire dtype {cls.name!r} is registered twice")
    wires = sorted([*WIRES.values(), cls()], key=lambda w: (w.order, w.name))
    WIRES.clear()
    WIRES.update((w.name, w) for w in wires)
    return cls


@register_wire
class Float32(PlainWire):
    """the shards themselves"""
    name, order, bytes_per_value = "float32", 0, 4.0


@register_wire
class BFloat16(CastWire):
    """the delta rounded once to bf16"""
    name, order, bytes_per_value = "bfloat16", 10, 2.0


@register_wire
class Int8(BlockwiseWire):
    """integer codes, absmax / 127 per block, rounded to nearest"""
    name, order = "int8", 20


@register_wire
class Float8E4M3(BlockwiseWire):
    """fp8 e4m3 codes, absmax / 448 per block, within 1/16 of each value"""
    name, order, short, requirement = "float8_e4m3fn", 30, "e4m3", "CUDA compute capability >= 8.9"
    probe = (448.0, -1.125, 2.0**-9, 0.0)  # largest normal, a 3-bit mantissa, smallest subnormal


@register_wire
class Float8E5M2(BlockwiseWire):
    """fp8 e5m2 codes, absmax / 57344 per block, within 1/8 of each value for a wider range inside a block"""
    name, order, short, requirement = "float8_e5m2", 40, "e5m2", "CUDA compute capability >= 8.9"
    probe = (57344.0, -1.25, 2.0**-16, 0.0)  # largest normal, a 2-bit mantissa, smallest subnormal


@register_wire
class Int4(BlockwiseWire):
    """integer codes in [-7, 7], two to a byte, 18x int8's rounding step"""
    name, order, bytes_per_value = "int4", 50, 0.5 + SCALE_BYTES / QUANT_BLOCK


@register_wire
class Float4E2M1(BlockwiseWire):
    """OCP's 4-bit float, two to a byte, decoded through a table on any device, int4's bytes for a wider range
    inside a block"""
    name, torch_name, order, bytes_per_value = "float4_e2m1", "float4_e2m1fn_x2", 60, 0.5 + SCALE_BYTES / QUANT_BLOCK


@register_wire
class Int2(BlockwiseWire):
    """four levels per block, four to a byte: +-a and +-b, the mean magnitudes below and above the block's RMS (two
    bf16 in the bytes of its scale; MuLoCo's 2 bits)"""
    name, order, bytes_per_value = "int2", 70, 0.25 + SCALE_BYTES / QUANT_BLOCK
    row_codec_name = "codebook2"  # a top-k row's values: 2-bit codes through 4-bin codebooks

    def row_side_bytes(self, kept: int) -> int:
        return SCALE_BYTES * CODEBOOK_BINS * -(-kept // CODEBOOK_BLOCK)


SyncDtype = Literal[tuple(WIRES)]  # type: ignore[valid-type]
"""What the cross-group all-reduce carries: one of `WIRES`."""
QUANTIZED: tuple[str, ...] = tuple(name for name, w in WIRES.items() if w.error_feedback)
"""The blockwise quantized wire dtypes (8, 4 or 2 bits a value; error feedback allowed)."""
SYNC_DTYPE_BYTES: dict[str, float] = {name: w.bytes_per_value for name, w in WIRES.items()}
"""Wire bytes per parameter of each sync dtype in an all-reduce of a large bucket, scales included; the quantized
all-reduce sends 2 (W - 1) / W of them per parameter, as a ring does."""


def described() -> str:
    """Every wire for the option's docs: its name (bytes over float32's: what it sends; what it needs)."""
    return ", ".join(f"{name} ({w.bytes_per_value / 4:.3g}: {' '.join((type(w).__doc__ or '').split())}"
                     f"{'; ' + w.requirement if w.requirement else ''})" for name, w in WIRES.items())


def wire_of(dtype: Any) -> Wire:
    """The wire of a torch dtype or a name; ValueError naming the registered ones otherwise."""
    name = str(dtype).removeprefix("torch.")
    wire = WIRES.get(name) or next((w for w in WIRES.values() if w.torch_name == name), None)
    if wire is None:
        raise ValueError(f"{dtype} is not a wire dtype of the shard sync; registered: {', '.join(WIRES)}")
    return wire


def sync_wire(dtype: str, topk: float | None = None, merge: TopkMerge = DEFAULT_MERGE,
              decay: float = DEFAULT_ERROR_DECAY, restart: bool = False) -> Wire:
    """The wire a shard sync sends through, built from its options: `--sync-dtype` `dtype`'s, or with `--sync-topk`
    the top-k rows of its values (`sparse.SparseWire`: their merge, the residual's decay, the restart from it)."""
    values = WIRES[dtype]
    return values if topk is None else SparseWire(values, topk, merge, decay, restart)


def wire_ratio(value_bytes: float, topk: float | None = None, world: int = 2, *, over: float = 4.0) -> float:
    """What one rank sends in a sync of a large bucket over `world` members with `value_bytes` per value on the wire
    (and `--sync-topk`), over the bytes of a sync of `over` bytes per value (fp32's by default)."""
    dense = value_bytes / over
    return dense if topk is None else dense * over_dense(topk, value_bytes, world)


def sync_wire_ratio(dtype: str, topk: float | None = None, world: int = 2) -> float:
    """`wire_ratio` of `--sync-dtype` `dtype` over the fp32 sync."""
    return wire_ratio(SYNC_DTYPE_BYTES[dtype], topk, world)


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
