"""FedProx's proximal term over shards (Li et al., 2020): each group minimises loss + mu/2 * ||w - w_sync||^2,
w_sync its model after the last sync. The squared norm is a sum over shards, so each rank adds the gradient
mu * (w - w_sync) to its own shards after backward (before clipping, as part of the loss); no rank sees another's rows.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from flwr_sharded.parallel.alignment import local_shard


class ProximalTerm:
    """The anchor w_sync (this rank's shards at the last sync) and the gradient of the proximal term."""

    def __init__(self, model: nn.Module) -> None:
        self.params = list(model.parameters())
        self._anchor: list[torch.Tensor] | None = None

    @torch.no_grad()
    def set_anchor(self, params: list[nn.Parameter] | None = None) -> None:
        """The current shards (of `params` only, e.g. a sync fragment's, once the anchor exists) become w_sync."""
        if self._anchor is None:
            self._anchor = [torch.empty_like(local_shard(p)) for p in self.params]
            params = None  # the first anchor is the whole model
        chosen = None if params is None else {id(p) for p in params}
        pairs = [(a, local_shard(p)) for p, a in zip(self.params, self._anchor) if chosen is None or id(p) in chosen]
        if pairs:
            torch._foreach_copy_([a for a, _ in pairs], [s for _, s in pairs])

    def release(self) -> None:
        """Forget the anchor (mu is 0): its memory, one copy of the shards, is freed."""
        self._anchor = None

    @torch.no_grad()
    def add_gradient(self, mu: float) -> None:
        """grad += mu * (w - w_sync) on this rank's shards (anchored first if no anchor is set)."""
        if self._anchor is None:
            self.set_anchor()
        for param, anchor in zip(self.params, self._anchor):
            if param.grad is None:
                continue
            grad = param.grad._local_tensor if isinstance(param.grad, DTensor) else param.grad
            grad.add_(local_shard(param) - anchor, alpha=mu)

    @torch.no_grad()
    def value(self, mu: float) -> float:
        """mu/2 * ||w - w_sync||^2 over this rank's shards (sum over ranks for the whole model)."""
        if self._anchor is None:
            return 0.0
        return 0.5 * mu * sum(float((local_shard(p) - a).double().pow(2).sum()) for p, a in zip(self.params,
                                                                                          self._anchor))
