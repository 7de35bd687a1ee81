"""The quantized ring staged through host buffers (a gloo group on CUDA shards): which groups need it, and the staged
ring's result bit-equal to the direct one on 2 and 3 gloo ranks (forced on the CPU)."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.multiproc import run_ranks


@pytest.mark.parametrize("config, device, carries", [
    ("cpu:gloo,cuda:gloo", "cuda", False),  # gloo's send/recv: no CUDA path
    ("gloo", "cuda:1", False),
    ("cpu:gloo,cuda:nccl", "cuda", True),
    ("nccl", "cuda", True),
    ("cpu:gloo,cuda:gloo", "cpu", True),  # host tensors travel as they are
])
def test_only_gloo_point_to_point_on_a_device_needs_staging(monkeypatch, config, device, carries):
    import torch.distributed as dist

    from flwr_sharded.parallel.ring import p2p_carries_device_tensors

    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    assert p2p_carries_device_tensors(object(), device) is carries


def test_pinned_workspace_buffers_live_on_the_host_and_are_reused():
    from flwr_sharded.parallel.workspace import Workspace

    ws = Workspace()
    buf = ws.get("host_send", 10, torch.uint8, "cpu", pinned=True)
    assert buf.device.type == "cpu" and buf.is_pinned() == torch.cuda.is_available()
    assert ws.get("host_send", 8, torch.uint8, "cpu", pinned=True).data_ptr() == buf.data_ptr()


CASES = {  # name: (elements, format, error feedback)
    "int8": (5 * 256 + 77, torch.int8, False),
    "int8+feedback": (5 * 256 + 77, torch.int8, True),
    "int4": (3001, torch.int4, False),
    "int4+feedback": (3001, torch.int4, True),
    "fp4+feedback": (3001, torch.float4_e2m1fn_x2, True),
}


def _staged_worker(rank: int, world: int) -> dict:
    from datetime import timedelta

    import torch.distributed as dist

    from flwr_sharded.parallel.ring import quantized_all_reduce
    from flwr_sharded.parallel.workspace import Workspace

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("flwr_sharded.parallel.ring")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    out = {}
    for name, (n, dtype, feedback) in CASES.items():
        runs = {}
        for stage in (False, True):
            gen = torch.Generator().manual_seed(10 * rank + 1)
            flat = torch.randn(n, generator=gen)
            residual = torch.randn(n, generator=gen) * 1e-3 if feedback else None
            ws = Workspace()
            sent = quantized_all_reduce(flat, dtype=dtype, residual=residual, workspace=ws, stage=stage,
                                        timeout=30.0)
            runs[stage] = (flat, residual, sent, "host_send" in ws._buffers)
        out[name] = runs
    auto = Workspace()
    quantized_all_reduce(torch.ones(600), workspace=auto)  # CPU tensors over gloo: carried as they are
    out["auto staged"] = "host_send" in auto._buffers
    out["logged"] = [r.getMessage() for r in records]
    return out


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_the_staged_ring_gives_the_direct_rings_bytes(world):
    out = run_ranks(_staged_worker, world, timeout=100)
    for rank, result in enumerate(out):
        for name in CASES:
            (flat, residual, sent, direct_staged), (s_flat, s_residual, s_sent, staged) = (result[name][False],
                                                                                             result[name][True])
            assert staged and not direct_staged, name
            assert torch.equal(flat, s_flat), (rank, name)
            assert sent == s_sent
            assert (residual is None) == (s_residual is None)
            if residual is not None:
                assert torch.equal(residual, s_residual), (rank, name)
            assert torch.equal(flat, out[0][name][True][0]), (rank, name)  # every rank the same bytes
        assert not result["auto staged"]
        assert len(result["logged"]) == 1 and "pinned host buffers (as asked)" in result["logged"][0]
