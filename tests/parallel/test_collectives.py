"""Every process group carries the run's timeout, and a sync's collective that a peer never joins raises in its caller
within that timeout (gloo on CPU; what NCCL adds is checked on stand-ins: its options and its group's construction).
The multi-process tests run 2-4 gloo ranks, every wait bounded (`tests.multiproc.run_ranks` kills every rank)."""

from __future__ import annotations

import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from flwr_sharded.training.static_run import CONTROL_TIMEOUTS
from tests.multiproc import run_ranks

TIMEOUT_S = 7.0
"""A timeout no default has (gloo's is 30 minutes, NCCL's 10)."""


def _timeout_of(group) -> float:
    from flwr_sharded.parallel.collectives import group_timeout

    return group_timeout(group, torch.device("cpu")).total_seconds()


def _every_group(rank: int, world: int, layout: dict, older_torch: bool = False) -> dict[str, float]:
    """Every group a static run of `layout` makes (the mesh's, the flattened group, the federation's own, the
    channels, StaticFederation's control and leader groups, WORLD): its timeout, by name. `older_torch`: the mesh
    built as before torch 2.9 (`torch_compat`: no `backend_override`, the timeouts set on the groups made)."""
    import torch.distributed as dist

    from flwr_sharded.config import ParallelConfig
    from flwr_sharded.parallel import torch_compat
    from flwr_sharded.parallel.topology import GroupsTopology, init_topology
    from flwr_sharded.training.static_run import StaticFederation

    if older_torch:
        torch_compat._takes_backend_override = lambda: False

    topo = init_topology(ParallelConfig(**layout), timeout_s=TIMEOUT_S)
    fed = StaticFederation(topo, [(8, 3), (5,)], wait_timeout=None)
    groups = {"world": None, "group": topo.group_pg, "leaders": fed.leaders, "control": fed.control}
    if isinstance(topo, GroupsTopology):
        groups.update({f"channel {owners}": pg for owners, pg in topo.channels.items()})
        groups.update({f"mesh {dim}": topo.mesh.get_group(dim) for dim in topo.mesh.mesh_dim_names})
        groups["own leaders"] = topo.leaders
    else:
        groups.update({f"mesh {dim}": topo.mesh.get_group(dim) for dim in ("fed", "rep", "shard")})
        groups["fed"] = topo.fed_group
        if topo.own_fed_group is not None:
            groups["own fed"] = topo.own_fed_group
    assert topo.timeout == timedelta(seconds=TIMEOUT_S)
    return {name: _timeout_of(pg) for name, pg in groups.items() if pg != dist.GroupMember.NON_GROUP_MEMBER}


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout, world, older_torch", [
    ({"method": "fl-hsdp", "federations": 2, "replicas": 1, "shards": 2}, 4, False),  # every mesh dimension, flattened
    ({"method": "fl-hsdp", "federations": 2, "replicas": 1, "shards": 2}, 4, True),  # the same, built as before 2.9
    ({"method": "fl-fsdp", "federations": 2, "shards": 1}, 2, False),  # the federation's own group (R = S = 1)
    ({"method": "fl-fsdp", "federations": 2, "group_shards": "1,2"}, 3, False),  # groups that shard differently
], ids=["mesh", "mesh-before-2.9", "own-fed", "channels"])
def test_every_process_group_has_the_configured_timeout(layout, world, older_torch):
    for timeouts in run_ranks(_every_group, world, layout, older_torch, timeout=200):
        assert len(timeouts) >= 5, timeouts
        assert timeouts == {name: TIMEOUT_S * (CONTROL_TIMEOUTS if name == "control" else 1) for name in timeouts}, \
            timeouts


def _a_peer_never_joins(rank: int, world: int) -> dict[str, float | str]:
    """Rank 0 runs a sync's collectives (admission, the vote, the commit vote, a bucket's all-reduce, a quantized
    ring's first step, a Flower round's flags over the group's control group) over groups of a 2 s timeout that
    rank 1 never joins; each must raise in its caller within the bound."""
    import torch.distributed as dist

    from flwr_sharded.flower.group.round import RoundFederation
    from flwr_sharded.parallel import admission
    from flwr_sharded.parallel.collectives import CollectiveTimeout
    from flwr_sharded.parallel.ring import quantized_all_reduce
    from flwr_sharded.parallel.wire import WIRES

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    groups = [dist.new_group([0, 1], timeout=timedelta(seconds=2)) for _ in range(6)]
    if rank == 1:
        dist.distributed_c10d._get_default_store().wait(["rank 0 done"], timedelta(seconds=90))
        return {}
    cpu, out = torch.device("cpu"), {}
    calls = {
        "admit": lambda g: admission.admit(1.0, True, None, g, cpu),
        "vote": lambda g: admission.vote(True, g, cpu),
        "commit_vote": lambda g: admission.commit_vote(True, g, cpu),
        "all_reduce": lambda g: WIRES["float32"].reduce(torch.ones(8), torch.zeros(8), 0.5, g, None),
        "ring step": lambda g: quantized_all_reduce(torch.ones(512), g, dtype=torch.int8),
        "flags": lambda g: RoundFederation.flags(SimpleNamespace(rt=SimpleNamespace(ctrl=g)), [0, 1]),
    }
    for (name, call), group in zip(calls.items(), groups):
        start = time.monotonic()
        try:
            call(group)
            out[name] = "returned"
        except CollectiveTimeout as exc:
            out[name] = time.monotonic() - start
            out[f"{name} error"] = str(exc)
    dist.distributed_c10d._get_default_store().set("rank 0 done", "1")
    return out


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_a_collective_a_peer_never_joins_raises_in_its_caller_within_the_timeout():
    out, _ = run_ranks(_a_peer_never_joins, 2, timeout=150)
    for name in ("admit", "vote", "commit_vote", "all_reduce", "ring step", "flags"):
        assert isinstance(out[name], float), (name, out[name])
        assert 1.5 <= out[name] < 10.0, (name, out[name])  # the 2 s bound, on a shared machine
        assert "within 2 s" in out[f"{name} error"], out[f"{name} error"]


class _Work:
    def __init__(self, done: bool | None = None, error: str = "") -> None:
        self.done, self.error, self.waited = done, error, None

    def wait(self, timeout: timedelta) -> bool:
        self.waited = timeout
        if self.error:
            raise RuntimeError(self.error)
        return bool(self.done)


class _Group:
    """A process group whose cpu backend was given a timeout of 3 s."""

    def _get_backend(self, device: torch.device) -> SimpleNamespace:
        assert device.type == "cpu"
        return SimpleNamespace(options=SimpleNamespace(_timeout=timedelta(seconds=3)))


def test_bounded_starts_async_and_waits_at_most_the_groups_timeout():
    from flwr_sharded.parallel.collectives import CollectiveTimeout, bounded

    seen, work = {}, _Work(done=True)

    def all_reduce(tensor, *, group, async_op, op=None):
        seen.update(tensor=tensor, group=group, async_op=async_op, op=op)
        return work

    group, tensor = _Group(), torch.ones(2)
    bounded(all_reduce, tensor, op="min", group=group)
    assert seen == {"tensor": tensor, "group": group, "async_op": True, "op": "min"}
    assert work.waited == timedelta(seconds=3)
    bounded(lambda *a, **k: _Work(done=True), [torch.ones(1)], tensor, group=group)  # a list's first tensor
    work.done = False
    with pytest.raises(CollectiveTimeout, match=r"all_reduce did not complete within 3 s"):
        bounded(all_reduce, tensor, group=group)
    work.error = "Operation timed out!\nmore"
    with pytest.raises(CollectiveTimeout, match=r"all_reduce failed or did not complete within 3 s: Operation timed "
                                                r"out!$"):
        bounded(all_reduce, tensor, group=group)
    bounded(lambda *a, **k: None, tensor, group=group)  # not a member: nothing to wait for


def test_group_options_carry_the_timeout():
    from flwr_sharded.parallel.collectives import group_options

    gloo = group_options("gloo", timedelta(seconds=5))
    assert (gloo.backend, gloo._timeout) == ("gloo", timedelta(seconds=5))

    class NCCL:
        class Options:
            is_high_priority_stream = True

    for backend in ("nccl", "cpu:gloo,cuda:nccl"):
        options = group_options(backend, timedelta(seconds=5), NCCL)
        assert isinstance(options, NCCL.Options)
        assert (options._timeout, options.is_high_priority_stream) == (timedelta(seconds=5), False)


def test_nccl_variables_are_set_once_before_any_group(monkeypatch):
    from flwr_sharded.parallel import collectives

    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_NONBLOCKING_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(collectives.dist, "is_initialized", lambda: False)
    collectives.configure_nccl_watchdog(timedelta(seconds=90), recoverable=False)
    env = collectives.os.environ
    assert (env["TORCH_NCCL_DUMP_ON_TIMEOUT"], env["TORCH_NCCL_NONBLOCKING_TIMEOUT"]) == ("0", "90")
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in env  # the static engine keeps the operator's (deploy/env.sh)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")  # an operator's own choice stays
    collectives.configure_nccl_watchdog(timedelta(seconds=90), recoverable=True)
    assert (env["TORCH_NCCL_ASYNC_ERROR_HANDLING"], env["TORCH_NCCL_DUMP_ON_TIMEOUT"]) == ("2", "1")
    monkeypatch.setattr(collectives.dist, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="before the first process group"):
        collectives.configure_nccl_watchdog(timedelta(seconds=90), recoverable=True)


class _StandInNCCL(torch.distributed.ProcessGroupGloo):
    """What `rendezvous.nccl_group` takes for torch's ProcessGroupNCCL where torch has none (a CPU build): its
    options and its eager connection (recorded in `connected`), the collectives gloo's."""

    connected: list[torch.device] = []

    class Options:
        def __init__(self) -> None:
            self.config, self.group_name, self.is_high_priority_stream = SimpleNamespace(blocking=True), "", True

    def __init__(self, store, rank: int, size: int, options: "_StandInNCCL.Options") -> None:  # noqa: ANN001
        super().__init__(store, rank, size, options._timeout)

    def eager_connect_single_device(self, device: torch.device) -> None:
        _StandInNCCL.connected.append(device)


def test_only_groups_without_nccl_are_rebuildable():
    """A failed collective leaves a gloo group usable and an NCCL one aborted: of the groups this package builds in a
    world of one (in-process), the gloo world and a gloo sub-group are rebuildable, and the group a Flower round
    builds for its shard sync with NCCL (`rendezvous.nccl_group`, torch's NCCL class stood in for) is not."""
    import torch.distributed as dist

    from flwr_sharded.flower.rendezvous import nccl_group
    from flwr_sharded.parallel import collectives

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sub = dist.new_group([0], backend="gloo", timeout=timedelta(seconds=TIMEOUT_S))
        assert collectives.rebuildable() and collectives.rebuildable(sub)
        nccl = nccl_group(dist.HashStore(), 0, 1, "rebuildable-nccl", timedelta(seconds=TIMEOUT_S),
                          torch.device("cpu"), nccl=_StandInNCCL)
        assert _StandInNCCL.connected == [torch.device("cpu")]  # built, and connected, as an NCCL group
        assert not collectives.rebuildable(nccl)
    finally:
        dist.destroy_process_group()
