"""The torch-release gates (`parallel.torch_compat`): each takes torch's own API where this torch has it, and the
earlier equivalent where not, with the same effect. Both paths run on whatever torch runs the suite (the newer API
removed for the test where it exists); `make test-floors` runs them on the floor too. In-process, a world of one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from flwr_sharded.parallel import torch_compat
from flwr_sharded.parallel.collectives import bounded


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("newer", [True, False], ids=["all_gather_single", "all_gather_into_tensor"])
def test_the_all_gather_is_torchs_under_either_name_and_gathers(world_of_one, monkeypatch, newer):
    calls = []

    def spy(name):
        real = getattr(dist, name)
        return lambda *a, **k: calls.append(name) or real(*a, **k)

    if not newer:
        monkeypatch.delattr(dist, "all_gather_single", raising=False)
    elif not hasattr(dist, "all_gather_single"):
        pytest.skip(f"torch {torch.__version__} has no all_gather_single")
    name = "all_gather_single" if newer else "all_gather_into_tensor"
    monkeypatch.setattr(dist, name, spy(name))  # looked up at the call: a TrafficMeter's wrapper is seen the same way
    mine, out = torch.arange(5, dtype=torch.float32), torch.full((5,), -1.0)
    bounded(torch_compat.all_gather_single, out, mine, group=dist.group.WORLD)
    assert calls == [name]
    assert torch.equal(out, mine)


def _own_group(name: str) -> dist.ProcessGroup:
    """A gloo group of one built outside `new_group`, as `rendezvous.nccl_group` builds its NCCL ones."""
    store = dist.PrefixStore(f"{name}/", dist.HashStore())
    pg = dist.ProcessGroup(store, 0, 1)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    backend = dist.ProcessGroupGloo(store, 0, 1)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    pg._set_group_name(name)
    return pg, store


@pytest.mark.parametrize("newer", [True, False], ids=["torch's", "written out"])
def test_a_group_registered_in_the_world_is_found_by_name_tag_and_destroy(world_of_one, monkeypatch, newer):
    if not newer:
        monkeypatch.delattr(c10d, "_register_pg_in_world", raising=False)
    elif not hasattr(c10d, "_register_pg_in_world"):
        pytest.skip(f"torch {torch.__version__} has no _register_pg_in_world")
    name = f"compat-{'own' if newer else 'written'}"
    pg, store = _own_group(name)
    torch_compat.register_pg_in_world(pg, backend_name="gloo", store=store, group_name=name, backend_config="cpu:gloo")
    world = c10d._world
    assert world.pg_map[pg] == ("gloo", store) and world.pg_names[pg] == name
    assert world.pg_backend_config[pg] == "cpu:gloo"
    assert pg in world.tags_to_pg[""] and world.tags_to_pg[f"ptd:{name}"] == [pg]
    assert world.pg_to_tag[pg] == f"ptd:{name}"
    assert c10d._resolve_process_group(name) is pg
    world.pg_group_ranks[pg] = {0: 0}  # as `rendezvous.join` maps it
    value = torch.ones(3)
    dist.all_reduce(value, group=pg)
    assert torch.equal(value, torch.ones(3))
    dist.destroy_process_group(pg)
    assert pg not in world.pg_map and pg not in world.pg_names and pg not in world.tags_to_pg.get("", [])


@pytest.mark.parametrize("newer", [True, False], ids=["ProcessGroup.set_timeout", "_set_pg_timeout"])
def test_a_groups_timeout_is_set_on_its_backend(world_of_one, monkeypatch, newer):
    from datetime import timedelta

    from flwr_sharded.parallel.collectives import group_timeout

    group = dist.new_group([0], timeout=timedelta(seconds=30))
    if not newer:
        monkeypatch.delattr(dist.ProcessGroup, "set_timeout", raising=False)
    elif not hasattr(group, "set_timeout"):
        pytest.skip(f"torch {torch.__version__} has no ProcessGroup.set_timeout")
    torch_compat.set_timeout(group, timedelta(seconds=7))
    assert group_timeout(group, torch.device("cpu")) == timedelta(seconds=7)
