"""The top-k shard sync (`flwr_sharded.parallel.sparse`): the kept entries, their sum, the residual, the bytes."""

from __future__ import annotations

import pytest
import torch

from tests.multiproc import run_ranks

NUMEL = 3 * 4096 + 1000  # three whole chunks and a partial one


def _layout(values: str, fraction: float = 0.02, numel: int = NUMEL):
    from flwr_sharded.parallel.sparse import RowLayout
    from flwr_sharded.parallel.wire import WIRES

    return RowLayout(numel, fraction, WIRES[values])


def _rank_rows(xs: list[torch.Tensor], residuals: list[torch.Tensor], layout) -> torch.Tensor:
    """Every emulated rank's row of its delta (`xs`, overwritten), residuals updated: (W, row bytes)."""
    from flwr_sharded.parallel.sparse import contribute

    rows = torch.empty(len(xs), layout.bytes, dtype=torch.uint8)
    for x, residual, row in zip(xs, residuals, rows):
        contribute(x, residual, layout, row, torch.empty_like(x))
    return rows


@pytest.mark.parametrize("values", ["float32", "bfloat16", "int8"])
def test_the_sparse_sum_is_the_dense_sum_of_each_ranks_largest_entries(values):
    """Three emulated ranks: each keeps ceil(2% x chunk) entries per chunk, the largest in magnitude; the summed rows
    equal a dense fp64 sum of those entries as the wire rounds them, and each rank's residual is its input minus
    what it sent."""
    from flwr_sharded.parallel.sparse import CHUNK, accumulate, decode, kept_of

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
        indices, decoded = decode(row, layout)
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
    from flwr_sharded.parallel.wire import WIRES

    n = 16 << 20
    int8 = sent_bytes(n, 2, 0.02, WIRES["int8"])
    assert int8 == _layout("int8", numel=n).bytes and 0.014 < int8 / (4 * n) < 0.016  # (2 + 1 + 4/256) x 2% x N
    assert sent_bytes(n, 4, 0.02, WIRES["int8"]) == 3 * int8 and sent_bytes(n, 1, 0.02, WIRES["int8"]) == 0
    assert sent_bytes(n, 2, 0.02, WIRES["float32"]) == _layout("float32", numel=n).bytes == 6 * _layout(
        "float32", numel=n).kept


@pytest.mark.parametrize("values", ["float32", "bfloat16", "int8", "int4"])
def test_the_cost_models_ratio_is_the_rows_over_the_fp32_ring_all_reduce(values):
    from flwr_sharded.parallel.sparse import sent_bytes
    from flwr_sharded.parallel.wire import WIRES, sync_wire_ratio
    from flwr_sharded_perf.memory_model import StepOptions
    from flwr_sharded_perf.planner import _wire_ratio

    n = 4 << 20
    for world in (2, 4, 8):
        exact = sent_bytes(n, world, 0.02, WIRES[values]) / (2 * (world - 1) / world * 4 * n)
        assert sync_wire_ratio(values, 0.02, world) == pytest.approx(exact, rel=0.01)
        planned = _wire_ratio(WIRES[values].bytes_per_value, 4.0, world, StepOptions(sync_topk=0.02))
        assert planned == pytest.approx(exact, rel=0.01)  # the planner's, for fp32 units
    assert sync_wire_ratio(values) == WIRES[values].bytes_per_value / 4  # dense: the wire's own size
    assert sync_wire_ratio(values, 0.02, 8) == pytest.approx(4 * sync_wire_ratio(values, 0.02, 2))  # rows grow with F


def _gloo_reduce(rank: int, world: int, values: str) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """SparseWire.reduce of each rank's own bucket against the global one: (result, residual, bytes, expected)."""
    import torch.distributed as dist

    from flwr_sharded.parallel.quantize import Workspace
    from flwr_sharded.parallel.sparse import SparseWire, sent_bytes
    from flwr_sharded.parallel.wire import WIRES

    dist.init_process_group("gloo")
    gen = torch.Generator().manual_seed(rank + 10)
    global_k = torch.randn(NUMEL, generator=torch.Generator().manual_seed(7))
    flat, residual = global_k + torch.randn(NUMEL, generator=gen), torch.randn(NUMEL, generator=gen) * 0.1
    wire = SparseWire(WIRES[values], 0.02)
    nbytes = wire.reduce(flat, global_k, [0.25, 0.75][rank], None, Workspace(), residual)
    return flat, residual, nbytes, sent_bytes(NUMEL, world, 0.02, WIRES[values])


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_sparse_wire_reduce_on_two_gloo_ranks_equals_the_central_sum_on_both():
    from flwr_sharded.parallel.sparse import accumulate

    results = run_ranks(_gloo_reduce, 2, "int8", timeout=90)
    (a, res_a, bytes_a, expected), (b, res_b, _, _) = results
    assert torch.equal(a, b) and bytes_a == expected > 0
    # the central computation: each rank's weighted delta plus residual, its top entries, summed, on the global
    layout = _layout("int8")
    global_k = torch.randn(NUMEL, generator=torch.Generator().manual_seed(7))
    xs, residuals = [], []
    for rank, weight in enumerate([0.25, 0.75]):
        gen = torch.Generator().manual_seed(rank + 10)
        xs.append((global_k + torch.randn(NUMEL, generator=gen) - global_k) * weight)  # as the wire computes it
        residuals.append(torch.randn(NUMEL, generator=gen) * 0.1)
    out = torch.empty(NUMEL)
    accumulate(out, _rank_rows(xs, residuals, layout), layout)
    assert torch.allclose(a, global_k + out, atol=1e-6)
    assert torch.allclose(res_a, residuals[0], atol=1e-6) and torch.allclose(res_b, residuals[1], atol=1e-6)


def test_the_shard_sync_refuses_top_k_without_error_feedback():
    from flwr_sharded.parallel.sync import ShardSync

    param = torch.nn.Parameter(torch.zeros(8))
    with pytest.raises(ValueError, match="top-k sync needs error feedback"):
        ShardSync([("w", param)], fed_group=None, topk=0.1)
    assert ShardSync([("w", param)], fed_group=None, topk=0.1, error_feedback=True).keeps_global


@pytest.mark.parametrize("options,message", [
    ({"sync_topk": 0.0}, r"--sync-topk must be in \(0, 1\], got 0.0"),
    ({"sync_topk": 1.5}, r"--sync-topk must be in \(0, 1\], got 1.5"),
    ({"sync_topk": 0.02}, r"--sync-topk 0.02 .* add --sync-error-feedback"),
    ({"sync_topk": 0.02, "sync_error_feedback": True, "outer": "trimmed-mean"},
     r"--sync-topk 0.02 .* --outer trimmed-mean needs every member's shards"),
    ({"sync_topk": 0.02, "sync_error_feedback": True, "outer": "median"}, r"--sync-topk 0.02 .* --outer median"),
    ({"sync_topk": 0.02, "sync_error_feedback": True, "method": "fsdp", "federations": 1},
     r"--sync-error-feedback, --sync-topk shape the shard sync of FL methods"),
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
