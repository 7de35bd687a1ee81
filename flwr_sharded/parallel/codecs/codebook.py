"""The 2-bit codebook codec of a top-k row's kept values (SparseLoCo's `quantization_bins` 4, `quantization_range`
6): per block of `CODEBOOK_BLOCK` values, four bins of width 6 sigma / 4 around the block's mean, (< -1.5 sigma),
[-1.5 sigma, 0), [0, 1.5 sigma), (>= 1.5 sigma); each bin decodes as the mean of the values that fell in it (an empty
one as its centre), so the codebook is 4 fp32 per block. Codes travel four to a byte (`CodePacker`). The int2 wire's
values take it in a top-k row (`Wire.row_codec`)."""

from __future__ import annotations

import torch

from flwr_sharded.parallel.codecs.base import Codec
from flwr_sharded.parallel.wire_base import CODEBOOK_BINS, CODEBOOK_BLOCK
from flwr_sharded.parallel.workspace import Workspace

RANGE = 6.0
"""Standard deviations the bins span together (the outer ones reach beyond)."""


class CodebookCodec(Codec):
    """2-bit codes of `CODEBOOK_BINS` bins per block of `CODEBOOK_BLOCK` values, each bin's mean in the block's
    codebook (module docstring); the side values are the codebooks, (blocks, bins) fp32."""

    name = "codebook2"
    bits = 2
    exact_across_devices = False  # a bin's mean is a sum, rounded as each device sums

    @staticmethod
    def blocks(numel: int) -> int:
        """Codebooks of `numel` values."""
        return -(-numel // CODEBOOK_BLOCK)

    def codes_and_books(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes (uint8 in [0, bins), one a value) and codebooks ((blocks, bins) fp32) of flat fp32 `values`.
        The bins' means are masked sums over each block (no atomics), so a device computes them the same way every
        time."""
        n, dev = values.numel(), values.device
        padded = torch.zeros(self.blocks(n) * CODEBOOK_BLOCK, dtype=torch.float32, device=dev)
        padded[:n] = values
        v = padded.view(-1, CODEBOOK_BLOCK)
        valid = (torch.arange(padded.numel(), device=dev) < n).view(-1, CODEBOOK_BLOCK)
        count = valid.sum(1, keepdim=True).clamp_min_(1).float()
        mean = v.sum(1, keepdim=True) / count
        sigma = (((v - mean) * valid) ** 2).sum(1, keepdim=True).div_(count).sqrt_()
        width = sigma * (RANGE / CODEBOOK_BINS)
        width = torch.where(width > 0, width, torch.ones_like(width))  # every value equals the mean: all in bin 2
        bins = CODEBOOK_BINS
        codes = torch.floor((v - mean) / width).add_(bins // 2).clamp_(0, bins - 1).to(torch.uint8)
        onehot = (codes.unsqueeze(-1) == torch.arange(bins, device=dev, dtype=torch.uint8)) & valid.unsqueeze(-1)
        sums = (onehot * v.unsqueeze(-1)).sum(1)
        counts = onehot.sum(1)
        centres = mean + (torch.arange(bins, device=dev, dtype=torch.float32) - (bins - 1) / 2) * width
        book = torch.where(counts > 0, sums / counts.clamp_min(1), centres)
        return codes.view(-1)[:n], book

    def book_values(self, codes: torch.Tensor, book: torch.Tensor) -> torch.Tensor:
        """The fp32 values of `codes` (one a value, any integer dtype) through their blocks' codebooks."""
        block = torch.arange(codes.numel(), device=codes.device) // CODEBOOK_BLOCK
        return book.reshape(-1)[block * CODEBOOK_BINS + codes.long()]

    def byte_table(self) -> torch.Tensor:
        """byte -> its four codes, fp32 (`CodePacker.unpack`)."""
        return self.packer.byte_fields().float()

    def pack_codes(self, codes: torch.Tensor, payload: torch.Tensor) -> None:
        """Write codes (one a value, in [0, bins)) four to a byte into uint8 `payload` of ceil(n / 4) bytes."""
        padded = torch.zeros(payload.numel() * self.codes_per_byte, dtype=torch.float32, device=codes.device)
        padded[:codes.numel()] = codes
        self.packer.pack(padded, payload, Workspace())

    def unpack_codes(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """The first `numel` codes of `pack_codes`' bytes, as fp32."""
        out = torch.empty(payload.numel() * self.codes_per_byte, dtype=torch.float32, device=payload.device)
        self.packer.unpack(payload, out, self, Workspace())
        return out[:numel]

    def encode_values(self, values, payload, side) -> torch.Tensor:
        codes, book = self.codes_and_books(values)
        self.pack_codes(codes, payload)
        side[:book.numel()].copy_(book.view(-1))
        return self.book_values(codes, book)

    def decode_values(self, payload, side, numel) -> torch.Tensor:
        book = side[:CODEBOOK_BINS * self.blocks(numel)].view(-1, CODEBOOK_BINS)
        return self.book_values(self.unpack_codes(payload, numel), book)
