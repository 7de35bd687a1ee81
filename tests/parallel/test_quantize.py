"""The quantized all-reduce (int8, fp8, int4, int2): blockwise rounding bounds, the reduced sum on 2 and 3 gloo ranks,
bytes, feedback."""

from __future__ import annotations

import io
import math

import pytest
import torch

from tests.multiproc import run_ranks

U = 2.0**-24  # fp32 unit roundoff
GATHER = "all_gather_single" if hasattr(torch.distributed, "all_gather_single") else "all_gather_into_tensor"
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
    from flwr_sharded.parallel.quantize import qmax

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
    from flwr_sharded.parallel.quantize import dequantize, qmax, quantize, wire_bytes

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
    from flwr_sharded.parallel.quantize import dequantize, quantize

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
    from flwr_sharded.parallel.quantize import dequantize, quantize

    block = torch.full((256,), 1e-3)
    block[7] = -100.0
    error = dequantize(quantize(block, INT2)) - block
    assert float(error.norm()) < 1e-3 * float(block.norm())
    fixed = torch.where(block.abs() >= block.pow(2).mean().sqrt(), 1.5, 0.5) * block.pow(2).mean().sqrt()
    assert float((fixed * block.sign() - block).norm()) > float(block.norm())  # +-0.5, +-1.5 RMS: worse than 0


def test_wire_bytes_and_the_all_reduce_byte_count():
    from flwr_sharded.parallel.quantize import all_reduce_bytes, wire_bytes

    assert wire_bytes(1000, INT8, 256) == 1000 + 4 * 4
    assert wire_bytes(1024, FP8, 256) == 1024 + 4 * 4
    assert wire_bytes(0, INT8, 256) == 0
    assert wire_bytes(1000, INT4, 256) == 500 + 4 * 4 and wire_bytes(1001, "int4", 256) == 501 + 4 * 4
    # 200 003 elements, 3 ranks: 782 blocks, 261 per rank; each rank sends 2 of its 3 rows twice
    assert all_reduce_bytes(200_003, 3, INT8, 256) == 2 * 2 * (261 * 256 + 4 * 261)
    assert all_reduce_bytes(200_003, 1, INT8, 256) == 0
    assert all_reduce_bytes(200_003, 3, INT4, 256) == 2 * 2 * (261 * 128 + 4 * 261)  # half a byte a value
    assert wire_bytes(1001, INT2, 256) == 251 + 4 * 4
    assert all_reduce_bytes(200_003, 3, INT2, 256) == 2 * 2 * (261 * 64 + 4 * 261)  # a quarter of a byte a value
    with pytest.raises(ValueError, match="quantized wire dtype"):
        wire_bytes(10, torch.bfloat16)
    with pytest.raises(ValueError, match="block of int4 must be a positive multiple of 2"):
        wire_bytes(10, INT4, 255)


# ----- the all-reduce on 2 and 3 ranks -------------------------------------------------------------------------
CASES = {  # name: (numel, dtype, block, sample kwargs)
    "partial": (5 * 256 + 77, INT8, 256, {"outlier": True, "zero_block": True}),
    "partial-fp8": (5 * 256 + 77, FP8, 256, {"outlier": True, "zero_block": True}),
    "partial-int4": (5 * 256 + 77, INT4, 256, {"outlier": True, "zero_block": True}),
    "odd-block-int4": (1001, INT4, 100, {}),
    "partial-fp4": (5 * 256 + 77, FP4, 256, {"outlier": True, "zero_block": True}),
    "partial-int2": (5 * 256 + 77, INT2, 256, {"outlier": True, "zero_block": True}),
    "odd-block-int2": (1000, INT2, 100, {}),
    "no-padding": (None, INT8, 256, {}),  # W * 2 blocks: every chunk lies wholly in the tensor
    "tiny": (10, INT8, 256, {}),  # one partial block: the other ranks' chunks are all padding
    "odd-block": (1000, INT8, 100, {}),
    "large": (200_003, INT8, 256, {}),  # for the byte ratio against a ring fp32 all-reduce
    "large-int4": (200_003, INT4, 256, {}),
    "large-int2": (200_003, INT2, 256, {}),
}
FEEDBACK_CASES = ("partial", "partial-fp8", "partial-int4", "partial-fp4", "partial-int2", "no-padding")


def _reduce_worker(rank: int, world: int):
    from datetime import timedelta

    import torch.distributed as dist

    from flwr_sharded.parallel.quantize import Workspace, quantized_all_reduce
    from flwr_sharded.parallel.traffic import TrafficMeter

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    ws = Workspace()  # reused across cases of different sizes, as a sync reuses it across buckets
    out = {}
    for name, (n, dtype, block, kwargs) in CASES.items():
        flat = sample(n or world * 2 * 256, 10 * rank + 1, block=block, **kwargs)
        with TrafficMeter() as meter:
            sent = quantized_all_reduce(flat, dtype=dtype, block=block, workspace=ws)
        out[name] = {"flat": flat, "sent": sent, "ops": [(r.op, r.nbytes) for r in meter.records]}
    for name in FEEDBACK_CASES:  # with (zero) residuals: the same codes, errors kept
        n, dtype, block, kwargs = CASES[name]
        n = n or world * 2 * 256
        flat, residual = sample(n, 10 * rank + 1, block=block, **kwargs), torch.zeros(n)
        quantized_all_reduce(flat, dtype=dtype, block=block, residual=residual, workspace=ws)
        out[name + "+feedback"] = {"flat": flat, "residual": residual}
    singles = [dist.new_group([r]) for r in range(world)]  # every rank calls new_group for every group
    x = sample(300, 7)
    y = x.clone()
    out["alone"] = (quantized_all_reduce(y, singles[rank]), torch.equal(x, y))
    return out


def ring_bound(xs: list[torch.Tensor], dtype: torch.dtype, block: int) -> torch.Tensor:
    """Largest error of the ring's result per element (fp64). Chunk c's values are summed in the order of ranks
    c, c + 1, ..., c + W - 1; each partial sum of the first j of them (j = 1 .. W - 1) is rounded to travel and
    the whole sum (j = W) once more for the gather: e <= sum_j bound(P_j, s_j), with P_j the sum of the first j
    magnitudes plus the errors before it (an upper bound of the partial sum) and s_j its block scale; plus the fp32
    additions, < W u A."""
    world, n = len(xs), xs[0].numel()
    chunk = math.ceil(math.ceil(n / block) / world) * block
    c = torch.arange(n) // chunk
    order = (c.unsqueeze(0) + torch.arange(world).unsqueeze(1)) % world  # row j: the j-th contributor
    magnitudes = torch.stack([x.double().abs() for x in xs]).gather(0, order)
    errors = torch.zeros(n, dtype=torch.float64)
    for j in range(1, world + 1):
        partial = magnitudes[:j].sum(0) + errors
        errors = errors + rounding_bound(partial, block_scales(partial, dtype, block), dtype)
    return errors + world * U * (magnitudes.sum(0) + errors)


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_quantized_all_reduce_is_the_sum_within_its_roundings_bit_identical_and_sends_a_quarter(world):
    from flwr_sharded.parallel.quantize import all_reduce_bytes

    out = run_ranks(_reduce_worker, world, timeout=150)
    for name, (n, dtype, block, kwargs) in CASES.items():
        n = n or world * 2 * 256
        xs = [sample(n, 10 * r + 1, block=block, **kwargs) for r in range(world)]
        exact = sum(x.double() for x in xs)
        bound = ring_bound(xs, dtype, block)
        result = out[0][name]["flat"]
        err = (result.double() - exact).abs()
        assert bool((err <= bound).all()), (name, float((err - bound).max()))
        if kwargs.get("zero_block"):
            assert not result[2 * block:3 * block].any()  # zeros everywhere stay exactly zero
        for res in out[1:]:
            assert torch.equal(res[name]["flat"], result), name  # every rank ends bit-identical
        for res in out:
            sent = res[name]["sent"]
            assert sent == all_reduce_bytes(n, world, dtype, block)
            # only quantized rows travel (no fp32 fall-back): W - 1 sends to the ring's next rank, then one gather of
            # W rows (the meter counts the gather's full payload)
            ops = res[name]["ops"]
            assert [op for op, _ in ops] == ["send"] * (world - 1) + [GATHER], ops
            row = sent // (2 * (world - 1))
            assert all(nbytes == row for op, nbytes in ops[:-1]) and ops[-1][1] == world * row
    for name in FEEDBACK_CASES:
        n, dtype, block, kwargs = CASES[name]
        n = n or world * 2 * 256
        xs = [sample(n, 10 * r + 1, block=block, **kwargs) for r in range(world)]
        result = out[0][name + "+feedback"]["flat"]
        assert torch.equal(result, out[0][name]["flat"])  # a zero residual changes nothing on the wire
        # the residuals are what the result misses, up to the fp32 roundings of the sums and of the errors
        missed = sum(x.double() for x in xs) - result.double() - sum(res[name + "+feedback"]["residual"].double()
                                                                     for res in out)
        assert float(missed.abs().max()) <= 4 * world * U * float(sum(x.abs().double() for x in xs).max()), name
    ring_fp32 = 2 * (world - 1) / world * 4 * CASES["large"][0]
    assert out[0]["large"]["sent"] <= 0.27 * ring_fp32, out[0]["large"]["sent"] / ring_fp32
    assert out[0]["large-int4"]["sent"] <= 0.14 * ring_fp32, out[0]["large-int4"]["sent"] / ring_fp32
    assert out[0]["large-int2"]["sent"] <= 0.07 * ring_fp32, out[0]["large-int2"]["sent"] / ring_fp32
    assert all(res["alone"] == (0, True) for res in out)  # a group of one: nothing sent, exact


# ----- error feedback ------------------------------------------------------------------------------------------
ROUNDS = 50


def _feedback_worker(rank: int, world: int, n: int, dtype: torch.dtype):
    from datetime import timedelta

    import torch.distributed as dist

    from flwr_sharded.parallel.quantize import ErrorFeedback, Workspace, quantized_all_reduce

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    ws = Workspace()

    def signal(r: int, t: int) -> torch.Tensor:  # each round moves it by at most ~1/30 of a quantization step
        return sample(n, 100 + r) + 2e-4 * t * sample(n, 200 + r)

    errors, rollback_equal = {}, None
    for mode in ("feedback", "none"):
        feedback = ErrorFeedback() if mode == "feedback" else None
        running = torch.zeros(n, dtype=torch.float64)
        exact = torch.zeros(n, dtype=torch.float64)
        errors[mode] = []
        for t in range(ROUNDS):
            residual = feedback.residual("bucket0", running) if feedback else None
            if feedback and t == ROUNDS // 2:  # a checkpoint, a round, a rollback, the same round again
                saved = io.BytesIO()
                torch.save(feedback.state_dict(), saved)
                first = signal(rank, t)
                quantized_all_reduce(first, dtype=dtype, residual=residual, workspace=ws)
                saved.seek(0)
                feedback.load_state_dict(torch.load(saved))
                residual = feedback.residual("bucket0", running)
            flat = signal(rank, t)
            quantized_all_reduce(flat, dtype=dtype, residual=residual, workspace=ws)
            if feedback and t == ROUNDS // 2:
                rollback_equal = torch.equal(first, flat)
            running += flat.double()
            exact += sum(signal(r, t).double() for r in range(world))
            errors[mode].append(float((running - exact).abs().max()))
    absmax = max(float(signal(r, t).abs().max()) for r in range(world) for t in (0, ROUNDS - 1))
    return {"errors": errors, "absmax": absmax, "rollback_equal": rollback_equal}


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize("dtype", [INT8, INT4, INT2], ids=["int8", "int4", "int2"])
def test_error_feedback_keeps_the_running_sum_within_one_rounds_error_and_without_it_the_error_grows(dtype):
    from flwr_sharded.parallel.quantize import qmax

    world, n = 3, 3 * 256 + 50
    out = run_ranks(_feedback_worker, world, n, dtype, timeout=150)
    errors, absmax = out[0]["errors"], max(res["absmax"] for res in out)
    # With feedback the running sum misses exactly the sum of the residuals: on each element, the rounding errors of
    # the W - 1 partial sums that travel and of the whole sum, the j-th partial's block absmax <= j absmax (1 +
    # 1/100): each error <= absmax / (2 qmax) of it (int2: 15/16 of it, `rounding_bound`): <= (1 + 2 + ... + W) x
    # that, whatever the number of rounds.
    # int2's residual is not one rounding's error: it settles over tens of rounds (the in-process test below bounds
    # it), so only its drift is checked here
    if dtype != INT2:
        bound = world * (world + 1) / 2 * absmax / (2 * qmax(dtype)) * 1.01
        assert max(errors["feedback"]) <= bound, (max(errors["feedback"]), bound)
        assert errors["none"][-1] > 4 * bound, errors["none"]
    assert max(errors["feedback"][ROUNDS // 2:]) <= 2 * max(errors["feedback"][:ROUNDS // 2])  # no drift
    # without feedback the nearly constant rounding error adds up round after round
    assert errors["none"][-1] > 3 * errors["none"][ROUNDS // 5 - 1], errors["none"]
    assert errors["none"][-1] > 2 * errors["feedback"][-1], (errors["none"][-1], errors["feedback"][-1])
    assert all(res["rollback_equal"] for res in out)  # the restored residuals redo the round bit for bit
    for res in out[1:]:
        assert res["errors"] == errors  # the same running sums everywhere


@pytest.mark.parametrize("signal", ["constant", "fresh"])
def test_int2_error_feedback_residual_settles_over_many_syncs(signal):
    """e <- x - Q(x), x = s + e: bounded, as a contraction makes it. With c the largest ||x - Q(x)|| / ||x|| met
    (c < 1: Q is a contraction), ||e_t+1|| <= c (||s_t|| + ||e_t||) <= c / (1 - c) max ||s|| by induction from
    e_0 = 0; a signal that never changes is the slowest case, its residual settling near 1.5 ||s||."""
    from flwr_sharded.parallel.quantize import Workspace, code_format

    fmt, ws, gen = code_format(INT2), Workspace(), torch.Generator().manual_seed(11)
    s, e, norms = torch.randn(16 * 256, generator=gen), torch.zeros(16 * 256), []
    ratios, signal_norms = [], []
    for _ in range(300):
        if signal == "fresh":
            s = torch.randn(16 * 256, generator=gen)
        x = s + e
        src = x.clone().view(16, 256)
        fmt.quantize_blocks(src, torch.empty(16, 64, dtype=torch.uint8), torch.empty(16), src, True, ws)
        e = src.reshape(-1)
        ratios.append(float(e.norm() / x.norm()))
        signal_norms.append(float(s.norm()))
        norms.append(float(e.norm()))
    c = max(ratios)
    assert c < 1, c
    assert max(norms) <= c / (1 - c) * max(signal_norms) * (1 + 1e-5), (max(norms), c)
    assert max(norms[200:]) <= 1.05 * max(norms[100:200])  # settled


def test_error_feedback_state_is_a_snapshot_and_residuals_must_fit_their_buffer():
    from flwr_sharded.parallel.quantize import ErrorFeedback

    feedback = ErrorFeedback()
    res = feedback.residual(0, torch.empty(8))
    assert torch.equal(res, torch.zeros(8)) and feedback.residual(0, torch.empty(8)) is res
    res.fill_(1.0)
    state = feedback.state_dict()
    res.fill_(2.0)  # later rounds do not change a saved state
    feedback.load_state_dict(state)
    assert torch.equal(feedback.residual(0, torch.empty(8)), torch.ones(8))
    with pytest.raises(ValueError, match="residual 0 has 8 elements"):
        feedback.residual(0, torch.empty(9))


def test_quantized_all_reduce_refuses_what_it_cannot_carry():
    from flwr_sharded.parallel.quantize import quantized_all_reduce

    with pytest.raises(ValueError, match="flat contiguous fp32"):
        quantized_all_reduce(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="flat contiguous fp32"):
        quantized_all_reduce(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="quantized wire dtype"):
        quantized_all_reduce(torch.zeros(4), dtype=torch.bfloat16)


# ----- the wire dtype option -----------------------------------------------------------------------------------
def test_check_wire_dtype_allows_int8_everywhere_and_fp8_where_the_device_casts_it(monkeypatch):
    from flwr_sharded.errors import ConfigError
    from flwr_sharded.parallel import wire

    assert wire.check_wire_dtype("int8", "cpu") == INT8
    assert wire.check_wire_dtype("float8_e4m3fn", "cpu") == FP8  # torch >= 2.1 casts to e4m3 on CPU
    assert wire.check_wire_dtype("int4", "cpu") == INT4  # torch's placeholder dtype names the format
    assert wire.check_wire_dtype("float4_e2m1", "cpu") == FP4  # decoded through a table: anywhere
    assert wire.check_wire_dtype("int2", "cpu") == INT2
    with pytest.raises(ConfigError, match=r"--sync-dtype float16 is not a quantized wire dtype.*int8, float8_e4m3fn"):
        wire.check_wire_dtype("float16", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, ok in (((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert wire.check_wire_dtype("int8", "cuda:0") == INT8
        if ok:
            assert wire.check_wire_dtype("float8_e4m3fn", "cuda:0") == FP8
        else:
            with pytest.raises(ConfigError, match=r"--sync-dtype float8_e4m3fn needs .*capability >= 8.9.*: "
                                                  r"int8, int4, float4_e2m1, int2$"):
                wire.check_wire_dtype("float8_e4m3fn", "cuda:0")
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: (_ for _ in ()).throw(RuntimeError("no e4m3")))
    with pytest.raises(ConfigError, match="on cpu: int8, int4, float4_e2m1, int2$"):  # a CPU that cannot cast to e4m3
        wire.check_wire_dtype("float8_e4m3fn", "cpu")
