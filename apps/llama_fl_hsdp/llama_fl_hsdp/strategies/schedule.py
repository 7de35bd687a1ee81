"""A per-round schedule: A grows, the learning rate steps down, and one group in turn sits a round out.

    round r:  A = A_0 * 2^(r-1) (at most `max_steps`)   lr = lr_0 * decay^(r-1)   members: all but group (r mod F)
              on every `rest_every`-th round

Longer periods as training settles cost fewer syncs per step; a rotating rest shows partial participation (the
resting group keeps its shards and rejoins the sync the next round). Run it with

    flwr run apps/llama_fl_hsdp --stream --run-config 'strategy="llama_fl_hsdp.strategies.schedule:ScheduledFedAvg"'

(it ships with the app, so the ServerApp imports it wherever the app runs).
"""

from __future__ import annotations

from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid

from flwr_sharded.flower.run_config import FlowerRun
from flwr_sharded.flower.server.strategy import DecentralizedFedAvg


class ScheduledFedAvg(DecentralizedFedAvg):
    """DecentralizedFedAvg with a per-round A, learning rate and set of participating groups."""

    def __init__(self, run: FlowerRun, *, max_steps: int = 64, decay: float = 0.7, rest_every: int = 2,
                 **kwargs: Any) -> None:
        super().__init__(run, **kwargs)
        self.max_steps, self.decay, self.rest_every = max_steps, decay, rest_every

    def round_options(self, server_round: int) -> dict[str, Any]:
        """This round's A and peak learning rate."""
        steps = min(self.max_steps, self.run.train.parallel.aggregate_every * 2 ** (server_round - 1))
        return {"aggregate-every": steps, "lr": self.run.train.optim.lr * self.decay ** (server_round - 1)}

    def select_members(self, server_round: int) -> list[int]:
        members = super().select_members(server_round)
        if len(members) > 1 and self.rest_every and server_round % self.rest_every == 0:
            resting = members[server_round % len(members)]
            return [m for m in members if m != resting]
        return members

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> list[Message]:
        for key, value in self.round_options(server_round).items():
            config[key] = value
        return list(super().configure_train(server_round, arrays, config, grid))
