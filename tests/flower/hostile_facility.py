"""A ServerApp strategy for tests that makes one facility hostile on the server path, on real Flower messages.

`HostileFacility` is `ServerShardFedAvg` except that the last member of each round plays a facility that lies:
in round 2 its manifest reports the weight 1e300 (the exact value `HOSTILE_WEIGHT` names), in round 3 the first
chunk it sends holds a NaN. Everything else (the groups, their training, the SuperLink's messages) is real; the
strategy only edits what the server receives, where an attacker's bytes would arrive. Load it with the run
config `strategy="tests.flower.hostile_facility:HostileFacility"` (the repository on the ServerApp's PYTHONPATH, and
`FLWR_SHARDED_ALLOWED_IMPORTS=tests.flower.hostile_facility` in its environment).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from flwr.app import Array, Message

from flwr_sharded.flower import shard_files
from flwr_sharded.flower.server.server_path import ServerShardFedAvg

HOSTILE_WEIGHT = 1e300
WEIGHT_ROUND, NAN_ROUND = 2, 3


class HostileFacility(ServerShardFedAvg):
    _round = 0
    _nan_sent = False

    def run_round(self, grid: Any, server_round: int, result: Any, train_config: Any) -> None:
        self._round = server_round
        super().run_round(grid, server_round, result, train_config)

    def _victim(self) -> int:
        return self.round_members[-1]

    def train_and_collect(self, grid: Any, messages: list[Message]) -> list[Message]:
        replies = super().train_and_collect(grid, messages)
        if self._round == WEIGHT_ROUND:
            for reply in replies:
                if reply.metadata.src_node_id == self._victim() and shard_files.SHARD_INFO in reply.content:
                    reply.content[shard_files.SHARD_INFO]["weight"] = HOSTILE_WEIGHT
        return replies

    def await_replies(self, grid: Any, pending: dict[str, int], deadline: float,
                      on_reply: Callable[[Message], Message] | None = None) -> list[Message]:
        if self._round != NAN_ROUND or on_reply is None or self._nan_sent:
            return super().await_replies(grid, pending, deadline, on_reply)

        def poisoned(reply: Message) -> Message:
            if (not self._nan_sent and reply.metadata.src_node_id == self._victim() and not reply.has_error()
                    and shard_files.SHARDS in reply.content):
                shards = reply.content[shard_files.SHARDS]
                key = next(iter(shards.keys()))
                values = shards[key].numpy().copy()
                values.flat[0] = 0x7FC0 if values.dtype == np.int16 else np.nan  # bf16 travels as int16 bits
                shards[key] = Array(values)
                self._nan_sent = True
            return on_reply(reply)

        return super().await_replies(grid, pending, deadline, poisoned)


__all__ = ["HOSTILE_WEIGHT", "HostileFacility"]
