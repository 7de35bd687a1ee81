"""What the sync and the memory model know of each built-in shard rule without building it (torch-free): the one
declaration the rules of `outer.py` take their traits from, and the planner reads."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RuleTraits:
    """A shard rule's traits."""

    linear: bool
    """The result depends on the members only through their weighted mean (the sync needs only an all-reduce)."""
    stateful: bool
    """The rule needs the global shard (start of the sync period) and keeps state between syncs."""
    state_bytes: float = 0.0
    """Bytes per parameter of the rule's state (its shard-sized tensors; scalars not counted)."""


RULE_TRAITS: dict[str, RuleTraits] = {
    "fedavg": RuleTraits(linear=True, stateful=False),
    "fedavgm": RuleTraits(linear=True, stateful=True, state_bytes=4.0),  # fp32 momentum
    "nesterov": RuleTraits(linear=True, stateful=True, state_bytes=4.0),  # fp32 momentum
    "fedadam": RuleTraits(linear=True, stateful=True, state_bytes=8.0),  # fp32 m and v
    "fedyogi": RuleTraits(linear=True, stateful=True, state_bytes=8.0),  # fp32 m and v
    "trimmed-mean": RuleTraits(linear=False, stateful=False),
}
"""The built-in rules by name (`--outer`)."""
