"""The float8_e5m2 wire: blockwise e5m2 rounding within 1/8 of each value, and a 2-rank sync that ends at the
central weighted mean within the ring's roundings, bit-identical on both ranks."""

from __future__ import annotations

import math

import pytest
import torch

from tests.multiproc import run_ranks

U = 2.0**-24  # fp32 unit roundoff
E5M2, QMAX = torch.float8_e5m2, 57344.0
BLOCK = 256
WEIGHTS = [1.0, 3.0]


def block_scales(x: torch.Tensor) -> torch.Tensor:
    """Each element's block scale, absmax / 57344 (fp64, rounded up by the fp32 division's error)."""
    n = x.numel()
    padded = torch.zeros(math.ceil(n / BLOCK) * BLOCK, dtype=torch.float64)
    padded[:n] = x.double().abs()
    return (padded.view(-1, BLOCK).amax(1) / QMAX * (1 + 2 * U)).repeat_interleave(BLOCK)[:n]


def rounding_bound(x: torch.Tensor) -> torch.Tensor:
    """Largest |dequantize(quantize(x)) - x| (fp64): 2 mantissa bits round to within 1/8 of the scaled value
    (normal range) or half the smallest subnormal step 2^-16, plus the fp32 roundings of x / scale and code * scale."""
    x = x.double().abs()
    return torch.maximum(x / 8, block_scales(x) * 2.0**-17) + 4 * U * x


def sample(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * (1 + seed % 5)
    x[BLOCK + 3] = 1e4  # an outlier coarsens its own block only
    x[2 * BLOCK:3 * BLOCK] *= 1e-30  # a block of tiny values keeps their relative precision
    return x


def test_the_wire_is_registered_with_the_blockwise_scheme():
    from flwr_sharded.parallel.codecs.blockwise import qmax
    from flwr_sharded.parallel.wire import QUANTIZED, SYNC_DTYPE_BYTES, WIRES, check_wire_dtype

    wire = WIRES["float8_e5m2"]
    assert wire.torch_dtype() == E5M2 and qmax(E5M2) == QMAX and "float8_e5m2" in QUANTIZED
    assert SYNC_DTYPE_BYTES["float8_e5m2"] == SYNC_DTYPE_BYTES["int8"] == 1 + 4 / BLOCK
    assert check_wire_dtype("float8_e5m2", "cpu") == E5M2  # torch casts to e5m2 exactly on CPU


def test_e5m2_dequantize_is_within_an_eighth_of_each_value():
    from flwr_sharded.parallel.codecs.blockwise import dequantize, quantize, wire_bytes

    n = 4 * BLOCK + 77
    x = sample(n, 3)
    q = quantize(x, E5M2, BLOCK)
    assert q.values.dtype == E5M2 and q.values.numel() + 4 * q.scales.numel() == wire_bytes(n, E5M2, BLOCK)
    err = (dequantize(q).double() - x.double()).abs()
    assert bool((err <= rounding_bound(x)).all()), float((err - rounding_bound(x)).max())
    codes = q.values.float()
    assert all(float(c.abs().max()) == QMAX for c in codes.split(BLOCK))  # each block's absmax takes the top code
    tiny = slice(2 * BLOCK, 3 * BLOCK)  # its own scale: relative error 1/8, not lost to the outlier's scale
    assert float((err[tiny] / x[tiny].double().abs()).max()) <= 1 / 8 + 8 * U


def _sync_worker(rank: int, world: int, n: int):
    from datetime import timedelta

    import torch.distributed as dist

    from flwr_sharded.parallel.ring import all_reduce_bytes
    from flwr_sharded.parallel.sync import ShardSync
    from flwr_sharded.parallel.wire import wire_of

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    param = torch.nn.Parameter(sample(n, 0))  # the global model, the same on both ranks
    sync = ShardSync([("p", param)], fed_group=dist.group.WORLD, wire=wire_of(E5M2), error_feedback=True)
    sync.capture_global()
    with torch.no_grad():
        param.add_(0.1 * sample(n, 10 + rank))  # local steps
    before = param.detach().clone()
    sent = sync.sync(weight=WEIGHTS[rank]).bytes
    return {"before": before, "after": param.detach().clone(), "sent": sent,
            "expected_sent": all_reduce_bytes(n, world, E5M2),
            "residual_finite": all(bool(torch.isfinite(r).all()) for r in sync.state.feedback.residuals.values())}


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_two_rank_e5m2_sync_is_the_central_weighted_mean_within_the_rings_roundings():
    n = 3 * BLOCK + 77
    out = run_ranks(_sync_worker, 2, n, timeout=90)
    global_ = sample(n, 0).double()
    total = sum(WEIGHTS)
    deltas = [(w / total) * (res["before"].double() - global_) for res, w in zip(out, WEIGHTS)]
    expected = global_ + sum(deltas)
    # each chunk's first value is rounded to travel, the sum once more to be gathered (W = 2 roundings), each
    # within 1/8 of a value no larger than M = |d0| + |d1| (plus the first rounding's error), plus fp32 roundings
    m = sum(d.abs() for d in deltas)
    first = m / 8 + block_scales(m) * 2.0**-17 + 4 * U * m
    second = (m + first) / 8 + block_scales(m + first) * 2.0**-17 + 4 * U * (m + first)
    bound = first + second + 8 * U * m + 2 * U * expected.abs()
    err = (out[0]["after"].double() - expected).abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    assert float(err.max()) < 0.5 * float(m.max())  # far from leaving a rank out (an error of up to |d_r|)
    assert torch.equal(out[0]["after"], out[1]["after"])  # both ranks decode the same bytes
    assert all(r["sent"] == r["expected_sent"] > 0 and r["residual_finite"] for r in out)
