"""GPUs of simulated groups: each group its own block of devices, disjoint from every other group's."""

from __future__ import annotations

import pytest

from flwr_sharded.errors import ConfigError
from flwr_sharded.flower.launch import assign_gpus, visible_gpus


def test_every_group_gets_its_own_devices():
    gpus = [str(i) for i in range(8)]
    blocks = [assign_gpus(p, 2, gpus) for p in range(4)]
    assert blocks == [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]
    flat = [d for b in blocks for d in b]
    assert len(flat) == len(set(flat))  # disjoint
    assert assign_gpus(1, 2, ["4", "5", "6", "7"]) == ["6", "7"]  # CUDA_VISIBLE_DEVICES of the SuperLink's machine


def test_too_few_gpus_or_a_bad_choice_is_a_clear_error():
    with pytest.raises(ConfigError, match="partition 2 needs 2 GPU.*shows 4"):
        assign_gpus(2, 2, ["0", "1", "2", "3"])
    with pytest.raises(ConfigError, match="needs 2 distinct devices"):
        assign_gpus(0, 2, ["0", "1"], requested="1")
    with pytest.raises(ConfigError, match=r"\['7'\] are not visible"):
        assign_gpus(0, 2, ["0", "1"], requested="0,7")
    assert assign_gpus(0, 2, ["0", "1", "2", "3"], requested="3,2") == ["3", "2"]
    assert assign_gpus(5, 4, []) == []  # a machine without GPUs: the group runs on CPU


def test_visible_gpus_follows_cuda_visible_devices():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == visible_gpus({})  # Ray empties it for CPU actors


def test_a_failed_nccl_federation_group_is_aborted_not_destroyed(monkeypatch):
    """A failed NCCL federation group is aborted (its communicator torn down without waiting for peers that may be
    gone); a group that ends well is destroyed. Its error-handling mode is the process's, set once at start-up
    (tests/parallel/test_collectives.py)."""
    from flwr_sharded.flower import rendezvous

    calls = []
    monkeypatch.setattr(rendezvous.c10d, "_abort_process_group", lambda pg: calls.append(("abort", pg)))
    monkeypatch.setattr(rendezvous.dist, "destroy_process_group", lambda pg: calls.append(("destroy", pg)))
    group = rendezvous.FederationGroup(pg="pg", rank=0, size=2, name="g", store=None, backend="nccl")
    group.destroy(failed=True)
    group.destroy()
    assert calls == [("abort", "pg"), ("destroy", "pg")]
