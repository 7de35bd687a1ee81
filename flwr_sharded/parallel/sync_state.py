"""A shard sync's outer state: the global shards and the rule's state, one flat fp32 tensor per bucket, and the
error-feedback residuals; captured at the start of a sync period, checkpointed, broadcast to a newcomer, and re-laid
out when the buckets change (`relayout`: a round whose members shard differently)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from flwr_sharded.parallel.buckets import Bucket


class OuterState:
    """The outer-state half of `flwr_sharded.parallel.sync.ShardSync` (which provides `rule`, `delta`, `feedback`,
    `wire_dtype`, `groups`, `channel_of`, `bucket_views`, `segments_of` and `_buckets`)."""

    _global: list[torch.Tensor] | None
    _rule_state: list[dict[str, torch.Tensor]] | None
    _buckets: list[Bucket]

    @property
    def keeps_global(self) -> bool:
        """Whether this sync keeps the global shards (and rule state): a stateful rule, or a reduced wire dtype;
        then `outer_state_dict` belongs in checkpoints and must be restored with the shards."""
        return self.rule.stateful or self.delta

    @property
    def has_outer_state(self) -> bool:
        """Whether this rank holds outer state (global shards): replica 0 after `capture_global`."""
        return self._global is not None

    @torch.no_grad()
    def capture_global(self) -> None:
        """Remember the current shards as the global model (start of a sync period) when `keeps_global`."""
        if not self.keeps_global:
            return
        self._global = [torch.cat([seg.float() for seg in shard_segments])
                        for _, shard_segments, _ in self.bucket_views()]
        if self._rule_state is None:
            self._rule_state = [self.rule.init_state(g) for g in self._global]

    def outer_state_dict(self) -> dict[str, Any]:
        """This rank's outer state (global shards and rule state, flat per bucket, and the error-feedback residuals),
        for checkpoints and rollbacks."""
        out = {"rule": type(self.rule).__name__, "global": self._global, "state": self._rule_state}
        if self.feedback is not None:
            out["residuals"] = self.feedback.residuals
        return out

    def load_outer_state_dict(self, state: dict[str, Any]) -> None:
        if state["rule"] != type(self.rule).__name__:
            raise ValueError(f"outer state was saved for {state['rule']}, this sync uses {type(self.rule).__name__}")
        self._global, self._rule_state = state["global"], state["state"]
        if self.feedback is not None:
            self.feedback.residuals = dict(state.get("residuals") or {})

    @torch.no_grad()
    def broadcast_outer_state(self, group: dist.ProcessGroup | None, source: int = 0) -> None:
        """Copy the outer state (global shards, rule state) of rank `source` of `group` to its other ranks (None:
        over each bucket's channel, from member `source`, as `broadcast`)."""
        if not self.keeps_global:
            return
        if self._global is None:
            raise RuntimeError("no outer state to broadcast: call capture_global() first")
        for k, global_k in enumerate(self._global):
            over = group if group is not None else self.groups[self.channel_of(k)]
            dist.broadcast(global_k, group=over, group_src=source)
            for name in sorted(self._rule_state[k]):
                dist.broadcast(self._rule_state[k][name], group=over, group_src=source)

    def _needs_global(self) -> str:
        if self.rule.stateful:
            return f"{type(self.rule).__name__} steps from the global model"
        return f"a {self.wire_dtype} wire sends deltas from the global model"

    def store_global(self, means: list[torch.Tensor] | None = None) -> None:
        """Make the groups' mean the global model (FedAvg with a reduced wire): `means`, one flat tensor per bucket,
        or else the current shards (which a blocking sync just overwrote with it)."""
        for k, (global_k, (_, shard_segments, _)) in enumerate(zip(self._global, self.bucket_views())):
            torch._foreach_copy_(self.segments_of(k, global_k), shard_segments if means is None else
                                 self.segments_of(k, means[k]))


    @torch.no_grad()
    def relayout(self, old: list[Bucket], numels: list[int]) -> None:
        """Carry the outer state from the buckets `old` to the current ones, element by element (`numels`: each local
        shard's elements): the same values, cut as the new plan cuts the shards."""
        def move(flats: list[torch.Tensor]) -> list[torch.Tensor]:
            shards = [flats[0].new_zeros(n) for n in numels]
            for flat, bucket in zip(flats, old):
                for seg in bucket.segments:
                    shards[seg.shard][seg.start:seg.end] = flat[seg.offset:seg.offset + seg.end - seg.start]
            return [torch.cat([shards[seg.shard][seg.start:seg.end] for seg in b.segments]) for b in self._buckets]

        if self._global is not None:
            self._global = move(self._global)
        if self._rule_state is not None:
            states: list[dict[str, torch.Tensor]] = [{} for _ in self._buckets]
            for name in (self._rule_state[0] if self._rule_state else {}):
                tensors = [state[name] for state in self._rule_state]
                if all(t.numel() == b.numel for t, b in zip(tensors, old)):
                    for state, t in zip(states, move(tensors)):
                        state[name] = t
                else:  # one value per bucket, not per element (an adaptive rule's step count): the same in all
                    for state in states:
                        state[name] = tensors[0].clone()
            self._rule_state = states
        if self.feedback is not None and self.feedback.residuals:
            device = next(iter(self.feedback.residuals.values())).device
            residuals = [self.feedback.residuals.get(str(k), torch.zeros(b.numel, device=device))
                         for k, b in enumerate(old)]
            self.feedback.residuals = {str(k): t for k, t in enumerate(move(residuals))}
