"""Shard-local aggregation rules: FedAvg and the outer optimizers (FedAvgM, Nesterov/DiLoCo, FedAdam, FedYogi).

A rule maps (global shard, [(member's local shard, weight), ...], state) to (new global shard, new state) element by
element, so it runs on any slice of a model: one rank's shard in the decentralised sync, a shard range at the server.
The global shard is what every group started the sync period from; outer optimizers step on the pseudo-gradient
`global - mean(members)`. A `linear` rule depends on the members only through their weighted mean (the sync needs
only an all-reduce); the others (trimmed mean, median) receive every member's shard (an all-gather: F shards of one
bucket in memory).

Class attributes declare what the project reads without running a rule: `name` (`--outer`, `RULES`), `linear`,
`stateful`, the options and defaults (dataclass fields) and the memory model's `state_buffers`, `temp_buckets` and
`temp_buckets_per_member`. Importing this module does not import torch (the config, the Flower run and the planner
list the rules); the math imports it when it runs.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Sequence

from flwr_sharded.errors import ConfigError

if TYPE_CHECKING:
    from torch import Tensor

State = dict[str, "Tensor"]


def weighted_mean(members: Sequence[tuple[Tensor, float]]) -> Tensor:
    """sum(w * x) / sum(w) in fp32 (or wider)."""
    import torch

    if not members:
        raise ValueError("no members to aggregate")
    total = sum(w for _, w in members)
    if not total > 0:
        raise ValueError(f"the members' weights must sum to > 0, got {total}")
    dtype = torch.promote_types(members[0][0].dtype, torch.float32)
    out = torch.zeros(members[0][0].shape, dtype=dtype, device=members[0][0].device)
    for shard, weight in members:
        out.add_(shard.to(dtype), alpha=weight / total)
    return out


class ShardRule(ABC):
    """A shard-local aggregation rule. Subclass it and implement `aggregate` (or `apply_mean` for linear rules)."""

    name: ClassVar[str | None] = None
    """The built-in rule's `--outer` name (`RULES`); None for a rule given by import path."""
    linear: ClassVar[bool] = False
    """True if the result depends on the members only through their weighted mean."""
    stateful: ClassVar[bool] = False
    """True if the rule needs the global shard (start of the sync period) and keeps state between syncs."""
    state_buffers: ClassVar[int] = 0
    """fp32 tensors of the shard's size in its state (`init_state`; scalars not counted): the memory model's."""
    temp_buckets: ClassVar[int] = 0
    """Bucket-sized fp32 temporaries of one step of the rule (the memory model's)."""
    temp_buckets_per_member: ClassVar[int] = 0
    """Bucket-sized temporaries per member of a rule that is not linear (its gathered shard and working copies)."""

    def init_state(self, global_shard: Tensor) -> State:
        """State for one shard before the first sync (e.g. zero moments)."""
        return {}

    def aggregate(self, global_shard: Tensor, members: Sequence[tuple[Tensor, float]],
                  state: State) -> tuple[Tensor, State]:
        """New global shard and state from every member's (local shard, weight)."""
        return self.apply_mean(global_shard, weighted_mean(members), state)

    def apply_mean(self, global_shard: Tensor, mean: Tensor, state: State) -> tuple[Tensor, State]:
        """For linear rules: new global shard and state from the members' weighted mean."""
        raise NotImplementedError(f"{type(self).__name__} is not linear: implement aggregate()")


@dataclass
class FedAvg(ShardRule):
    """The weighted mean (outer SGD with learning rate 1)."""

    name: ClassVar[str] = "fedavg"
    linear: ClassVar[bool] = True

    def apply_mean(self, global_shard: Tensor, mean: Tensor, state: State) -> tuple[Tensor, State]:
        return mean, state


@dataclass
class FedAvgM(ShardRule):
    """Outer SGD with heavy-ball momentum on the pseudo-gradient (Hsu et al., 2019), as Flower's `FedAvgM` computes
    it with `server_momentum` = momentum; Flower's default momentum is 0 (plain FedAvg), this rule's 0.9."""

    lr: float = 1.0
    momentum: float = 0.9
    name: ClassVar[str] = "fedavgm"
    nesterov: ClassVar[bool] = False
    linear: ClassVar[bool] = True
    stateful: ClassVar[bool] = True
    state_buffers: ClassVar[int] = 1
    temp_buckets: ClassVar[int] = 4  # delta, new momentum, step, result

    def init_state(self, global_shard: Tensor) -> State:
        import torch

        return {"momentum": torch.zeros_like(global_shard, dtype=torch.float32)}

    def apply_mean(self, global_shard: Tensor, mean: Tensor, state: State) -> tuple[Tensor, State]:
        delta = global_shard.float() - mean.float()
        m = state["momentum"].mul(self.momentum).add_(delta)
        step = delta.add(m, alpha=self.momentum) if self.nesterov else m
        return global_shard.float().sub(step, alpha=self.lr), {"momentum": m}


@dataclass
class Nesterov(FedAvgM):
    """DiLoCo's outer step: SGD with Nesterov momentum (defaults: lr 0.7, momentum 0.9)."""

    lr: float = 0.7
    momentum: float = 0.9
    name: ClassVar[str] = "nesterov"
    nesterov: ClassVar[bool] = True


@dataclass
class FedAdam(ShardRule):
    """Adaptive outer step (Reddi et al., 2021) as Flower's `FedAdam` computes it: its defaults (eta 0.1, beta1 0.9,
    beta2 0.99, tau 1e-3) and its bias-corrected step eta * sqrt(1 - beta2^(t+1)) / (1 - beta1^(t+1)) at sync t
    (Reddi et al.'s Algorithm 2 has no bias correction: `bias_correction=False`)."""

    lr: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3
    bias_correction: bool = True
    name: ClassVar[str] = "fedadam"
    linear: ClassVar[bool] = True
    stateful: ClassVar[bool] = True
    state_buffers: ClassVar[int] = 2
    temp_buckets: ClassVar[int] = 6  # FedAvgM's four, the second moment and its square root

    def init_state(self, global_shard: Tensor) -> State:
        import torch

        return {"m": torch.zeros_like(global_shard, dtype=torch.float32),
                "v": torch.zeros_like(global_shard, dtype=torch.float32),
                "t": torch.zeros((), dtype=torch.float64, device=global_shard.device)}

    def second_moment(self, v: Tensor, delta_sq: Tensor) -> Tensor:
        return v.mul(self.beta2).add_(delta_sq, alpha=1 - self.beta2)

    def apply_mean(self, global_shard: Tensor, mean: Tensor, state: State) -> tuple[Tensor, State]:
        delta = mean.float() - global_shard.float()  # the FedOpt update direction
        m = state["m"].mul(self.beta1).add_(delta, alpha=1 - self.beta1)
        v = self.second_moment(state["v"], delta * delta)
        t = state["t"] + 1
        lr = self.lr
        if self.bias_correction:
            step = float(t) + 1.0  # Flower's exponent: its server round (from 1) + 1
            lr = self.lr * math.sqrt(1 - self.beta2 ** step) / (1 - self.beta1 ** step)
        return global_shard.float() + lr * m / (v.sqrt() + self.tau), {"m": m, "v": v, "t": t}


@dataclass
class FedYogi(FedAdam):
    """FedAdam with Yogi's additive second-moment update (Reddi et al., 2021) as Flower's `FedYogi` computes it: its
    defaults (eta 0.01, tau 1e-3) and no bias correction."""

    lr: float = 0.01
    tau: float = 1e-3
    bias_correction: bool = False
    name: ClassVar[str] = "fedyogi"

    def second_moment(self, v: Tensor, delta_sq: Tensor) -> Tensor:
        import torch

        return v - (1 - self.beta2) * delta_sq * torch.sign(v - delta_sq)


TRIM_BLOCK = 2**20
"""Values (members x coordinates) `trimmed_mean` orders at once: its temporaries stay a few times this size."""
SORT_NETWORK_MEMBERS = 24
"""Up to this many members, `trimmed_mean` orders a block with min/max passes (odd-even transposition) instead of
`torch.sort`: the same values, 3-7x faster on a CPU for 3 to 24 members, and no int64 indices."""


def median_trim(n: int) -> int:
    """Values the coordinate-wise median of `n` values drops from each side: (n - 1) // 2, keeping the middle value
    (odd n) or the two middle ones, averaged (even n), as numpy's median and Flower's FedMedian do (`torch.median`
    returns the lower one). The server path's `server-rule` median uses it too."""
    if n < 1:
        raise ValueError(f"the median of {n} values is not defined")
    return (n - 1) // 2


def ordered_rows(block: Tensor) -> list[Tensor]:
    """The rows of `block` (members along dim 0) sorted coordinate by coordinate, as a list of rows: n passes of
    min/max over neighbouring rows for up to `SORT_NETWORK_MEMBERS` rows, `torch.sort` beyond. NaN is not ordered
    (both paths leave members that are not finite out before a rule runs)."""
    import torch

    if block.shape[0] > SORT_NETWORK_MEMBERS:
        return list(block.sort(dim=0).values.unbind(0))
    rows = list(block.unbind(0))
    for start in range(len(rows)):
        for i in range(start % 2, len(rows) - 1, 2):
            rows[i], rows[i + 1] = torch.minimum(rows[i], rows[i + 1]), torch.maximum(rows[i], rows[i + 1])
    return rows


def trimmed_mean(stacked: Tensor, trim: int, out: Tensor | None = None) -> Tensor:
    """Coordinate-wise mean of `stacked` (members along dim 0) without the `trim` largest and smallest values, in
    fp32 (summed in float64: finite inputs never overflow); trim = `median_trim(n)` gives the median. Ordered a block
    at a time (`ordered_rows`): beyond input and result it needs memory for `TRIM_BLOCK` values."""
    import torch

    n = stacked.shape[0] if stacked.dim() else 0
    if trim < 0 or n <= 2 * trim:
        raise ValueError(f"trimming {trim} from each side needs more than {2 * trim} members, got {n}")
    flat = stacked.reshape(n, -1)
    result = out if out is not None else torch.empty(stacked.shape[1:], dtype=torch.float32, device=stacked.device)
    target = result.view(-1)
    step = max(1, TRIM_BLOCK // n)
    for start in range(0, flat.shape[1], step):
        block = flat[:, start:start + step]
        kept = torch.stack(ordered_rows(block)[trim:n - trim]) if trim else block
        target[start:start + step] = kept.to(torch.float64).mean(dim=0)
    return result


@dataclass
class TrimmedMean(ShardRule):
    """Coordinate-wise mean without the `trim` largest and smallest values (weights ignored): robust to outliers.

    Flower's `FedTrimmedAvg` cuts int(beta * F) per side instead (beta 0.2); a count is used because F changes as
    groups drop and rejoin, and a fraction would silently stop trimming (int(0.2 * 4) = 0)."""

    trim: int = 1
    name: ClassVar[str] = "trimmed-mean"
    # its all-gathered bucket, the backend's copy of it, the stack and the ordering's block: an upper bound (3.4 per
    # member measured at F = 3, benchmarks/README.md)
    temp_buckets_per_member: ClassVar[int] = 5

    def aggregate(self, global_shard: Tensor, members: Sequence[tuple[Tensor, float]],
                  state: State) -> tuple[Tensor, State]:
        import torch

        return trimmed_mean(torch.stack([shard for shard, _ in members]), self.trim), state


@dataclass
class Median(ShardRule):
    """Coordinate-wise median of the members (weights ignored), the mean of the two middle values for an even F
    (`median_trim`; Flower's `FedMedian` computes the same): fewer than half the members cannot move a coordinate
    past the others' values, whatever finite values they send; with F = 2 it is their plain mean."""

    name: ClassVar[str] = "median"
    temp_buckets_per_member: ClassVar[int] = TrimmedMean.temp_buckets_per_member  # the same gather, stack, order

    def aggregate(self, global_shard: Tensor, members: Sequence[tuple[Tensor, float]],
                  state: State) -> tuple[Tensor, State]:
        import torch

        return trimmed_mean(torch.stack([shard for shard, _ in members]), median_trim(len(members))), state


RULES: dict[str, type[ShardRule]] = {cls.name: cls for cls in (FedAvg, FedAvgM, Nesterov, FedAdam, FedYogi,
                                                                 TrimmedMean, Median)}
"""The built-in rules by their `--outer` name."""
LINEAR_RULES: tuple[str, ...] = tuple(name for name, cls in RULES.items() if cls.linear)
"""The built-in rules the all-reduce, the bf16 and 8-bit wires, the overlap and the server path can run."""


def rule_options(cls: type[ShardRule]) -> dict[str, object]:
    """A rule's options (its dataclass fields) with their defaults."""
    return {f.name: f.default for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}


def make_rule(name: str, **options: float) -> ShardRule:
    """A rule by name (`RULES`) or import path (`package.module:Class`) with its options, e.g. make_rule("nesterov",
    lr=0.7). A ConfigError's message says what is wrong with the rule; the caller names the option that chose it."""
    if ":" in name:
        import importlib

        module, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"{name}: cannot import it: {exc}") from exc
        if not (isinstance(cls, type) and issubclass(cls, ShardRule)):
            raise ConfigError(f"{name}: not a ShardRule subclass")
    elif name in RULES:
        cls = RULES[name]
    else:
        raise ConfigError(f"must be one of {', '.join(RULES)} or package.module:Class; got {name!r}")
    try:
        return cls(**options)
    except TypeError as exc:
        raise ConfigError(f"{name}: {exc}") from exc
