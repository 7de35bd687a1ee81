"""The kinds of wire dtype of the shard sync, and the registry they are added to (`register`); torch-free.

A wire is one `Wire` subclass in a module of `flwr_sharded.parallel.wires`; `flwr_sharded.parallel.wire` loads
them all and derives every list of wires from `WIRES`. Three kinds: the shards as they are (`PlainWire`, float32),
the weighted delta from the global model cast to a narrower float and all-reduced in it (`CastWire`, bfloat16), and
the delta blockwise quantized (8 or 4 bits a value) and summed in fp32 around a ring (`BlockwiseWire`, through
`flwr_sharded.parallel.quantize`, imported when a reduction runs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from flwr_sharded.parallel.quant_format import QUANT_BLOCK, SCALE_BYTES

if TYPE_CHECKING:
    import torch


class Wire:
    """One wire dtype of the shard sync: what it costs, what it needs and how it reduces a bucket."""

    name: ClassVar[str]
    """The `--sync-dtype` value, also the name of its torch dtype unless `torch_name` says."""
    torch_name: ClassVar[str | None] = None
    """The name of its torch dtype where it is not `name` (float4_e2m1: torch's float4_e2m1fn_x2 holds two)."""
    order: ClassVar[int]
    """Position among the wires wherever they are listed (choices, docs); the planner takes the first of a size."""
    bytes_per_value: ClassVar[float]
    """Wire bytes per parameter in an all-reduce of a large bucket, scales included."""
    delta: ClassVar[bool] = True
    """Sends the weighted delta from the global model (fp32 shards, a linear rule; keeps the global shards)."""
    error_feedback: ClassVar[bool] = False
    """Rounds blockwise (to 8 or 4 bits), so `--sync-error-feedback` can carry its rounding errors."""
    requirement: ClassVar[str] = ""
    """What the device must offer, in words ("" when any device runs it); `unsupported` checks it."""

    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.torch_name or self.name)

    def unsupported(self, device: Any) -> str | None:
        """None if `device` (a torch device or its name) runs this wire; else why not, as a phrase."""
        return None

    def reserve(self, workspace: Any, numel: int, device: Any) -> None:
        """Allocate, before the first sync, what `reduce` needs for buckets of up to `numel` values."""

    def reduce(self, flat: torch.Tensor, global_k: torch.Tensor | None, scale: float, group: Any, workspace: Any,
               residual: torch.Tensor | None = None) -> int:
        """`flat` holds this rank's values of a bucket (zeros if `scale` is 0: left out); on return the groups'
        weighted mean, `scale` being this rank's share of the weight. `global_k`: the bucket's global values (delta
        wires); `residual`: the error-feedback residual (quantized wires). Returns the bytes this rank sent."""
        raise NotImplementedError


class PlainWire(Wire):
    """The shards in their own dtype: each rank's weighted shards, all-reduced (SUM)."""

    delta: ClassVar[bool] = False

    def reduce(self, flat, global_k, scale, group, workspace, residual=None) -> int:
        import torch.distributed as dist

        flat.mul_(scale)
        dist.all_reduce(flat, group=group)
        return flat.numel() * flat.element_size()


class CastWire(Wire):
    """The weighted delta from the global model, rounded once to `name`, all-reduced in it, added back in fp32."""

    def reserve(self, workspace, numel, device) -> None:
        workspace.get("wire", numel, self.torch_dtype(), device)

    def reduce(self, flat, global_k, scale, group, workspace, residual=None) -> int:
        import torch
        import torch.distributed as dist

        wire = workspace.get("wire", flat.numel(), self.torch_dtype(), flat.device)
        if scale:
            torch.mul(flat.sub_(global_k), scale, out=wire)  # the weighted delta in fp32, rounded once
        else:
            wire.zero_()
        dist.all_reduce(wire, group=group)
        torch.add(global_k, wire, out=flat)  # global + the summed deltas, in fp32
        return wire.numel() * wire.element_size()


class BlockwiseWire(Wire):
    """The weighted delta, blockwise quantized on the wire (one fp32 scale per `QUANT_BLOCK` values, absmax -> the
    format's largest code; the formats are `flwr_sharded.parallel.quant_codes`'), summed in fp32 around a ring
    (`flwr_sharded.parallel.quantize.quantized_all_reduce`), added back in fp32. One byte a value unless a wire says
    otherwise (the 4-bit ones: half a byte)."""

    bytes_per_value: ClassVar[float] = 1.0 + SCALE_BYTES / QUANT_BLOCK
    error_feedback: ClassVar[bool] = True
    probe: ClassVar[tuple[float, ...]] = ()
    """Values the cast must carry exactly on a CPU for it to run there (none: integer codes, rounded by torch)."""
    short: ClassVar[str] = ""
    """The format's short name in messages (e.g. e4m3)."""

    def unsupported(self, device: Any) -> str | None:
        if not self.probe:
            return None
        import torch

        from flwr_sharded.parallel import quantize

        if quantize.fp8_supported(device, self.torch_dtype(), self.probe):
            return None
        return (f"needs a CPU whose torch casts to {self.short} or CUDA compute capability >= 8.9, not "
                f"{torch.device(device)}")

    def reduce(self, flat, global_k, scale, group, workspace, residual=None) -> int:
        from flwr_sharded.parallel.quantize import quantized_all_reduce

        if scale:
            flat.sub_(global_k).mul_(scale)
        sent = quantized_all_reduce(flat, group, dtype=self.torch_dtype(), residual=residual, workspace=workspace)
        flat.add_(global_k)
        return sent


WIRES: dict[str, Wire] = {}
"""Every wire dtype by name, in `order`."""


def register(cls: type[Wire]) -> type[Wire]:
    """Class decorator: add a wire to `WIRES` (its module lives in `flwr_sharded.parallel.wires`)."""
    if cls.name in WIRES:
        raise ValueError(f"wire dtype {cls.name!r} is registered twice")
    WIRES[cls.name] = cls()
    return cls
