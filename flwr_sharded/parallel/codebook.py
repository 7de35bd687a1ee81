"""The 2-bit codebook of a top-k row's kept values (SparseLoCo's `quantization_bins` 4, `quantization_range` 6): per
block of `BLOCK` values, four bins of width 6 sigma / 4 around the block's mean, (< -1.5 sigma), [-1.5 sigma, 0),
[0, 1.5 sigma), (>= 1.5 sigma); each bin decodes as the mean of the values that fell in it (an empty one as its centre),
so the codebook is 4 fp32 per block. Codes travel four to a byte. Torch-free to import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flwr_sharded.parallel.wire_base import QUANT_BLOCK, SCALE_BYTES

if TYPE_CHECKING:
    import torch

BINS = 4
"""Codes of a 2-bit value."""
RANGE = 6.0
"""Standard deviations the bins span together (the outer ones reach beyond)."""
BLOCK = BINS * QUANT_BLOCK
"""Values per codebook: its `BINS` fp32 entries per 1024 values cost what one fp32 scale per `QUANT_BLOCK` does, so a
coded value takes the 2-bit dense wire's bytes."""
ENTRY_BYTES = SCALE_BYTES
"""Bytes of one codebook entry (fp32)."""


def blocks(n: int) -> int:
    """Codebooks of `n` values."""
    return -(-n // BLOCK)


def encode(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes (uint8 in [0, BINS), one a value) and codebooks ((blocks, BINS) fp32) of flat fp32 `values`. The
    bins' means are masked sums over each block (no atomics), so a device computes them the same way every time."""
    import torch

    n, dev = values.numel(), values.device
    padded = torch.zeros(blocks(n) * BLOCK, dtype=torch.float32, device=dev)
    padded[:n] = values
    v = padded.view(-1, BLOCK)
    valid = (torch.arange(padded.numel(), device=dev) < n).view(-1, BLOCK)
    count = valid.sum(1, keepdim=True).clamp_min_(1).float()
    mean = v.sum(1, keepdim=True) / count
    sigma = (((v - mean) * valid) ** 2).sum(1, keepdim=True).div_(count).sqrt_()
    width = sigma * (RANGE / BINS)
    width = torch.where(width > 0, width, torch.ones_like(width))  # every value equals the mean: all in bin 2
    codes = torch.floor((v - mean) / width).add_(BINS // 2).clamp_(0, BINS - 1).to(torch.uint8)
    onehot = (codes.unsqueeze(-1) == torch.arange(BINS, device=dev, dtype=torch.uint8)) & valid.unsqueeze(-1)
    sums = (onehot * v.unsqueeze(-1)).sum(1)
    counts = onehot.sum(1)
    centres = mean + (torch.arange(BINS, device=dev, dtype=torch.float32) - (BINS - 1) / 2) * width
    book = torch.where(counts > 0, sums / counts.clamp_min(1), centres)
    return codes.view(-1)[:n], book


def decode(codes: torch.Tensor, book: torch.Tensor) -> torch.Tensor:
    """The fp32 values of `codes` (one a value, uint8 or wider) through their blocks' codebooks."""
    import torch

    n = codes.numel()
    block = torch.arange(n, device=codes.device) // BLOCK
    return book.reshape(-1)[block * BINS + codes.long()]


def pack(codes: torch.Tensor, out: torch.Tensor) -> None:
    """Write 2-bit `codes` four to a byte (the first in the low bits) into uint8 `out` of ceil(n / 4) bytes."""
    import torch

    padded = torch.zeros(out.numel() * 4, dtype=torch.uint8, device=codes.device)
    padded[:codes.numel()] = codes
    q = padded.view(-1, 4)
    out.copy_(q[:, 0] | (q[:, 1] << 2) | (q[:, 2] << 4) | (q[:, 3] << 6))


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The first `n` 2-bit codes of `packed` (uint8), as uint8."""
    import torch

    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 3).view(-1)[:n]
