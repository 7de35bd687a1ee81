"""A ServerApp strategy for tests that makes one facility hostile on the server path, on real Flower messages.

`HostileFacility` is `ServerShardFedAvg` except that the last member of each round plays a facility that lies:
in round 2 its manifest reports the weight 1e300 (the exact value `HOSTILE_WEIGHT` names), in round 3 the first
chunk it sends holds a NaN. Everything else (the groups, their training, the SuperLink's messages) is real; the
strategy only edits what the server pulls from the Grid, where an attacker's bytes would arrive. Load it with the
run config `strategy="tests.flower.hostile_facility:HostileFacility"` (the repository on the ServerApp's PYTHONPATH,
and `FLWR_SHARDED_ALLOWED_IMPORTS=tests.flower.hostile_facility` in its environment).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.app import Array, Message

from flwr_sharded.flower import shard_files
from flwr_sharded.flower.server.server_path_strategy import ServerShardFedAvg

HOSTILE_WEIGHT = 1e300
WEIGHT_ROUND, NAN_ROUND = 2, 3


class HostileGrid:
    """`grid`, whose replies from the round's last member are edited as `strategy`'s round asks."""

    def __init__(self, grid: Any, strategy: HostileFacility, server_round: int) -> None:
        self._grid, self._strategy, self._round = grid, strategy, server_round

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def pull_messages(self, message_ids: Any) -> list[Message]:
        replies = list(self._grid.pull_messages(message_ids))
        for reply in replies:
            if reply.metadata.src_node_id == self._strategy.round_members[-1] and not reply.has_error():
                self._edit(reply.content)
        return replies

    def _edit(self, content: Any) -> None:
        if self._round == WEIGHT_ROUND and shard_files.SHARD_SHAPES in content:  # its manifest
            content[shard_files.SHARD_INFO]["weight"] = HOSTILE_WEIGHT
        elif self._round == NAN_ROUND and shard_files.SHARDS in content and not self._strategy.nan_sent:
            shards = content[shard_files.SHARDS]
            key = next(iter(shards.keys()))
            values = shards[key].numpy().copy()
            values.flat[0] = 0x7FC0 if values.dtype == np.int16 else np.nan  # bf16 travels as int16 bits
            shards[key] = Array(values)
            self._strategy.nan_sent = True


class HostileFacility(ServerShardFedAvg):
    nan_sent = False

    def run_round(self, grid: Any, server_round: int, result: Any, train_config: Any) -> None:
        super().run_round(HostileGrid(grid, self, server_round), server_round, result, train_config)


__all__ = ["HOSTILE_WEIGHT", "HostileFacility"]
