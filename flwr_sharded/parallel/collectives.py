"""Process groups with the configured timeout, and collectives that end within it.

Every group this package makes carries the run's timeout (`group_options` for the device mesh, `timeout=` for
`new_group`); a collective of the sync is started with `async_op=True` and waited for at most its group's timeout
(`bounded`), so that a peer that never answers raises in the caller, before it reads a buffer the collective did not
fill (NCCL's `wait(timeout)` aborts the communicator; without a timeout the watchdog notices it about a minute late
and the caller reads garbage). `configure_nccl_watchdog` sets the NCCL variables once per process, before any group
exists (NCCL reads them when a group is built, and its threads read them later: they are never changed after).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend
from torch.distributed import distributed_c10d as c10d

logger = logging.getLogger(__name__)

NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
CLEAN_UP_ONLY = "2"
"""NCCL's error-handling mode in which a failed collective aborts its communicator and raises, the process lives on."""
NCCL_DEFAULTS = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
"""The watchdog writes no debug dump on a timeout (it would signal through the group's store, possibly served by a
member that is gone, and sleep about a minute before aborting)."""
NCCL_NONBLOCKING_TIMEOUT = "TORCH_NCCL_NONBLOCKING_TIMEOUT"
"""How long a nonblocking communicator's set-up may take (an NCCL federation group is made eagerly, nonblocking)."""


class CollectiveTimeout(RuntimeError):
    """A collective failed or did not complete within its group's timeout (a peer is gone, late or stuck)."""


def configure_nccl_watchdog(timeout: timedelta, *, recoverable: bool) -> None:
    """Set NCCL's process-wide variables, once, before the process's first group: no dump on a timeout, a
    nonblocking set-up bounded by `timeout` (both unless already set), and, where a failed group must not end the
    process (`recoverable`: a Flower group's rounds), error-handling mode 2 (CleanUpOnly) for every group."""
    if dist.is_initialized():
        raise RuntimeError("configure_nccl_watchdog runs before the first process group (NCCL reads these once)")
    for name, value in {**NCCL_DEFAULTS, NCCL_NONBLOCKING_TIMEOUT: str(int(timeout.total_seconds()))}.items():
        os.environ.setdefault(name, value)
    if recoverable:
        previous = os.environ.get(NCCL_ERROR_HANDLING)
        if previous not in (None, CLEAN_UP_ONLY):
            logger.info("%s=%s replaced by %s: a failed federation group must raise, not end the process",
                        NCCL_ERROR_HANDLING, previous, CLEAN_UP_ONLY)
        os.environ[NCCL_ERROR_HANDLING] = CLEAN_UP_ONLY


def nccl_class() -> Any:
    """torch's ProcessGroupNCCL (only in a CUDA build of torch)."""
    from torch.distributed import ProcessGroupNCCL

    return ProcessGroupNCCL


def group_options(backend: str, timeout: timedelta, nccl: Any = None) -> Any:
    """A backend's options carrying `timeout` (what `init_device_mesh(backend_override=...)` and `_flatten` take):
    NCCL's own (`nccl`: its class, default `nccl_class()`) wherever NCCL carries a device (`nccl`,
    `cpu:gloo,cuda:nccl`; with the stream priority torch gives a group by default), else the base options."""
    if "nccl" in backend:
        options = (nccl or nccl_class()).Options()
        options.is_high_priority_stream = False
    else:
        options = C10dBackend.Options(backend)
    options._timeout = timeout
    return options


def group_timeout(group: dist.ProcessGroup | None, device: torch.device) -> timedelta:
    """The timeout the backend that carries `device`'s tensors in `group` (None: the default group) was given."""
    pg = group if group is not None else c10d._get_default_group()
    return pg._get_backend(device).options._timeout


def bounded(collective: Callable[..., Any], *args: Any, group: dist.ProcessGroup | None, **kwargs: Any) -> None:
    """`collective(*args, group=group, async_op=True, **kwargs)`, waited for at most the group's timeout (that of the
    backend carrying the first tensor argument's device): CollectiveTimeout here if it fails or does not complete,
    before any buffer is read."""
    if group is c10d.GroupMember.NON_GROUP_MEMBER:  # this rank is not in the group: nothing to run
        return
    first = args[0] if isinstance(args[0], torch.Tensor) else args[0][0]
    timeout = group_timeout(group, first.device)
    work = collective(*args, group=group, async_op=True, **kwargs)
    if work is None:  # not a member either (torch's collectives return no work then)
        return
    wait_for(work, collective.__name__, timeout)


def wait_for(work: Any, what: str, timeout: timedelta) -> None:
    """Wait for an async collective's or point-to-point op's `work` at most `timeout`: CollectiveTimeout, naming
    `what` and the bound, if it fails (gloo raises its own error on a timeout) or does not complete."""
    try:
        done = work.wait(timeout)
    except Exception as exc:  # noqa: BLE001 - the backend's own error, named with the collective and its bound
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CollectiveTimeout(f"{what} failed or did not complete within {timeout.total_seconds():g} s: "
                                f"{reason}") from exc
    if not done:
        raise CollectiveTimeout(f"{what} did not complete within {timeout.total_seconds():g} s")


def rebuildable(group: dist.ProcessGroup | None = None) -> bool:
    """Whether `group` (None: the default group) can run collectives again after one of them failed: gloo's pairs
    do, NCCL's communicators are aborted by the failure (only a new group can follow)."""
    return "nccl" not in dist.get_backend(group)
