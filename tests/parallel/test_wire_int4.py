"""The int4 wire: registered with half of int8's bytes, and a 2-group FL+FSDP ShardSync with error feedback that
ends at the central weighted mean within the ring's int4 roundings, bit-identical, sending the bytes counted, with
residuals that are exactly what the result misses."""

from __future__ import annotations

import pytest
import torch

from tests.multiproc import run_ranks
from tests.parallel.test_sync import _sharded_tiny_model, central_mean

U = 2.0**-24  # fp32 unit roundoff
INT4, BLOCK = torch.int4, 256
WEIGHTS = {0: 1.0, 1: 3.0}


def test_the_wire_is_registered_with_half_of_int8s_bytes():
    from flwr_sharded.parallel.codecs.blockwise import qmax
    from flwr_sharded.parallel.wire import QUANTIZED, SYNC_DTYPE_BYTES, WIRES, check_wire_dtype

    wire = WIRES["int4"]
    assert wire.torch_dtype() == INT4 and qmax(INT4) == qmax("int4") == 7 and "int4" in QUANTIZED
    assert SYNC_DTYPE_BYTES["int4"] == 0.5 + 4 / BLOCK and wire.unsupported("cpu") is None
    assert check_wire_dtype("int4", "cpu") == INT4


def test_float4_e2m1_shares_int4s_bytes_and_is_found_by_torchs_dtype():
    from flwr_sharded.parallel.codecs.blockwise import qmax, quantize
    from flwr_sharded.parallel.wire import SYNC_DTYPE_BYTES, WIRES, check_wire_dtype, wire_of

    fp4 = torch.float4_e2m1fn_x2  # torch's dtype holds two e2m1 values
    assert WIRES["float4_e2m1"].torch_dtype() == fp4 and wire_of(fp4) is WIRES["float4_e2m1"]
    assert SYNC_DTYPE_BYTES["float4_e2m1"] == SYNC_DTYPE_BYTES["int4"] and qmax(fp4) == 6
    assert check_wire_dtype("float4_e2m1", "cpu") == fp4
    x = torch.tensor([6.0, -0.2, 0.3, 0.75, -1.3, 2.6, 5.1, -5.0])  # scale 1: rounds to the e2m1 grid
    assert quantize(x, fp4, 8).codes().tolist() == [6.0, -0.0, 0.5, 0.5, -1.5, 3.0, 6.0, -4.0]  # ties: down


def _sync_worker(rank: int, world: int):
    from flwr_sharded.parallel.ring import all_reduce_bytes
    from flwr_sharded.parallel.alignment import local_shard
    from flwr_sharded.parallel.sync import ShardSync
    from flwr_sharded.parallel.wire import wire_of

    topo, model = _sharded_tiny_model("fl-fsdp", 2, 1, 1)
    sync = ShardSync(model.named_parameters(), fed_group=topo.fed_group, bucket_bytes=4096, wire=wire_of(INT4),
                     error_feedback=True)
    sync.capture_global()
    rounds = []
    for round_ in range(2):
        global_ = [local_shard(p).double().clone() for p in model.parameters()]
        gen = torch.Generator().manual_seed(10 * round_ + rank)
        with torch.no_grad():
            for p in model.parameters():  # local steps
                local_shard(p).add_(1e-2 * torch.randn(local_shard(p).shape, generator=gen))
        before = [local_shard(p).clone() for p in model.parameters()]
        expected, sources = central_mean(topo, before, WEIGHTS)
        sent = sync.sync(weight=WEIGHTS[topo.fed_index]).bytes
        after = [local_shard(p).clone() for p in model.parameters()]
        residual = [torch.zeros(t.numel(), dtype=torch.float64) for t in after]  # the residuals, per shard
        for k, segments in enumerate(b.segments for b in sync.layout.buckets):
            res = sync.state.feedback.residuals[str(k)]
            for s in segments:
                residual[s.shard][s.start:s.end] = res[s.offset:s.offset + s.end - s.start].double()
        deltas = [max(float((b[i].double() - g).abs().max()) for _, b in sources) for i, g in enumerate(global_)]
        rounds.append({"after": after, "expected": expected, "residual": residual, "sent": sent, "max_delta": max(deltas),
                       "expected_sent": sum(all_reduce_bytes(sum(s.end - s.start for s in segs), world, INT4)
                                            for segs in (b.segments for b in sync.layout.buckets))})
    return rounds


@pytest.mark.dist
@pytest.mark.timeout(150)
def test_a_two_group_int4_sync_with_feedback_is_the_weighted_mean_within_the_rings_roundings():
    out = run_ranks(_sync_worker, 2, timeout=120)
    carried, fed = 0.0, [0.0] * len(out[0][0]["after"])  # the residuals fed into this round: their largest, sums
    for round_ in range(2):
        r0, r1 = out[0][round_], out[1][round_]
        assert all(torch.equal(a, b) for a, b in zip(r0["after"], r1["after"]))  # both ranks decode the same bytes
        assert r0["sent"] == r1["sent"] == r0["expected_sent"] > 0
        # Each chunk is rounded twice (W = 2): a rank's weighted delta plus its residual, block scale <= (d + c) / 7,
        # then the sum, <= (2 d + 2 c + half a step) / 7; half a step each. d bounds every weighted delta (weights
        # sum to 1, so d <= max_delta), c every residual carried in.
        d, c = r0["max_delta"], carried
        first = (d + c) / 14
        bound = (first + (2 * d + 2 * c + first) / 14) * (1 + 1e-4) + 2 * c
        err = max(float((a.double() - e).abs().max()) for a, e in zip(r0["after"], r0["expected"]))
        assert err <= bound, (round_, err, bound)
        assert err < 0.5 * d  # far from leaving a group out (an error of up to 3/4 of a delta)
        # the new residuals are what the result misses, plus the fed ones it carried in, up to fp32 roundings
        for i, (a, e) in enumerate(zip(r0["after"], r0["expected"])):
            missed = e.reshape(-1) + fed[i] - a.double().reshape(-1) - r0["residual"][i] - r1["residual"][i]
            assert float(missed.abs().max()) <= 1e-5 * d + 8 * U * float(e.abs().max()), (round_, i)
        fed = [a + b for a, b in zip(r0["residual"], r1["residual"])]
        assert any(float(r.abs().max()) > 0 for r in r0["residual"])
        carried = max(float(r.abs().max()) for r in r0["residual"] + r1["residual"])
