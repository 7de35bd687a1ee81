"""The `Wire` interface that every wire dtype of the shard sync implements (the kinds in `flwr_sharded.parallel.wire`,
the top-k wire in `flwr_sharded.parallel.sparse`), and the sizes of the codecs' blocks and codebooks (the codecs
are `flwr_sharded.parallel.codecs`); torch-free."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

QUANT_BLOCK = 256
"""Values per fp32 scale of a blockwise quantized wire."""
SCALE_BYTES = 4
"""Bytes of one block's scale (fp32)."""
CODEBOOK_BINS = 4
"""Codes of a 2-bit codebook value (`flwr_sharded.parallel.codecs.codebook`)."""
CODEBOOK_BLOCK = CODEBOOK_BINS * QUANT_BLOCK
"""Values per codebook: its `CODEBOOK_BINS` fp32 entries per 1024 values cost what one fp32 scale per `QUANT_BLOCK`
does, so a coded value takes the 2-bit dense wire's bytes."""


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
    """Rounds blockwise (to 8, 4 or 2 bits), so `--sync-error-feedback` can carry its rounding errors."""
    requirement: ClassVar[str] = ""
    """What the device must offer, in words ("" when any device runs it); `unsupported` checks it."""

    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.torch_name or self.name)

    def unsupported(self, device: Any) -> str | None:
        """None if `device` (a torch device or its name) runs this wire; else why not, as a phrase."""
        return None

    def dense(self) -> Wire:
        """The wire of a sync that sends every entry (a top-k wire's warm-up or flush); a dense wire is its own."""
        return self

    def row_codec(self) -> Any:
        """The codec (`flwr_sharded.parallel.codecs`) of this wire's values in a top-k row; None: they travel cast to
        its dtype."""
        return None

    def row_side_bytes(self, kept: int) -> int:
        """Bytes of the side values (scales or codebooks) of `kept` values in a top-k row (unpadded)."""
        return 0

    def reserve(self, workspace: Any, numel: int, device: Any) -> None:
        """Allocate, before the first sync, what `reduce` needs for buckets of up to `numel` values."""

    def reduce(self, flat: torch.Tensor, global_k: torch.Tensor | None, scale: float, group: Any, workspace: Any,
               residual: torch.Tensor | None = None, sites: Any = None) -> int:
        """`flat` holds this rank's values of a bucket (zeros if `scale` is 0: left out); on return the groups'
        weighted mean, `scale` being this rank's share of the weight. `global_k`: the bucket's global values (delta
        wires); `residual`: the error-feedback residual (quantized wires). `group`: the federation's process group;
        `sites`: its `flwr_sharded.parallel.sites.SiteGroups` (a two-level reduction: the wire carries the sum across
        the sites only), None: the flat ring over `group`. Returns the bytes this rank sent."""
        if scale:  # the weighted values, or the weighted delta from the global ones, in fp32
            if self.delta:
                flat.sub_(global_k)
            flat.mul_(scale)
        if sites is not None:
            sent = sites.reduce(flat, workspace, lambda share, res: self.sum(share, sites.across, workspace, res),
                                residual)
        else:
            sent = self.sum(flat, group, workspace, residual)
        if self.delta:
            flat.add_(global_k)
        return sent

    def sum(self, x: torch.Tensor, group: Any, workspace: Any, residual: torch.Tensor | None = None) -> int:
        """SUM fp32 `x` over process group `group` in place, carried in this wire's format; returns the bytes this
        rank sent."""
        raise NotImplementedError
