"""Which blocks each data-parallel rank sees: the training blocks partitioned by (f, r, s), a rank's resumable batch
stream, and a group's evaluation batches."""

from __future__ import annotations

import hashlib

import torch

from flwr_sharded.training.data import TokenBlocks


def seeded_generator(*parts: object) -> torch.Generator:
    """A CPU generator seeded by a hash of `parts`: the same stream for the same parts, on any rank."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def partition_indices(n_blocks: int, *, fed_index: int, num_feds: int, dp_index: int, dp_world: int,
                      seed: int, epoch: int, partition: str = "iid", doc_ids: torch.Tensor | None = None,
                      group: tuple[int, int] | None = None) -> torch.Tensor:
    """The train block indices data-parallel rank `dp_index` (of federation group `fed_index`) uses in `epoch`.

    iid: every `dp_world`-th entry of one permutation from (seed, epoch), from `dp_index`: a rank's samples depend
    only on (dp_index, dp_world, seed, epoch). iid-groups: group f's every `num_feds`-th entry from f, then its ranks'
    share of those, disjoint even for groups of different sizes. document: `num_feds` contiguous ranges cut at
    document starts (`doc_ids`), range f shuffled by (seed, epoch, f) and shared by its ranks. `group`: (this rank's
    index in its group, the group's ranks) when groups differ in size (default: `dp_world // num_feds` each)."""
    if group is None:
        if num_feds < 1 or dp_world < 1 or dp_world % num_feds:
            raise ValueError(f"dp_world ({dp_world}) must be a positive multiple of num_feds ({num_feds})")
        group = (dp_index - fed_index * (dp_world // num_feds), dp_world // num_feds)
    rank, group_world = group
    if not 0 <= dp_index < dp_world or not 0 <= rank < group_world or not 0 <= fed_index < num_feds:
        raise ValueError(f"dp_index {dp_index} is not a rank of federation group {fed_index} "
                         f"({num_feds} groups, this one of {group_world}, in a world of {dp_world})")
    if partition in ("iid", "iid-groups"):
        order = torch.randperm(n_blocks, generator=seeded_generator("iid", seed, epoch))
        indices = order[dp_index::dp_world] if partition == "iid" else order[fed_index::num_feds][rank::group_world]
    elif partition == "document":
        if doc_ids is None or len(doc_ids) != n_blocks:
            raise ValueError(f"partition 'document' needs doc_ids for all {n_blocks} blocks")
        # Every block of a document goes to the group its first block falls in, proportionally.
        first_block = torch.searchsorted(doc_ids, doc_ids, right=False)
        members = torch.nonzero(first_block * num_feds // n_blocks == fed_index).flatten()
        order = torch.randperm(len(members), generator=seeded_generator("document", seed, epoch, fed_index))
        indices = members[order][rank::group_world]
    else:
        raise ValueError(f"unknown partition {partition!r}; use iid, iid-groups or document")
    if len(indices) == 0:
        raise ValueError(f"rank {dp_index} of {dp_world} gets no training block ({n_blocks} blocks, partition "
                         f"{partition!r}); use more data, fewer ranks or a shorter --seq-len")
    return indices


class BatchStream:
    """Infinite iterator of (batch_size, seq_len) int64 batches for one rank, epochs reshuffled (the incomplete last
    batch dropped); `state()` / `load_state()` resume exactly."""

    def __init__(self, blocks: TokenBlocks, *, batch_size: int, fed_index: int, num_feds: int, dp_index: int,
                 dp_world: int, seed: int, partition: str = "iid", group: tuple[int, int] | None = None) -> None:
        self._train, self._doc_ids, self.batch_size = blocks.train, blocks.train_doc_ids, batch_size
        self._layout = dict(fed_index=fed_index, num_feds=num_feds, dp_index=dp_index, dp_world=dp_world,
                            seed=seed, partition=partition, group=group)
        self.epoch, self.position = 0, 0
        self._indices = self._epoch_indices(0)
        if len(self._indices) < batch_size:
            raise ValueError(f"rank {dp_index} has {len(self._indices)} training blocks, fewer than one batch of "
                             f"{batch_size}; use more data, fewer ranks or a smaller batch size")

    def _epoch_indices(self, epoch: int) -> torch.Tensor:
        return partition_indices(len(self._train), epoch=epoch, doc_ids=self._doc_ids, **self._layout)

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> torch.Tensor:
        if self.position + self.batch_size > len(self._indices):
            self.epoch, self.position = self.epoch + 1, 0
            self._indices = self._epoch_indices(self.epoch)
        batch = self._train[self._indices[self.position:self.position + self.batch_size]]
        self.position += self.batch_size
        return batch

    def state(self) -> dict:
        """{"epoch", "position"}: where the next batch starts."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state(self, state: dict) -> None:
        """Resume at a position saved by `state()`."""
        indices = self._epoch_indices(state["epoch"])
        if not 0 <= state["position"] <= len(indices):
            raise ValueError(f"stream position {state['position']} outside epoch of {len(indices)} blocks")
        self.epoch, self.position, self._indices = state["epoch"], state["position"], indices


def eval_batches(blocks: TokenBlocks, *, batch_size: int, group_rank: int, group_world: int,
                 max_blocks: int) -> list[torch.Tensor]:
    """The first `max_blocks` validation blocks, every `group_world`-th from `group_rank`, in batches (ranks may get
    one fewer, or none)."""
    mine = blocks.validation[:max_blocks][group_rank::group_world].contiguous()
    return list(mine.split(batch_size)) if len(mine) else []
