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


def test_nccl_federation_groups_raise_instead_of_killing_the_process(monkeypatch):
    """A federation group over NCCL is built in error-handling mode 2 (abort the communicator, raise in the rank),
    the process's own groups keep theirs; a failed NCCL group is aborted, not destroyed."""
    from flwr_sharded.flower import rendezvous

    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    seen = {}
    with rendezvous._nccl_errors_raise("nccl"):
        seen["nccl"] = rendezvous.os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
    with rendezvous._nccl_errors_raise("gloo"):
        seen["gloo"] = rendezvous.os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
    assert seen == {"nccl": "2", "gloo": "1"}
    assert rendezvous.os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    calls = []
    monkeypatch.setattr(rendezvous.c10d, "_abort_process_group", lambda pg: calls.append(("abort", pg)))
    monkeypatch.setattr(rendezvous.dist, "destroy_process_group", lambda pg: calls.append(("destroy", pg)))
    group = rendezvous.FederationGroup(pg="pg", rank=0, size=2, name="g", store=None, backend="nccl")
    group.destroy(failed=True)
    group.destroy()
    assert calls == [("abort", "pg"), ("destroy", "pg")]
