"""The int2 codec: four symmetric levels -b, -a, a, b per block, four codes to a byte. The magnitudes below the
block's RMS decode as their mean a, those at or above it as theirs b. For a Gaussian that is the 4-level Lloyd-Max
quantizer almost exactly (levels 0.46 and 1.53 sigma split at 1 sigma, against 0.45 and 1.51 at 0.98), and for any
block a contraction: each class's mean is its least-squares level, so a block's error is smaller than the block,
which error feedback needs to stay bounded (fixed levels +-0.5, +-1.5 times a scale send a block of one large value
and small ones back with more error than it had); a and b travel as two bf16 in the 4 bytes of a block's scale."""

from __future__ import annotations

import torch

from flwr_sharded.parallel.codecs.base import BlockCodec


class Int2LevelsCodec(BlockCodec):
    """int2: the levels -b, -a, a, b of each block (module docstring), four to a byte as the level's index 0 .. 3;
    a block's 4 scale bytes hold (a, b) as two bf16. Its qmax is its largest signed class, 1.5."""

    bits = 2

    def byte_table(self) -> torch.Tensor:
        """byte -> its codes' signed classes: -1.5, -0.5, 0.5, 1.5 for -b, -a, a, b."""
        return self.packer.byte_fields().float() - 1.5

    def quantize_blocks(self, src, raw, scales, scratch, error, ws) -> None:
        n, dev = src.numel(), src.device
        magnitude = torch.abs(src, out=ws.get("magnitude", n, torch.float32, dev).view(src.shape))
        absmax = magnitude.amax(-1)
        # the RMS in fp32, held within [absmax / sqrt(block), absmax], where the true RMS lies: a block whose squares
        # underflow or overflow fp32 still splits at a value of its own size
        root = src.shape[-1] ** -0.5
        threshold = torch.linalg.vector_norm(src, dim=-1).mul_(root)
        threshold = torch.clamp(threshold, min=absmax.mul(root), max=absmax).unsqueeze(-1)
        outer = torch.ge(magnitude, threshold, out=ws.get("outer", n, torch.float32, dev).view(src.shape))
        count, total = outer.sum(-1), magnitude.sum(-1)
        outer_sum = magnitude.mul_(outer).sum(-1)  # ~10x faster than vecdot on CPU; the magnitudes are not needed again
        inner = total.sub_(outer_sum).div_(count.neg().add_(src.shape[-1]).clamp_(min=1))
        levels = scales.view(torch.bfloat16).view(-1, 2)
        levels.copy_(torch.stack([inner, outer_sum.div_(count.clamp_(min=1))], 1))  # rounded to bf16
        a, b = (levels[:, i].float().view(threshold.shape) for i in (0, 1))
        codes = torch.add(outer, 0.5, out=magnitude)  # |signed class| - 1: 0.5 inner, 1.5 outer
        torch.copysign(codes, src, out=codes)
        if error:  # src -= sign x (a + outer (b - a)), the decoded value
            src.sub_(torch.copysign(outer.mul_(b - a).add_(a), codes))
        self.packer.pack(codes.add_(1.5), raw, ws)

    def dequantize_blocks(self, raw, scales, out, ws) -> None:
        self.decode(raw, out, ws)  # the signed classes
        levels = scales.view(torch.bfloat16).view(-1, 2).float()
        a, b = levels[:, :1], levels[:, 1:]
        value = torch.abs(out, out=ws.get("levels", out.numel(), torch.float32, out.device).view(out.shape))
        torch.copysign(value.sub_(0.5).mul_(b - a).add_(a), out, out=out)

    def accumulate_blocks(self, raw, scales, into, part, ws) -> None:
        self.dequantize_blocks(raw, scales, part, ws)
        into.add_(part)
