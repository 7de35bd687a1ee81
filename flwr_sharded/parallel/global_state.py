"""A shard sync's global state: the global shards and the rule's state, one flat fp32 tensor per bucket, and the
error-feedback residuals. Captured at the start of a sync period, stepped by the rule, checkpointed, broadcast to a
newcomer, and re-cut when the buckets change (a round whose members shard differently)."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from flwr_sharded.parallel.buckets import Bucket, BucketLayout
from flwr_sharded.parallel.collectives import bounded
from flwr_sharded.parallel.rules import ShardRule

RuleStep = Callable[[torch.Tensor | None, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""(global values, rule state) -> (new global values, new state): one bucket's step of a rule."""


class ErrorFeedback:
    """One fp32 residual per buffer (key), carried from one quantized all-reduce of that buffer to the next: every
    rounding error rank r made in its reduction (of its own values, of each partial sum it passed on, of the whole sum
    it rounded for the gather), so the residuals sum to exactly what the result misses and no error accumulates."""

    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}

    def residual(self, key: Any, like: torch.Tensor) -> torch.Tensor:
        """The residual of buffer `key` (zeros at first), shaped like the flat fp32 tensor `like`."""
        res = self.residuals.get(str(key))
        if res is None:
            res = self.residuals[str(key)] = torch.zeros(like.numel(), dtype=torch.float32, device=like.device)
        elif res.numel() != like.numel() or res.device != like.device:
            raise ValueError(f"error feedback residual {key!r} has {res.numel()} elements on {res.device}, "
                             f"the buffer {like.numel()} on {like.device}")
        return res

    def state_dict(self) -> dict[str, Any]:
        """Copies of the residuals (a checkpoint, or a snapshot to roll back to)."""
        return {"residuals": {k: v.clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = {k: v.clone() for k, v in state["residuals"].items()}


class GlobalState:
    """The global shards and rule state of one sync, per bucket of its layout.

    Args:
        rule: the sync's rule.
        keeps: whether the global shards are kept (a stateful rule, or a wire that sends deltas from them).
        feedback: the error-feedback residuals of a quantized or top-k wire (None: none).
    """

    def __init__(self, rule: ShardRule, keeps: bool, feedback: ErrorFeedback | None) -> None:
        self.rule, self.keeps, self.feedback = rule, keeps, feedback
        self.shards: list[torch.Tensor] | None = None
        """The global shards, one flat fp32 tensor per bucket (None until captured, or when not kept)."""
        self.rule_state: list[dict[str, torch.Tensor]] | None = None

    @property
    def captured(self) -> bool:
        return self.shards is not None

    @torch.no_grad()
    def capture(self, layout: BucketLayout) -> None:
        """The current shards become the global model (the start of a sync period), when kept."""
        if not self.keeps:
            return
        self.shards = [torch.cat([seg.float() for seg in shard_segments]) for _, shard_segments, _ in layout.views()]
        if self.rule_state is None:
            self.rule_state = [self.rule.init_state(g) for g in self.shards]

    def step(self, k: int, flat: torch.Tensor, step: RuleStep) -> None:
        """Run a rule's step on bucket k: the new global values go into `flat`, and are kept with the state."""
        state_k = self.rule_state[k] if self.rule_state is not None else {}
        new, state = step(self.shards[k] if self.shards is not None else None, state_k)
        flat.copy_(new)
        if self.keeps:
            self.shards[k].copy_(new)
            self.rule_state[k] = state

    def state_dict(self) -> dict[str, Any]:
        """The global shards and rule state (flat per bucket) and the residuals, for checkpoints and rollbacks."""
        out = {"rule": type(self.rule).__name__, "global": self.shards, "state": self.rule_state}
        if self.feedback is not None:
            out["residuals"] = self.feedback.residuals
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["rule"] != type(self.rule).__name__:
            raise ValueError(f"outer state was saved for {state['rule']}, this sync uses {type(self.rule).__name__}")
        self.shards, self.rule_state = state["global"], state["state"]
        if self.feedback is not None:
            self.feedback.residuals = dict(state.get("residuals") or {})

    @torch.no_grad()
    def broadcast(self, groups: list[dist.ProcessGroup], source: int = 0) -> None:
        """Copy rank `source`'s global shards and rule state to the other ranks of each bucket's group (`groups`,
        one per bucket)."""
        if not self.keeps:
            return
        if self.shards is None:
            raise RuntimeError("no global state to broadcast: capture it first")
        for k, (global_k, group) in enumerate(zip(self.shards, groups)):
            bounded(dist.broadcast, global_k, group=group, group_src=source)
            for name in sorted(self.rule_state[k]):
                bounded(dist.broadcast, self.rule_state[k][name], group=group, group_src=source)

    @torch.no_grad()
    def relayout(self, old: list[Bucket], layout: BucketLayout) -> None:
        """Re-cut the state from the buckets `old` to `layout`'s, element by element."""
        if self.shards is not None:
            self.shards = layout.move(self.shards, old)
        if self.rule_state is not None:
            states: list[dict[str, torch.Tensor]] = [{} for _ in layout.buckets]
            for name in (self.rule_state[0] if self.rule_state else {}):
                tensors = [state[name] for state in self.rule_state]
                if all(t.numel() == b.numel for t, b in zip(tensors, old)):
                    for state, t in zip(states, layout.move(tensors, old)):
                        state[name] = t
                else:  # one value per bucket, not per element (an adaptive rule's step count): the same in all
                    for state in states:
                        state[name] = tensors[0].clone()
            self.rule_state = states
        if self.feedback is not None and self.feedback.residuals:
            device = next(iter(self.feedback.residuals.values())).device
            residuals = [self.feedback.residuals.get(str(k), torch.zeros(b.numel, device=device))
                         for k, b in enumerate(old)]
            self.feedback.residuals = {str(k): t for k, t in enumerate(layout.move(residuals, old))}


__all__ = ["ErrorFeedback", "GlobalState", "RuleStep"]
