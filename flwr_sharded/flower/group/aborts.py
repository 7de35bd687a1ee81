"""A round's members gone (the ServerApp says so): rank 0's endpoint thread marks the round aborted in the group's own
store (torchrun's, which every rank reaches), and each rank's rendezvous wait of that round ends at its next look."""

from __future__ import annotations

import json
import logging
from typing import Any, Callable

import torch.distributed as dist

from flwr_sharded.flower.group.contract import InstructionError

logger = logging.getLogger("flwr_sharded.group")

ABORT_KEY = "flwr_sharded/abort/"
"""Key prefix, in the group's own store, of the rounds whose members are gone (`abort_round`)."""


def abort_round(args: dict[str, Any]) -> dict[str, Any]:
    """Endpoint thread of rank 0: mark round `prefix` aborted, member(s) `gone` (`reason`)."""
    prefix, reason = str(args.get("prefix", "")), str(args.get("reason", "") or "gone")
    gone = [int(i) for i in args.get("gone", [])]
    if not prefix:
        raise InstructionError("abort needs the round's prefix")
    dist.distributed_c10d._get_default_store().set(ABORT_KEY + prefix, json.dumps({"gone": gone,
                                                                                  "reason": reason[:500]}))
    logger.warning("the ServerApp says member(s) %s of round %s are gone (%s): its rendezvous stops waiting", gone,
                   prefix, reason[:200])
    return {"prefix": prefix, "gone": gone}


def abort_check(prefix: str) -> Callable[[], str]:
    """For round `prefix`: a function returning '' or why its waits end (see `abort_round`)."""
    store, key = dist.distributed_c10d._get_default_store(), ABORT_KEY + prefix

    def check() -> str:
        if not store.check([key]):
            return ""
        info = json.loads(store.get(key))
        return f"member(s) {info['gone']} are gone ({info['reason']}; the ServerApp said so): not waiting for them"
    return check
