"""A round's federation group as `rendezvous.join` builds it: gloo through torch's helper, NCCL directly over the
round's store (never split from the process's own groups), each with the round's timeouts. NCCL itself cannot run
here: a gloo backend stands in for ProcessGroupNCCL, so what is checked is the construction (its options, the
eager connect, the registration that destroy and abort need). One spawned rank each (`tests.multiproc.run_ranks`
kills it at the end)."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest

from tests.flower.test_group import ROUND_SECRET
from tests.multiproc import run_ranks


def _join_alone(rank: int, world: int, backend: str) -> dict:
    """Member 0 of a one-member round joins over `backend` (NCCL: a stand-in), runs an all-reduce where it can,
    and ends the group as a failed one would be (NCCL: aborted)."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from flwr_sharded.flower import rendezvous

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    made: dict = {}

    class StandIn(dist.ProcessGroupGloo):  # ProcessGroupNCCL(store, rank, size, options), played by gloo
        class Options:
            def __init__(self) -> None:
                self.config = SimpleNamespace(blocking=True)

        def __init__(self, store, rank: int, size: int, options: Options) -> None:  # noqa: ANN001
            made.update(rank=rank, size=size, timeout=options._timeout, blocking=options.config.blocking,
                        high_priority=options.is_high_priority_stream, name=options.group_name)
            super().__init__(store, rank, size, options._timeout)

        def eager_connect_single_device(self, device: torch.device) -> None:
            made["eager"] = str(device)
            super().eager_connect_single_device(device)

    if backend == "nccl":
        rendezvous.nccl_class = lambda: StandIn
    server = rendezvous.serve_stores("127.0.0.1", 1)
    try:
        prefix = "run1/round1"
        server.open_round(prefix, ROUND_SECRET, 1)
        group = rendezvous.join(host="127.0.0.1", port=server.ports[0], prefix=f"{prefix}/s0", rank=0, size=1,
                                rendezvous_timeout=20.0, sync_timeout=30.0, secret=ROUND_SECRET, members=["node-a"],
                                backend=backend, device=torch.device("cpu"))
        device = torch.device("cuda" if backend == "nccl" else "cpu")
        made["group timeout"] = group.pg._get_backend(device).options._timeout
        made["registered"] = group.pg in c10d._world.pg_map and c10d._world.pg_names[group.pg] == group.name
        made["rank"] = dist.get_rank(group.pg)
        if backend == "gloo":
            value = torch.ones(1)
            dist.all_reduce(value, group=group.pg)
            made["sum"] = float(value.item())
        group.destroy(failed=True)
        made["ended"] = group.pg not in c10d._world.pg_map
    finally:
        server.close()
    return made


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_an_nccl_federation_group_is_built_directly_with_the_rounds_timeout():
    (made,) = run_ranks(_join_alone, 1, "nccl", timeout=90)
    assert made["timeout"] == made["group timeout"] == timedelta(seconds=30)
    assert (made["rank"], made["size"], made["name"]) == (0, 1, "flwr-fed:run1/round1/s0")
    assert (made["blocking"], made["high_priority"]) == (False, False)  # made at once, nonblocking
    assert made["eager"] == "cpu"  # the communicator of the device it was given, made before join returns
    assert made["registered"] and made["ended"]  # a sub-group of this world: destroyed, or aborted when failed


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_gloo_federation_group_keeps_torchs_helper_and_the_rounds_timeout():
    (made,) = run_ranks(_join_alone, 1, "gloo", timeout=90)
    assert made["group timeout"] == timedelta(seconds=30)  # built with a share of it, then given all of it
    assert (made["rank"], made["sum"], made["registered"], made["ended"]) == (0, 1.0, True, True)
