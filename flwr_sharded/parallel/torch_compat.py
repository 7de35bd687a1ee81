"""What differs between the torch releases the package runs on, in one place; pyproject.toml declares the floor.

The torch APIs the package relies on and the release that brought each (read in the released wheels' sources).
Where an earlier release has an equivalent, a function here takes the newer API where it exists, the older where not:

- 2.13 `dist.all_gather_single` (admission, offender, the quantized and top-k rings, the sync loop); before it
  `all_gather_into_tensor`, the same collective, which 2.13 made its deprecated wrapper: `all_gather_single`.
- 2.13 `dist.reduce_scatter_single` (the two-level sync's reduction inside a site, `sites`); before it
  `reduce_scatter_tensor`, the same collective.
- 2.13 `c10d._register_pg_in_world` (`flower.rendezvous.nccl_group`); before it the same world entries written out:
  `register_pg_in_world`.
- 2.9 `init_device_mesh(backend_override=)` and `DeviceMesh._flatten(backend_override=)` (`topology.init_topology`);
  before them the timeout set on each group once made: `device_mesh`, `flatten`.
- Every release to 2.13: `destroy_process_group` leaves a destroyed group's tag in c10d's `tags_to_pg`, with an empty
  list; a process that makes a group every round keeps one per round: `destroy_group` drops it.
- 2.9 `ProcessGroup.set_timeout` (`flower.rendezvous.join`); before it c10d's `_set_pg_timeout`: `set_timeout`.
- 2.9 `FileSystemReader._get_metadata_path` (`training.checkpoint_files.SafeReader`); before it the checkpoint's one
  `.metadata`: `dcp_metadata_path`.
- 2.8 `torch.float4_e2m1fn_x2`, the `float4_e2m1` wire's dtype (`parallel.wire`, `parallel.codecs.floats`): none before.
- 2.8 FSDP2's gradient reduction over gloo (every FSDP/HSDP run on CPU): 2.7 reduces with `ReduceOp.AVG`, which gloo
  refuses; none before.
- 2.7 `dcp.save` and `dcp.load` with `no_dist=` (`training.checkpoint_export`'s one-process export).
- 2.6 or earlier: FSDP2 in `torch.distributed.fsdp` (`fully_shard`, `FSDPModule.set_requires_all_reduce`,
  `MixedPrecisionPolicy`), `dist.get_backend_config`, `P2POp(group_peer=)`, `dcp.async_save(process_group=)`,
  `ProcessGroupNCCL.Options` (`config.blocking`), `eager_connect_single_device`, `c10d._abort_process_group`,
  `torch.overrides.TorchFunctionMode`.

So the floor is 2.8, set by the float4 wire's dtype and FSDP2 on gloo (on 2.6, FSDP2's CPU path also needs
`Stream.record_event`, which 2.6's CPU stream lacks). `make test-floors` runs on the floor itself, `make
gpu-rehearsal` runs the GPU check on the lent machine's 2.11.
"""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def all_gather_single(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None,
                      async_op: bool = False) -> Any:
    """Every rank's `input_tensor`, concatenated in rank order into `output_tensor`: torch's `all_gather_single`
    (2.13 on), else `all_gather_into_tensor` (the same collective under its earlier name). Looked up when called,
    so that a `TrafficMeter` wrapping either name counts it."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group: Any = None,
                          async_op: bool = False) -> Any:
    """The SUM of every rank's `input`, its rank's 1/world slice into `output`: torch's `reduce_scatter_single` (2.13
    on), else `reduce_scatter_tensor` (the same collective under its earlier name). Looked up when called, so that a
    `TrafficMeter` wrapping either name counts it."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, group=group, async_op=async_op)


def register_pg_in_world(pg: dist.ProcessGroup, *, backend_name: str, store: dist.Store, group_name: str,
                         backend_config: str) -> None:
    """Record a process group built outside `new_group` in c10d's world, as a sub-group of the default tag (so that
    `destroy_process_group` and `_abort_process_group` find it): torch's `_register_pg_in_world` (2.13 on), else
    the same entries written as `_new_process_group_helper` writes them in earlier releases."""
    register = getattr(c10d, "_register_pg_in_world", None)
    if register is not None:
        register(pg, backend_name=backend_name, store=store, group_name=group_name, backend_config=backend_config,
                 add_to_default_tag=True)
        return
    world = c10d._world
    world.pg_map[pg] = (backend_name, store)
    world.pg_names[pg] = group_name
    world.pg_backend_config[pg] = backend_config
    c10d._register_process_group(group_name, pg)
    tag = f"ptd:{group_name}"
    world.tags_to_pg.setdefault("", []).append(pg)
    world.tags_to_pg.setdefault(tag, []).append(pg)
    world.pg_to_tag[pg] = tag


def destroy_group(pg: dist.ProcessGroup) -> None:
    """`dist.destroy_process_group(pg)`, and the empty entry it leaves under the group's tag in c10d's world."""
    tag = c10d._world.pg_to_tag.get(pg)
    dist.destroy_process_group(pg)
    if tag and c10d._world.tags_to_pg.get(tag) == []:
        del c10d._world.tags_to_pg[tag]


def set_timeout(group: dist.ProcessGroup, timeout: timedelta) -> None:
    """Give every backend of `group` the timeout `timeout` for its next collectives: `ProcessGroup.set_timeout`
    (2.9 on), else c10d's `_set_pg_timeout`, which does the same."""
    if hasattr(group, "set_timeout"):
        group.set_timeout(timeout)
    else:
        c10d._set_pg_timeout(timeout, group)


def _takes_backend_override() -> bool:
    return "backend_override" in inspect.signature(init_device_mesh).parameters


def device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...], options: Any) -> DeviceMesh:
    """`init_device_mesh` whose every dimension's group has the backend `options` (`collectives.group_options`: the
    run's timeout): given at construction (`backend_override`, 2.9 on), else the timeout set on each group once made
    (NCCL's communicators are made at the first collective, after it)."""
    if _takes_backend_override():
        return init_device_mesh(device_type, shape, mesh_dim_names=names,
                                backend_override={name: options for name in names})
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    for name in names:
        set_timeout(mesh.get_group(name), options._timeout)
    return mesh


def flatten(mesh: DeviceMesh, name: str, options: Any) -> DeviceMesh:
    """`mesh`'s dimensions flattened into one named `name`, its group with the backend `options` (as `device_mesh`)."""
    if _takes_backend_override():
        return mesh._flatten(name, backend_override=options)
    flat = mesh._flatten(name)
    set_timeout(flat.get_group(name), options._timeout)
    return flat


def dcp_metadata_path(reader: Any, rank: int | None = None) -> Any:
    """The `.metadata` file a DCP `FileSystemReader` reads: its own `_get_metadata_path` (2.9 on, which names a
    rank's own file when given `rank`), else the checkpoint's one `.metadata` (as 2.8's `read_metadata` opens it)."""
    own = getattr(reader, "_get_metadata_path", None)
    if own is not None:
        return own(rank)
    return reader.fs.concat_path(reader.path, ".metadata")
