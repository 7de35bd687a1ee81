"""The group runtime's command line (`python -m flwr_sharded.flower.group`): one `GroupOptions` field per option, from
which `group_parser` derives the flags (`flwr_sharded.schema`) and `docs/flower.md`'s option table is generated
(`flwr_sharded.options_doc.render_group_table`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal, Sequence

from flwr_sharded import schema
from flwr_sharded.config import ParallelConfig
from flwr_sharded.schema import option, same_as

PROG = "python -m flwr_sharded.flower.group"


@dataclass
class GroupOptions:
    """How one group runtime is started: its endpoint, layout, rendezvous offer, directories and timeouts."""

    authkey_file: str | None = option(None, required=True)
    """File holding the endpoint's shared secret (mode 600, at least 16 bytes)."""
    address: str = "127.0.0.1:0"
    """host:port of the endpoint (port 0: any free one)."""
    address_file: str | None = None
    """Write the endpoint's actual host:port to this file once it listens."""
    method: Literal["fl-fsdp", "fl-hsdp"] = "fl-fsdp"
    """The group's scheme: fl-fsdp (R = 1) or fl-hsdp (R > 1); R x S must equal the ranks torchrun launched."""
    replicas: int = same_as(ParallelConfig, "replicas")
    shards: int | None = same_as(ParallelConfig, "shards", default=None)
    """S: ranks one model replica is sharded over; unset: all ranks / R."""
    rendezvous_host: str = "127.0.0.1"
    """Address the other groups reach this group's rendezvous store at (one port per shard index, on rank 0)."""
    rendezvous_ports: str | None = None
    """Comma-separated store port per shard index; unset: free ports."""
    data_dir: str | None = None
    """Prepared data directory; overrides the run config's `data-dir` (a node config's `data-dir` overrides both)."""
    handoff_dir: str | None = None
    """Server path: the ranks and the ClientApp exchange shard files in a fresh private directory (mkdtemp, 700) made
    under this one, which the group's nodes must share; unset: the system's temp directory."""
    idle_timeout: float = option(600.0, ge=0)
    """Exit after this many seconds without an instruction (0: never)."""
    watch_pid: int = option(0, ge=0)
    """Exit when the process with this id is gone (0: watch none)."""
    collective_timeout: float = option(1800.0, gt=0)
    """Timeout of the group's own collectives (FSDP, evaluation), in seconds."""
    sync_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Backend of the cross-group shard sync: auto (NCCL for CUDA shards, else gloo), gloo or nccl."""


def group_parser(description: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=description, formatter_class=schema.HelpFormatter)
    schema.add_arguments(parser, GroupOptions)
    return parser


def parse(argv: Sequence[str] | None = None, description: str | None = None) -> GroupOptions:
    """The options of a command line; a bad value is a ConfigError naming the flag."""
    return schema.apply_arguments(GroupOptions(), group_parser(description).parse_args(argv))
