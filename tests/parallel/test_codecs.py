"""The codecs (int8, fp8, int4, fp4, int2, the top-k rows' codebook): blockwise rounding bounds, the int2 levels, the
codebook's bins, the one packer's round trip, bytes. A new codec's test goes here: its rounding bound in
`rounding_bound` and its dtype in `test_dequantize_is_within_half_a_step_of_the_input`'s list."""

from __future__ import annotations

import math

import pytest
import torch

U = 2.0**-24  # fp32 unit roundoff
"""The gather's name in this torch (the same collective; `parallel.torch_compat.all_gather_single` picks it)."""
INT8, FP8, INT4 = torch.int8, torch.float8_e4m3fn, torch.int4  # torch.int4: a placeholder dtype naming the format
FP4 = torch.float4_e2m1fn_x2  # two e2m1 values in torch; names the float4_e2m1 format
INT2 = torch.int2  # a placeholder dtype too: four 2-bit codes to a byte
PACKED = {INT4: 2, FP4: 2, INT2: 4}  # codes per byte of the packed formats


def rounding_bound(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Largest |dequantize(quantize(x)) - x| per element (fp64), given each element's block scale.

    int8, int4: half a step, scale / 2, plus the fp32 roundings of x * (1 / scale) and of code * scale (< 382 u
    scale).
    e4m3: 3 mantissa bits round to within 1/16 of the scaled value (normal range) or half the smallest subnormal
    step 2^-9 (below 2^-6), i.e. max(|x| / 16, scale / 1024), plus the same fp32 roundings (< 1400 u scale).
    e2m1: 1 mantissa bit, within 1/4 of the scaled value at and above 1, half the step 0.5 below it.
    int2 (scale: the block's absmax): a magnitude below the split T decodes as a level in [0, T), one above it as a
    level in [T, absmax], T >= absmax / 16; the levels' bf16 rounding adds 2^-9 of them.
    """
    if dtype == INT2:
        return scale * (15 / 16 + 2.0**-8)
    if dtype in (INT8, INT4):
        return scale * (0.5 + 2.0**-15)
    if dtype == FP4:
        return torch.maximum(x.abs() / 4, scale / 4) + scale * 2.0**-13
    return torch.maximum(x.abs() / 16, scale / 1024) + scale * 2.0**-13


def block_scales(x: torch.Tensor, dtype: torch.dtype, block: int) -> torch.Tensor:
    """Each element's block scale, absmax / 127 (int8), / 448 (e4m3) or / 7 (int4), or absmax (int2), in fp64,
    broadcast to x's length."""
    from flwr_sharded.parallel.codecs.blockwise import qmax

    n = x.numel()
    padded = torch.zeros(math.ceil(n / block) * block, dtype=torch.float64)
    padded[:n] = x.double().abs()
    absmax = padded.view(-1, block).amax(1)
    scale = absmax if dtype == INT2 else absmax / qmax(dtype) * (1 + 2 * U)  # the fp32 division rounds it once
    return scale.repeat_interleave(block)[:n]


def sample(n: int, seed: int, *, outlier: bool = False, zero_block: bool = False, block: int = 256) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * (1 + seed % 5)
    if outlier and n > block:
        x[block + 3] = 1e4 * (1 + seed % 3)  # one huge element: coarsens its own block only
    if zero_block and n > 3 * block:
        x[2 * block:3 * block] = 0
    return x



# ----- quantize / dequantize -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [INT8, FP8, INT4, FP4, INT2], ids=["int8", "fp8", "int4", "fp4", "int2"])
@pytest.mark.parametrize("case", ["random", "zeros", "outlier", "partial", "odd", "tiny-values", "huge-values"])
def test_dequantize_is_within_half_a_step_of_the_input(dtype, case):
    from flwr_sharded.parallel.codecs.blockwise import dequantize, qmax, quantize, wire_bytes

    block = 256
    n = {"partial": 1000, "odd": 1001, "zeros": 512}.get(case, 4 * block)
    x = {"zeros": torch.zeros(n), "tiny-values": sample(n, 1) * 1e-30, "huge-values": sample(n, 2) * 1e30}.get(
        case, sample(n, 3, outlier=True))
    q = quantize(x, dtype, block)
    if dtype in PACKED:  # two or four codes per byte, the first in the low bits
        assert q.values.dtype == torch.uint8 and q.values.numel() == math.ceil(n / PACKED[dtype])
        name = {INT4: "int4", FP4: "float4_e2m1", INT2: "int2"}[dtype]
        assert torch.equal(quantize(x, name, block).values, q.values)  # a wire name names the same format
    else:
        assert q.values.dtype == dtype and q.values.numel() == n
    assert q.scales.numel() == math.ceil(n / block) and q.nbytes == wire_bytes(n, dtype, block)
    y = dequantize(q)
    assert y.dtype == torch.float32 and y.shape == x.shape
    scale = block_scales(x, dtype, block)
    err = (y.double() - x.double()).abs()
    assert bool((err <= rounding_bound(x.double(), scale, dtype)).all()), float((err - scale / 2).max())
    codes = q.codes()
    assert codes.shape == x.shape and float(codes.abs().max()) <= qmax(dtype)
    if dtype in (INT8, INT4):  # integer codes: the decoded values are the codes times their block's scale
        assert torch.equal(codes, codes.round()) and torch.equal(y, codes * q.scales.repeat_interleave(block)[:n])
    if dtype == INT2:  # the signed classes of -b, -a, a, b; each magnitude's sign kept
        assert set(codes.tolist()) <= {-1.5, -0.5, 0.5, 1.5} and bool((codes * x >= 0).all())
    if case == "zeros":
        assert torch.equal(y, x)
    else:  # every block's largest element takes the largest code
        assert all(float(c.abs().max()) == qmax(dtype) for c in codes.split(block))
    if case == "outlier" and dtype == INT8:  # the outlier's block is coarse, the others keep their own fine step
        assert float(err[:block].max()) < 0.1 < float(err[block:2 * block].max())


def test_int2_decodes_each_magnitude_class_as_its_mean_close_to_lloyd_max_for_a_gaussian():
    from flwr_sharded.parallel.codecs.blockwise import dequantize, quantize

    x = torch.randn(1 << 18, generator=torch.Generator().manual_seed(5)) * torch.rand(1 << 18).add(0.1).repeat(1)
    blocks, decoded = x.view(-1, 256), dequantize(quantize(x, INT2)).view(-1, 256)
    rms = blocks.pow(2).mean(1, keepdim=True).sqrt()
    outer = blocks.abs() >= rms
    for level, mask in ((decoded.abs().amin(1), ~outer), (decoded.abs().amax(1), outer)):  # a, then b
        mean = (blocks.abs() * mask).sum(1) / mask.sum(1)
        assert torch.allclose(level, mean, rtol=2.0**-8), float(((level - mean) / mean).abs().max())
    assert torch.equal(decoded.sign(), blocks.sign())
    # Max (1960): the 4-level Lloyd-Max quantizer's mean square error for a unit Gaussian is 0.1175 (levels 0.453 and
    # 1.510 sigma split at 0.982); the class means of each block's own split come within 2% of it
    g = torch.randn(1 << 18, generator=torch.Generator().manual_seed(6))
    relative = float((dequantize(quantize(g, INT2)) - g).pow(2).mean() / g.pow(2).mean())
    assert abs(relative - 0.1175) < 0.0024, relative


def test_int2_error_is_smaller_than_the_block_where_fixed_levels_are_not():
    """A contraction, which keeps error feedback's residual bounded: one large value among small ones."""
    from flwr_sharded.parallel.codecs.blockwise import dequantize, quantize

    block = torch.full((256,), 1e-3)
    block[7] = -100.0
    error = dequantize(quantize(block, INT2)) - block
    assert float(error.norm()) < 1e-3 * float(block.norm())
    fixed = torch.where(block.abs() >= block.pow(2).mean().sqrt(), 1.5, 0.5) * block.pow(2).mean().sqrt()
    assert float((fixed * block.sign() - block).norm()) > float(block.norm())  # +-0.5, +-1.5 RMS: worse than 0


def test_wire_bytes():
    from flwr_sharded.parallel.codecs.blockwise import wire_bytes

    assert wire_bytes(1000, INT8, 256) == 1000 + 4 * 4
    assert wire_bytes(1024, FP8, 256) == 1024 + 4 * 4
    assert wire_bytes(0, INT8, 256) == 0
    assert wire_bytes(1000, INT4, 256) == 500 + 4 * 4 and wire_bytes(1001, "int4", 256) == 501 + 4 * 4
    assert wire_bytes(1001, INT2, 256) == 251 + 4 * 4
    with pytest.raises(ValueError, match="quantized wire dtype"):
        wire_bytes(10, torch.bfloat16)
    with pytest.raises(ValueError, match="quantized wire dtype must be a blockwise codec"):
        wire_bytes(10, "codebook2")  # the top-k rows' codebook has no blocks of scales
    with pytest.raises(ValueError, match="block of int4 must be a positive multiple of 2"):
        wire_bytes(10, INT4, 255)


def test_each_codebook_entry_is_the_mean_of_its_bins_values():
    """Four bins of 1.5 sigma around each block's mean: a value decodes as the mean of its bin's values (so each
    block's sum is kept), inner bins within their width, an empty bin as its centre; a partial last block alone."""
    from flwr_sharded.parallel.codecs.registry import codec_of
    from flwr_sharded.parallel.wire_base import CODEBOOK_BINS as BINS, CODEBOOK_BLOCK as BLOCK

    codebook, gen = codec_of("codebook2"), torch.Generator().manual_seed(3)
    values = torch.cat([torch.randn(2 * BLOCK + 300, generator=gen) * 3 + 1, torch.full((5,), 40.0)])
    codes, book = codebook.codes_and_books(values)
    decoded = codebook.book_values(codes, book)
    assert book.shape == (3, BINS) and codes.max() < BINS
    for b in range(3):
        v = values[b * BLOCK:(b + 1) * BLOCK].double()
        c, d = codes[b * BLOCK:(b + 1) * BLOCK], decoded[b * BLOCK:(b + 1) * BLOCK]
        mean, sigma = v.mean(), v.std(unbiased=False)
        expected = torch.bucketize(v - mean, torch.tensor([-1.5, 0.0, 1.5], dtype=torch.float64) * sigma, right=True)
        assert torch.equal(c.long(), expected)
        for k in range(BINS):
            inside = c == k
            assert inside.any()
            assert torch.allclose(d[inside].double(), v[inside].mean().expand(int(inside.sum())), rtol=1e-5)
        inner = (c == 1) | (c == 2)
        assert float((d[inner].double() - v[inner]).abs().max()) <= 1.5 * float(sigma) * (1 + 1e-5)
        assert abs(float(d.double().sum() - v.sum())) < 1e-3 * float(v.abs().sum())
    two = torch.tensor([-1.0, 1.0] * 8)  # mean 0, sigma 1: bins 0 and 3 are empty
    _, book = codebook.codes_and_books(two)
    assert book[0].tolist() == [-2.25, -1.0, 1.0, 2.25]
    same = torch.full((10,), 0.5)
    assert torch.equal(codebook.book_values(*codebook.codes_and_books(same)), same)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("n", [1, 3, 4, 1027])
def test_the_packer_round_trips_codes_of_every_width(bits, n):
    """The one packer: unsigned codes of `bits` bits, 8 / bits to a byte, the first in the low bits; unpacked
    through a byte table of the codes themselves (8-bit codes: the bytes' signed values)."""
    from flwr_sharded.parallel.codecs.packing import CodePacker
    from flwr_sharded.parallel.workspace import Workspace

    packer = CodePacker(bits)
    high = 1 << bits if bits < 8 else 128
    codes = torch.randint(0, high, (n,), generator=torch.Generator().manual_seed(n)).float()
    padded = torch.zeros(packer.payload_bytes(n) * packer.codes_per_byte)
    padded[:n] = codes
    packed = torch.empty(packer.payload_bytes(n), dtype=torch.uint8)
    packer.pack(padded, packed, Workspace())
    first = padded[:packer.codes_per_byte].long().tolist()
    assert int(packed[0]) == sum(c << bits * i for i, c in enumerate(first))  # the first code in the low bits

    class Codes:  # a codec whose code values are the codes themselves
        def byte_table(self):
            return packer.byte_fields().float()

    out = torch.empty(packed.numel() * packer.codes_per_byte)
    packer.unpack(packed, out, Codes(), Workspace())
    assert torch.equal(out[:n], codes)


@pytest.mark.parametrize("n", [1, 3, 4, 1027])
def test_codebook_codes_round_trip_through_the_packer(n):
    from flwr_sharded.parallel.codecs.registry import codec_of

    codebook = codec_of("codebook2")
    codes = torch.randint(0, 4, (n,), generator=torch.Generator().manual_seed(n), dtype=torch.uint8)
    packed = torch.empty(-(-n // 4), dtype=torch.uint8)
    codebook.pack_codes(codes, packed)
    assert torch.equal(codebook.unpack_codes(packed, n), codes.float())


@pytest.mark.parametrize("signal", ["constant", "fresh"])
def test_int2_error_feedback_residual_settles_over_many_syncs(signal):
    """e <- x - Q(x), x = s + e: bounded, as a contraction makes it. With c the largest ||x - Q(x)|| / ||x|| met
    (c < 1: Q is a contraction), ||e_t+1|| <= c (||s_t|| + ||e_t||) <= c / (1 - c) max ||s|| by induction from
    e_0 = 0; a signal that never changes is the slowest case, its residual settling near 1.5 ||s||."""
    from flwr_sharded.parallel.codecs.registry import codec_of
    from flwr_sharded.parallel.workspace import Workspace

    codec, ws, gen = codec_of(INT2), Workspace(), torch.Generator().manual_seed(11)
    s, e, norms = torch.randn(16 * 256, generator=gen), torch.zeros(16 * 256), []
    ratios, signal_norms = [], []
    for _ in range(300):
        if signal == "fresh":
            s = torch.randn(16 * 256, generator=gen)
        x = s + e
        src = x.clone().view(16, 256)
        codec.quantize_blocks(src, torch.empty(16, 64, dtype=torch.uint8), torch.empty(16), src, True, ws)
        e = src.reshape(-1)
        ratios.append(float(e.norm() / x.norm()))
        signal_norms.append(float(s.norm()))
        norms.append(float(e.norm()))
    c = max(ratios)
    assert c < 1, c
    assert max(norms) <= c / (1 - c) * max(signal_norms) * (1 + 1e-5), (max(norms), c)
    assert max(norms[200:]) <= 1.05 * max(norms[100:200])  # settled
