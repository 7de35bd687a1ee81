"""FedProx over shards: the strategy asks every group for the proximal term mu/2 * ||w - w_sync||^2, which each rank
applies to its own shards against the shards of the group's last sync (`flwr_sharded.training.proximal`).

As Flower's `FedProx` (`flwr.serverapp.strategy.FedProx`) it only adds `proximal-mu` to the train config; the
groups do the rest. Run it with

    flwr run apps/llama_fl_hsdp --stream --run-config 'strategy="llama_fl_hsdp.strategies.fedprox:FedProxShards"'

(it ships with the app, so the ServerApp imports it wherever the app runs).
"""

from __future__ import annotations

from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid

from flwr_sharded.flower.run_config import FlowerRun
from flwr_sharded.flower.server.strategy import DecentralizedFedAvg


class FedProxShards(DecentralizedFedAvg):
    """DecentralizedFedAvg whose groups add FedProx's proximal term with `proximal_mu` every round."""

    def __init__(self, run: FlowerRun, *, proximal_mu: float = 0.01, **kwargs: Any) -> None:
        super().__init__(run, **kwargs)
        self.proximal_mu = proximal_mu

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> list[Message]:
        config["proximal-mu"] = self.proximal_mu
        return list(super().configure_train(server_round, arrays, config, grid))
