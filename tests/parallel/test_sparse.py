"""The top-k shard sync (`flwr_sharded.parallel.sparse`): the kept entries, their sum, the residual, the bytes."""

from __future__ import annotations

import pytest
import torch

from tests.multiproc import run_ranks

NUMEL = 3 * 4096 + 1000  # three whole chunks and a partial one


def _wire(values: str):
    from flwr_sharded.parallel.wire import WIRES

    return WIRES[values]


def _layout(values: str, fraction: float = 0.02, numel: int = NUMEL):
    from flwr_sharded.parallel.sparse import RowLayout

    return RowLayout(numel, fraction, _wire(values))


def _rank_rows(xs: list[torch.Tensor], residuals: list[torch.Tensor | None], layout, scales=None,
               merge: str = "sum", decay: float = 1.0) -> torch.Tensor:
    """Every emulated rank's row of its delta (`xs`, overwritten), residuals updated: (W, row bytes)."""
    from flwr_sharded.parallel.sparse import contribute

    rows = torch.empty(len(xs), layout.bytes, dtype=torch.uint8)
    for x, residual, row, scale in zip(xs, residuals, rows, scales or [1.0] * len(xs)):
        contribute(x, residual, layout, row, torch.empty_like(x), scale, merge=merge, decay=decay)
    return rows


@pytest.mark.parametrize("values", ["float32", "bfloat16", "int8"])
def test_the_sparse_sum_is_the_dense_sum_of_each_ranks_largest_entries(values):
    """Three emulated ranks: each keeps ceil(2% x chunk) entries per chunk, the largest in magnitude; the summed rows
    equal a dense fp64 sum of those entries as the wire rounds them, and each rank's residual is its input minus
    what it sent."""
    from flwr_sharded.parallel.sparse import CHUNK, accumulate, decode_row, kept_of

    layout, gen = _layout(values), torch.Generator().manual_seed(0)
    inputs = [torch.randn(NUMEL, generator=gen) for _ in range(3)]
    residuals = [torch.randn(NUMEL, generator=gen) * 0.1 for _ in range(3)]
    totals = [x + r for x, r in zip(inputs, residuals)]
    rows = _rank_rows([x.clone() for x in inputs], residuals, layout)
    dense = torch.zeros(NUMEL, dtype=torch.float64)
    for total, residual, row in zip(totals, residuals, rows):
        sent = total - residual
        for start in range(0, NUMEL, CHUNK):
            chunk, kept = total[start:start + CHUNK], sent[start:start + CHUNK] != 0
            assert int(kept.sum()) == kept_of(chunk.numel(), 0.02)
            assert chunk[kept].abs().min() >= chunk[~kept].abs().max()  # the largest entries, and only those
        indices, decoded = decode_row(row, layout)
        starts = torch.cat([torch.arange(layout.full).repeat_interleave(layout.per_chunk) * CHUNK,
                            torch.full((layout.kept - layout.full * layout.per_chunk,), layout.full * CHUNK)])
        dense.index_add_(0, starts + indices, decoded.double())
        assert torch.allclose(sent.double().index_select(0, starts + indices), decoded.double(), atol=1e-6)
    out = torch.empty(NUMEL)
    accumulate(out, rows, layout)
    assert torch.allclose(out.double(), dense, atol=1e-6) and int((out != 0).sum()) <= 3 * layout.kept


def test_error_feedback_keeps_the_running_sum_within_the_residuals():
    """200 syncs of random deltas on two emulated ranks at 5% with int8 values: the running sum of the results plus
    the residuals equals the running sum of the inputs (fp32 accuracy), and the residuals stay bounded."""
    from flwr_sharded.parallel.sparse import accumulate

    layout, gen = _layout("int8", 0.05, numel=2 * 4096 + 100), torch.Generator().manual_seed(1)
    residuals = [torch.zeros(layout.numel) for _ in range(2)]
    inputs = torch.zeros(layout.numel, dtype=torch.float64)
    results = torch.zeros(layout.numel, dtype=torch.float64)
    norms = []
    out = torch.empty(layout.numel)
    for _ in range(200):
        xs = [torch.randn(layout.numel, generator=gen) for _ in range(2)]
        inputs += sum(x.double() for x in xs)
        accumulate(out, _rank_rows(xs, residuals, layout), layout)
        results += out.double()
        norms.append(float(sum(r.norm() for r in residuals)))
    gap = inputs - results - sum(r.double() for r in residuals)
    assert float(gap.abs().max()) < 1e-5 * float(inputs.abs().max()), float(gap.abs().max())
    assert max(norms[100:]) < 1.5 * max(norms[50:100]), (max(norms[50:100]), max(norms[100:]))  # no drift
    assert float(results.norm()) > 0.9 * float(inputs.norm())  # what was held back does arrive


def test_sent_bytes_counts_the_rows_of_a_ring_all_gather():
    from flwr_sharded.parallel.sparse import sent_bytes

    n = 16 << 20
    int8 = sent_bytes(n, 2, 0.02, _wire("int8"))
    assert int8 == _layout("int8", numel=n).bytes and 0.0125 < int8 / (4 * n) < 0.0127  # (1.5 + 1 + 4/256) x 2%
    assert sent_bytes(n, 4, 0.02, _wire("int8")) == 3 * int8 and sent_bytes(n, 1, 0.02, _wire("int8")) == 0
    fp32 = _layout("float32", numel=n)
    assert sent_bytes(n, 2, 0.02, _wire("float32")) == fp32.bytes == 4 + 5.5 * fp32.kept  # header, 12 + 32 bits


@pytest.mark.parametrize("values", ["float32", "bfloat16", "int8", "int4", "int2"])
@pytest.mark.parametrize("numel", [NUMEL, 4096, 4096 * 2 + 1, 5000, 3, 70 * 4096])
def test_the_row_layout_counts_the_bytes_encode_writes(values, numel):
    """The row is as long as what encode_row writes and no longer: nothing past `RowLayout.bytes` is touched, and the
    bytes encode_row leaves alone (found by encoding into a row of zeros and one of 0xFF) are only the header, which the
    caller writes, and each field's padding to 4 bytes; what it wrote decodes to the entries it kept."""
    from flwr_sharded.parallel.sparse import CHUNK, HEADER_BYTES, decode_row, encode_row, select

    for fraction in (0.02, 0.015625, 0.5):
        layout = _layout(values, fraction, numel)
        x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
        rows = [torch.full((layout.bytes + 16,), fill, dtype=torch.uint8) for fill in (0x00, 0xFF)]
        for row in rows:
            indices, kept = select(x, layout, torch.empty_like(x))
            sent = encode_row(indices, kept, layout, row[:layout.bytes])
        assert all(torch.all(row[layout.bytes:] == row[-1]) for row in rows)  # nothing written past the row
        untouched = (rows[0][:layout.bytes] != rows[1][:layout.bytes]).nonzero().view(-1)
        assert untouched[untouched >= HEADER_BYTES].numel() <= 3 * 3, (fraction, untouched.tolist())  # 3 fields
        assert set(range(HEADER_BYTES)) <= set(untouched.tolist())  # the weight share is the caller's
        got_indices, got_values = decode_row(rows[0][:layout.bytes], layout)
        assert torch.equal(got_indices, indices % CHUNK) and torch.equal(got_values, sent)


@pytest.mark.parametrize("n", [1, 2, 7, 64, 4096])
def test_twelve_bit_indices_round_trip(n):
    from flwr_sharded.parallel.sparse import pack_indices, unpack_indices

    gen = torch.Generator().manual_seed(n)
    for indices in (torch.randint(0, 4096, (n,), generator=gen), torch.zeros(n, dtype=torch.long),
                    torch.full((n,), 4095), torch.arange(n) % 2 * 4095, torch.arange(n) % 4096):
        packed = torch.empty(3 * -(-n // 2), dtype=torch.uint8)
        pack_indices(indices, packed)
        assert torch.equal(unpack_indices(packed, n), indices)
    packed = torch.empty(3, dtype=torch.uint8)
    pack_indices(torch.tensor([0xABC, 0x123]), packed)
    assert packed.tolist() == [0xBC, 0x3A, 0x12]  # low byte of the first, its high nibble and the second's low one


@pytest.mark.parametrize("values", ["float32", "bfloat16", "int8", "int4", "int2"])
def test_the_cost_models_ratio_is_the_rows_over_the_fp32_ring_all_reduce(values):
    from flwr_sharded.parallel.sparse import sent_bytes
    from flwr_sharded.parallel.wire import WIRES, sync_wire_ratio
    from flwr_sharded_perf.memory_model import StepOptions
    from flwr_sharded_perf.planner import planned_wire_ratio

    n = 4 << 20
    for world in (2, 4, 8):
        exact = sent_bytes(n, world, 0.02, WIRES[values]) / (2 * (world - 1) / world * 4 * n)
        assert sync_wire_ratio(values, 0.02, world) == pytest.approx(exact, rel=0.01)
        planned = planned_wire_ratio(WIRES[values].bytes_per_value, 4.0, world, StepOptions(sync_topk=0.02))
        assert planned == pytest.approx(exact, rel=0.01)  # the planner's, for fp32 units
    assert sync_wire_ratio(values) == WIRES[values].bytes_per_value / 4  # dense: the wire's own size
    assert sync_wire_ratio(values, 0.02, 8) == pytest.approx(4 * sync_wire_ratio(values, 0.02, 2))  # rows grow with F


def test_sparselocos_rows_take_about_a_145th_of_the_fp32_values():
    """Top-64 of 4096 with int2 values: 12 index bits and 2 code bits a kept value, plus 4 fp32 per 1024 of them
    (0.22 bits a value of the bucket, SparseLoCo's 146x); 0.0069x the fp32 ring all-reduce for 2 groups, 0.014x for
    4."""
    from flwr_sharded.parallel.sparse import sent_bytes
    from flwr_sharded.parallel.wire import sync_wire_ratio

    layout = _layout("int2", 0.015625, numel=16 << 20)
    assert layout.kept == 64 * 4096 and 32 * layout.numel / (8 * layout.bytes) == pytest.approx(144.97, rel=1e-3)
    assert layout.bytes == 4 + 16 * 256 + 1.5 * layout.kept + 0.25 * layout.kept
    for world, ratio in ((2, 0.006897), (4, 0.013794)):
        exact = sent_bytes(layout.numel, world, 0.015625, _wire("int2")) / (2 * (world - 1) / world * 4 * layout.numel)
        assert exact == pytest.approx(ratio, rel=1e-3) and sync_wire_ratio("int2", 0.015625, world) == pytest.approx(
            exact, rel=1e-4)


def _today(xs, residuals, scales, global_k, layout) -> torch.Tensor:
    """The top-k sync before scatter-mean, decay and packed indices: x = residual + scale x delta, its top entries
    rounded by the value wire, summed in rank order onto the global values; the residual keeps x less what was
    sent."""
    from flwr_sharded.parallel.codecs.blockwise import dequantize, quantize
    from flwr_sharded.parallel.sparse import scatter, select

    out = global_k.clone()
    for x, residual, scale in zip(xs, residuals, scales):
        total = residual.add_(x, alpha=scale)
        indices, values = select(total, layout, torch.empty_like(total))
        if layout.quantized:
            sent = dequantize(quantize(values, layout.values.torch_dtype()))
        else:
            sent = values.to(layout.values.torch_dtype()).float()
        scatter(residual, layout, indices, values - sent, add=False)
        scatter(out, layout, indices, sent, add=True)
    return out


@pytest.mark.parametrize("values", ["float32", "bfloat16", "int8", "int4"])
def test_the_sum_merge_without_decay_is_the_earlier_top_k_sync_bit_for_bit(values):
    from flwr_sharded.parallel.sparse import accumulate

    layout, gen = _layout(values), torch.Generator().manual_seed(4)
    global_k, scales = torch.randn(NUMEL, generator=gen), [0.2, 0.5, 0.3]
    xs = [torch.randn(NUMEL, generator=gen) for _ in scales]
    residuals = [torch.randn(NUMEL, generator=gen) * 0.1 for _ in scales]
    theirs = [r.clone() for r in residuals]
    expected = _today([x.clone() for x in xs], theirs, scales, global_k, layout)
    out = torch.empty(NUMEL)
    accumulate(out, _rank_rows([x.clone() for x in xs], residuals, layout, scales, "sum", 1.0), layout, global_k)
    assert torch.equal(out, expected) and all(torch.equal(a, b) for a, b in zip(residuals, theirs))


def _central_mean(rows, layout, global_k) -> torch.Tensor:
    """The scatter-mean in fp64 from the rows' decoded entries: each row clipped to the lower median norm of the
    members with a weight, each coordinate the weighted mean of its senders' clipped values."""
    from flwr_sharded.parallel.sparse import CHUNK, decode_row, share_of

    entries = []
    for row in rows:
        indices, values = decode_row(row, layout)
        chunk = torch.arange(layout.kept) // layout.per_chunk if layout.per_chunk else torch.zeros(0)
        chunk = torch.minimum(chunk, torch.tensor(layout.full))  # the partial chunk's entries follow the whole ones
        entries.append((chunk * CHUNK + indices, values.double(), float(share_of(row))))
    norms = [float(v.norm()) for _, v, _ in entries]
    included = sorted(n for n, (_, _, s) in zip(norms, entries) if s > 0)
    median = included[(len(included) - 1) // 2]
    numerator, denominator = torch.zeros(layout.numel, dtype=torch.float64), torch.zeros(layout.numel,
                                                                                        dtype=torch.float64)
    for (positions, values, share), norm in zip(entries, norms):
        clip = min(1.0, median / norm) if norm > 0 else 1.0
        numerator.index_add_(0, positions, share * clip * values)
        denominator.index_add_(0, positions, torch.full_like(values, share))
    sent = denominator > 0
    return torch.where(sent, global_k.double() + numerator / denominator.clamp_min(1e-300), global_k.double())


def _members(gen, overlap: bool = True) -> list[torch.Tensor]:
    """Four members' deltas: large entries shared by members 0 and 1 in chunk 0 (overlapping index sets), each
    member's own large entries in chunk 1 (disjoint ones)."""
    xs = [torch.randn(NUMEL, generator=gen) * 0.01 for _ in range(4)]
    for m, x in enumerate(xs):
        if overlap and m < 2:
            x[100:180] += 5.0 + m
        x[4096 + 200 * m:4096 + 200 * m + 80] -= 3.0 * (m + 1)
    return xs


@pytest.mark.parametrize("values", ["float32", "int8", "int2"])
def test_the_scatter_mean_is_the_central_weighted_mean_over_each_coordinates_senders(values):
    """Four members, one left out (weight 0, no residual): every coordinate is the global value plus the weighted
    mean of the clipped values of the members (with a weight) that sent it; a coordinate nobody sent keeps it."""
    from flwr_sharded.parallel.sparse import scatter_mean

    layout, gen = _layout(values), torch.Generator().manual_seed(5)
    global_k, scales = torch.randn(NUMEL, generator=gen), [0.2, 0.5, 0.3, 0.0]
    xs = _members(gen)
    xs[3].zero_()
    residuals = [torch.randn(NUMEL, generator=gen) * 0.01 for _ in range(3)] + [None]
    rows = _rank_rows(xs, residuals, layout, scales, "scatter-mean", 0.95)
    out = torch.empty(NUMEL)
    scatter_mean(out, rows, layout, global_k, torch.empty(NUMEL))
    expected = _central_mean(rows, layout, global_k)
    assert torch.allclose(out.double(), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[(expected == global_k.double())], global_k[(expected == global_k.double())])
    assert float((out[100:180] - global_k[100:180]).abs().min()) > 1.0  # sent by two: their mean, not shrunk
    assert float((out[4096 + 600:4096 + 680] - global_k[4096 + 600:4096 + 680]).abs().max()) < 1e-6  # left out
    again = torch.empty(NUMEL)
    scatter_mean(again, rows, layout, global_k, torch.empty(NUMEL))
    assert torch.equal(out, again)


def test_an_outsized_member_moves_the_scatter_mean_no_more_than_the_median_norm_allows():
    from flwr_sharded.parallel.sparse import decode_row, scatter_mean

    layout, gen = _layout("int8"), torch.Generator().manual_seed(6)
    global_k = torch.randn(NUMEL, generator=gen)
    moves = []
    for factor in (1.0, 1000.0):
        xs = _members(torch.Generator().manual_seed(7))[:3]
        xs[2].mul_(factor)
        rows = _rank_rows(xs, [torch.zeros(NUMEL) for _ in xs], layout, [1 / 3] * 3, "scatter-mean", 0.95)
        norms = sorted(float(decode_row(row, layout)[1].norm()) for row in rows)
        out = torch.empty(NUMEL)
        scatter_mean(out, rows, layout, global_k, torch.empty(NUMEL))
        moves.append(float((out - global_k).norm()))
        assert moves[-1] <= 3 * norms[1] * (1 + 1e-5)  # each coordinate a mean of values clipped to the median
    assert moves[1] < 2 * moves[0], moves  # not 1000x


@pytest.mark.parametrize("merge", ["scatter-mean", "sum"])
def test_a_row_far_above_the_median_row_norm_is_named_and_a_left_out_one_is_not_judged(merge):
    """The merge returns the rows' norms; `MergedRows.outliers` names a row above 10x their median (per unit of share
    for a sum; times its share over the median share where that is above 1), one that is NaN and one of 1e30 (its
    fp32 norm overflows), never an honest row nor a member left out (share 0), and finiteness only when the median is
    0 or the ratio 0."""
    from flwr_sharded.parallel.sparse import MergedRows, accumulate, outlying_rows, scatter_mean

    layout = _layout("float32")
    scales = [0.1, 0.2, 0.3, 0.4] if merge == "sum" else [0.25] * 4

    def named(factor: float, fill: float | None = None, shares: list[float] | None = None,
              ratio: float = 10.0) -> list[int]:
        xs = _members(torch.Generator().manual_seed(8))
        xs[2].mul_(factor)
        if fill is not None:
            xs[2].fill_(fill)
        rows = _rank_rows(xs, [None] * 4, layout, shares or scales, merge)
        out = torch.empty(NUMEL)
        norms = (accumulate(out, rows, layout) if merge == "sum" else
                 scatter_mean(out, rows, layout, torch.zeros(NUMEL), torch.empty(NUMEL)))
        expected = torch.stack([torch.linalg.vector_norm(_decoded(row, layout)) for row in rows])
        assert torch.allclose(norms, expected, rtol=0, atol=0, equal_nan=True), (norms, expected)
        return MergedRows.of(norms, rows, merge).outliers(ratio)

    assert named(1.0) == [] and named(5.0) == []  # an honest spread, and a row 5x the others
    assert named(30.0) == [2] and named(1.0, 1e30) == [2] and named(1.0, float("nan")) == [2]
    assert named(1.0, 1e30, shares=[*scales[:2], 0.0, scales[3]]) == []  # left out: not judged
    assert named(30.0, shares=[0.04, 0.04, 0.88, 0.04]) == []  # 22x the median share: it may move 220x as far
    assert named(30.0, ratio=0.0) == [] and named(1.0, 1e30, ratio=0.0) == [2]  # finiteness only
    zeros, share = torch.zeros(4), torch.tensor([0.25] * 4)
    assert outlying_rows(zeros, share, 10.0, weighted=False) == []
    assert outlying_rows(torch.tensor([0.0, 0.0, 5.0, float("inf")]), share, 10.0, weighted=False) == [3]


def _decoded(row: torch.Tensor, layout) -> torch.Tensor:
    from flwr_sharded.parallel.sparse import decode_row

    return decode_row(row, layout)[1]


@pytest.mark.parametrize("values", ["float32", "int8", "int2"])
def test_the_decayed_residual_stays_bounded_over_many_syncs(values):
    """200 syncs of random deltas (|delta| <= D) at 1.5625% with decay 0.95: an entry not sent becomes 0.95 e +
    delta, a sent one x less its decoded value, within |x| for these wires; so max |e| <= D / (1 - 0.95) = 20 D."""
    layout, gen = _layout(values, 0.015625, numel=2 * 4096 + 100), torch.Generator().manual_seed(8)
    residual, bound = torch.zeros(layout.numel), 0.0
    row, scratch = torch.empty(layout.bytes, dtype=torch.uint8), torch.empty(layout.numel)
    from flwr_sharded.parallel.sparse import contribute

    for _ in range(200):
        delta = torch.randn(layout.numel, generator=gen)
        bound = max(bound, float(delta.abs().max()) / (1 - 0.95))
        contribute(delta, residual, layout, row, scratch, 0.5, merge="scatter-mean", decay=0.95)
        assert float(residual.abs().max()) <= bound


WEIGHTS = [0.25, 0.75, 0.0]
"""The gloo ranks' weight shares (a third rank is left out: it sends zeros and keeps no residual)."""


def _gloo_reduce(rank: int, world: int, values: str, merge: str, decay: float,
                 dense: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, int, int]:
    """SparseWire.reduce (`dense`: its dense flush's) of each rank's own bucket against the global one: (result,
    residual, bytes, expected)."""
    import torch.distributed as dist

    from flwr_sharded.parallel.workspace import Workspace
    from flwr_sharded.parallel.sparse import SparseWire, sent_bytes

    dist.init_process_group("gloo")
    flat, residual, global_k = _gloo_inputs(rank)
    wire = SparseWire(_wire(values), 0.02, merge, decay)
    nbytes = (wire.dense() if dense else wire).reduce(flat, global_k, WEIGHTS[rank], None, Workspace(), residual)
    if dense:
        return flat, residual, nbytes, 0
    return flat, residual, nbytes, sent_bytes(NUMEL, world, 0.02, _wire(values))


def _gloo_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A rank's (bucket, residual, global values); a left-out rank's bucket holds zeros, as the shard sync's."""
    gen = torch.Generator().manual_seed(rank + 10)
    global_k = torch.randn(NUMEL, generator=torch.Generator().manual_seed(7))
    flat, residual = global_k + torch.randn(NUMEL, generator=gen), torch.randn(NUMEL, generator=gen) * 0.1
    return (flat, residual, global_k) if WEIGHTS[rank] else (torch.zeros(NUMEL), None, global_k)


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("values,merge,decay,world", [("int8", "sum", 1.0, 2), ("int8", "scatter-mean", 0.95, 3),
                                                      ("int2", "scatter-mean", 0.95, 2)])
def test_sparse_wire_reduce_on_gloo_ranks_equals_the_central_merge_on_each(values, merge, decay, world):
    from flwr_sharded.parallel.sparse import accumulate, scatter_mean

    results = run_ranks(_gloo_reduce, world, values, merge, decay, timeout=90)
    first, bytes_a, expected = results[0][0], results[0][2], results[0][3]
    assert all(torch.equal(first, r[0]) for r in results) and bytes_a == expected > 0
    # the central computation from the same inputs: each rank's row, merged on the global values
    layout = _layout(values)
    inputs = [_gloo_inputs(rank) for rank in range(world)]
    global_k = inputs[0][2]
    xs = [flat - global_k if WEIGHTS[rank] else flat for rank, (flat, _, _) in enumerate(inputs)]
    residuals = [residual for _, residual, _ in inputs]
    rows = _rank_rows(xs, residuals, layout, WEIGHTS[:world], merge, decay)
    out = torch.empty(NUMEL)
    if merge == "sum":
        accumulate(out, rows, layout, global_k)
    else:
        scatter_mean(out, rows, layout, global_k, torch.empty(NUMEL))
    assert torch.allclose(first, out, atol=1e-6)
    for (_, residual, _, _), expected_residual in zip(results, residuals):
        assert (residual is None) == (expected_residual is None)
        assert residual is None or torch.allclose(residual, expected_residual, atol=1e-6)


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("merge", ["scatter-mean", "sum"])
def test_a_dense_flush_sends_each_delta_with_its_whole_residual_through_the_values_ring(merge):
    """Three gloo ranks (one left out), int8 values: the result is global + sum_i s_i (delta_i + 0.95 e_i) (`sum`:
    its residual is already weighted) within the int8 ring's roundings; each residual then holds only those."""
    from flwr_sharded.parallel.ring import all_reduce_bytes

    world, decay = 3, 0.95
    results = run_ranks(_gloo_reduce, world, "int8", merge, decay, True, timeout=90)
    inputs = [_gloo_inputs(rank) for rank in range(world)]
    global_k = inputs[0][2]
    exact = global_k.double().clone()
    for rank, (flat, residual, _) in enumerate(inputs):
        if WEIGHTS[rank]:
            weighted = residual.double() * (1.0 if merge == "sum" else WEIGHTS[rank])
            exact += WEIGHTS[rank] * (flat.double() - global_k.double()) + decay * weighted
    step = float((exact - global_k.double()).abs().max()) / 127  # one int8 step of the largest block
    assert all(torch.equal(results[0][0], r[0]) for r in results)
    assert float((results[0][0].double() - exact).abs().max()) <= world * step
    assert results[0][2] == all_reduce_bytes(NUMEL, world, torch.int8)
    for rank, (_, residual, _, _) in enumerate(results):
        if WEIGHTS[rank]:  # the ring's roundings only (unweighted for scatter-mean)
            assert float(residual.abs().max()) <= world * step / (1.0 if merge == "sum" else WEIGHTS[rank])


def _restart_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from flwr_sharded.parallel.sparse import SparseWire
    from flwr_sharded.parallel.sync import ShardSync
    from flwr_sharded.parallel.wire import WIRES

    dist.init_process_group("gloo")
    gen = torch.Generator().manual_seed(3)
    param = torch.nn.Parameter(torch.randn(1000, generator=gen))  # the same start on every rank
    sync = ShardSync([("w", param)], fed_group=dist.group.WORLD, error_feedback=True, max_move=0,
                     wire=SparseWire(WIRES["float32"], 0.1, restart=True))
    sync.capture_global()
    delta = torch.randn(1000, generator=torch.Generator().manual_seed(rank + 20))
    with torch.no_grad():
        param.add_(delta)
    sync.sync(1.0)
    return {"param": param.detach().clone(), "global": sync.state.shards[0].clone(), "delta": delta,
            "residual": sync.state.feedback.residuals["0"].clone()}


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_restarting_from_the_residual_puts_what_was_not_sent_into_the_shards():
    """Two ranks, top-10% fp32 values: each rank's shards become the (common) global values plus 0.95 x its delta
    less its sent entries; the residual buffer is empty; the global values are the scatter-mean of the sent ones."""
    out = run_ranks(_restart_worker, 2, timeout=90)
    assert torch.equal(out[0]["global"], out[1]["global"]) and not torch.equal(out[0]["param"], out[1]["param"])
    for o in out:
        kept = torch.zeros(1000, dtype=torch.bool)
        kept[o["delta"].abs().topk(100).indices] = True
        expected = torch.where(kept, 0.0, 0.95 * o["delta"])
        assert torch.allclose(o["param"] - o["global"], expected, atol=1e-5)
        assert not o["residual"].any()


def test_the_dense_syncs_are_the_warm_up_periods_and_the_last_one():
    from types import SimpleNamespace

    from flwr_sharded.training.sync_loop import SyncLoop

    def dense(clock: float, ahead: int = 0, warmup: int = 2, flush: bool = True, until: int | None = 32,
              topk: float | None = 0.02) -> bool:
        p = SimpleNamespace(sync_topk=topk, sync_dense_warmup=warmup, sync_dense_flush=flush)
        loop = SimpleNamespace(cfg=SimpleNamespace(parallel=p), A=8, steps=8, until=until, reference=lambda: clock)
        return SyncLoop._dense(loop, ahead)

    assert [dense(c) for c in (8, 16, 24, 32)] == [True, True, False, True]  # warm-up 2, the last at 32 of 32
    # the last sync before an end mid-period
    assert [dense(c, warmup=0, until=30) for c in (8, 16, 24)] == [False, False, True]
    assert dense(29, ahead=3) and not dense(21, ahead=3, warmup=0)  # an overlapped sync: where it merges
    assert not dense(32, flush=True, until=None, warmup=0)  # a Flower round: no end known
    assert not dense(8, topk=None)


def test_the_shard_sync_refuses_top_k_without_error_feedback():
    from flwr_sharded.parallel.sync import ShardSync
    from flwr_sharded.parallel.wire import sync_wire

    param = torch.nn.Parameter(torch.zeros(8))
    with pytest.raises(ValueError, match="top-k sync needs error feedback"):
        ShardSync([("w", param)], fed_group=None, wire=sync_wire("float32", 0.1))
    assert ShardSync([("w", param)], fed_group=None, wire=sync_wire("float32", 0.1), error_feedback=True).keeps_global


@pytest.mark.parametrize("options,message", [
    ({"sync_topk": 0.0}, r"--sync-topk must be in \(0, 1\], got 0.0"),
    ({"sync_topk": 1.5}, r"--sync-topk must be in \(0, 1\], got 1.5"),
    ({"sync_topk": 0.02}, r"--sync-topk 0.02 .* add --sync-error-feedback"),
    ({"sync_topk": 0.02, "sync_error_feedback": True, "outer": "trimmed-mean"},
     r"--sync-topk 0.02 .* --outer trimmed-mean needs every member's shards"),
    ({"sync_topk": 0.02, "sync_error_feedback": True, "outer": "median"}, r"--sync-topk 0.02 .* --outer median"),
    ({"sync_topk": 0.02, "sync_error_feedback": True, "method": "fsdp", "federations": 1},
     r"--sync-error-feedback, --sync-topk shape the shard sync of FL methods"),
    ({"sync_topk": 0.02, "sync_error_feedback": True, "sync_error_decay": 0.0},
     r"--sync-error-decay must be in \(0, 1\], got 0.0"),
    ({"sync_topk": 0.02, "sync_error_feedback": True, "sync_error_decay": 1.5},
     r"--sync-error-decay must be in \(0, 1\], got 1.5"),
    ({"sync_topk": 0.02, "sync_error_feedback": True, "sync_topk_merge": "mean"}, r"--sync-topk-merge"),
    ({"sync_topk_merge": "sum"}, r"--sync-topk-merge shape the top-k sync .* set --sync-topk"),
    ({"sync_dtype": "int8", "sync_error_feedback": True, "sync_error_decay": 0.5},
     r"--sync-error-decay shape the top-k sync \(its merge, residual and dense syncs\); without --sync-topk"),
    ({"sync_dense_warmup": 2, "sync_dense_flush": True},
     r"--sync-dense-warmup, --sync-dense-flush shape the top-k sync .* set --sync-topk"),
    ({"sync_restart": "residual"}, r"--sync-restart shape the top-k sync"),
    ({"sync_topk": 0.02, "sync_error_feedback": True, "sync_restart": "residual", "sync_topk_merge": "sum"},
     r"--sync-restart residual puts each member's residual back .* use --sync-topk-merge scatter-mean"),
])
def test_bad_top_k_options_are_refused_naming_the_option(options, message):
    from flwr_sharded.config import TrainConfig
    from flwr_sharded.validation import validate
    from flwr_sharded.errors import ConfigError

    cfg = TrainConfig()
    cfg.parallel.method, cfg.parallel.federations = "fl-fsdp", 2
    for key, value in options.items():
        setattr(cfg.parallel, key, value)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)
    cfg.parallel = type(cfg.parallel)(method="fl-fsdp", federations=2, sync_topk=0.02, sync_error_feedback=True)
    validate(cfg)  # float32 values with error feedback: a fp32-valued sparse delta


def test_the_built_wire_carries_the_top_k_options_and_refuses_a_restart_it_cannot_make():
    """`sync_wire` builds what `ShardSync` receives: a dense option's wire itself, or the top-k rows of its values
    with their merge, decay and restart; a restart under the sum merge is refused as the wire is built."""
    from flwr_sharded.parallel.sparse import SparseWire
    from flwr_sharded.parallel.wire import WIRES, sync_wire

    assert sync_wire("int8") is WIRES["int8"]
    built = sync_wire("int8", 0.1, "scatter-mean", 0.5, restart=True)
    assert isinstance(built, SparseWire) and built.values is WIRES["int8"]
    assert (built.fraction, built.merge, built.decay, built.restart) == (0.1, "scatter-mean", 0.5, True)
    with pytest.raises(ValueError, match="merged by scatter-mean"):
        sync_wire("int8", 0.1, "sum", restart=True)
