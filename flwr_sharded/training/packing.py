"""Tokenizing documents and packing them into fixed-length blocks.

Documents are tokenized without special tokens, an eos is put after each, the tokens are concatenated and cut into
(N, seq_len) blocks; the tail is dropped. A map-style dataset is tokenized by `datasets.Dataset.map` in several
processes (its progress bar shows), a stream in this process (fast tokenizers batch-encode in threads); both stop
once `max_blocks` blocks are full, and give the same blocks for the same documents.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from flwr_sharded.config import DataConfig
from flwr_sharded.errors import ConfigError
from flwr_sharded.training.sources import Splits, column_error

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOKENIZE_BATCH = 1000
"""Documents per tokenizer call."""
CHUNK_DOCUMENTS = 200_000
"""Most documents one `Dataset.map` tokenizes: bounds the memory its output takes before it is packed."""


def default_workers() -> int:
    """min(8, the CPUs this process may run on)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, cpus))


def encode(batch: dict[str, list[Any]], *, tokenizer: PreTrainedTokenizerBase, field: str,
           eos: int) -> dict[str, list[list[int]]]:
    """Token ids of a batch's non-empty documents, an eos after each (a `Dataset.map` function)."""
    texts = [t for t in batch[field] if t]
    ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"] if texts else []
    return {"ids": [x + [eos] for x in ids]}


class Packer:
    """Concatenates documents' tokens and cuts them into blocks; `full` once `max_blocks` blocks are."""

    def __init__(self, seq_len: int, max_blocks: int | None) -> None:
        self.seq_len = seq_len
        self.limit = None if max_blocks is None else max_blocks * seq_len
        self.max_blocks = max_blocks
        self.pieces: list[torch.Tensor] = []
        self.lengths: list[torch.Tensor] = []
        self.total = 0
        self.documents = 0

    @property
    def full(self) -> bool:
        return self.limit is not None and self.total >= self.limit

    @property
    def blocks_done(self) -> int:
        n = self.total // self.seq_len
        return n if self.max_blocks is None else min(n, self.max_blocks)

    def add(self, tokens: torch.Tensor, lengths: torch.Tensor) -> None:
        """Append documents given as their concatenated tokens and their lengths."""
        self.pieces.append(tokens.to(torch.int32))
        self.lengths.append(lengths.to(torch.int64))
        self.total += int(tokens.numel())
        self.documents += int(lengths.numel())

    def take(self, docs: list[list[int]]) -> int:
        """Append documents until full; returns how many were taken."""
        taken = 0
        for ids in docs:
            if self.full:
                break
            self.add(torch.tensor(ids, dtype=torch.int32), torch.tensor([len(ids)]))
            taken += 1
        return taken

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(int64 (N, seq_len) blocks, index of the document each block starts in)."""
        n = self.blocks_done
        tokens = torch.cat(self.pieces) if self.pieces else torch.empty(0, dtype=torch.int32)
        blocks = tokens[: n * self.seq_len].view(n, self.seq_len).long()
        lengths = torch.cat(self.lengths) if self.lengths else torch.empty(0, dtype=torch.int64)
        doc_starts = torch.cumsum(lengths, 0) - lengths
        starts = torch.arange(n, dtype=torch.int64) * self.seq_len
        return blocks, torch.searchsorted(doc_starts, starts, right=True) - 1


# ------------------------------------------------------------------------------------------------------ map-style

def _map_chunk(part: Any, field: str, tokenizer: PreTrainedTokenizerBase, workers: int, desc: str) -> Any:
    import datasets

    procs = min(workers, len(part))
    ids = getattr(datasets, "List", datasets.Sequence)(datasets.Value("int32"))  # List: datasets >= 4
    return part.map(encode, batched=True, batch_size=min(TOKENIZE_BATCH, max(1, math.ceil(len(part) / procs))),
                    num_proc=procs if procs > 1 else None, remove_columns=part.column_names,
                    features=datasets.Features({"ids": ids}),
                    fn_kwargs={"tokenizer": tokenizer, "field": field, "eos": tokenizer.eos_token_id},
                    keep_in_memory=True, load_from_cache_file=False, new_fingerprint=f"flwr-sharded-{desc}",
                    desc=f"tokenizing {desc}")


def pack_dataset(split: Any, field: str, tokenizer: PreTrainedTokenizerBase, seq_len: int, max_blocks: int | None,
                 workers: int, desc: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of a map-style dataset, tokenized by `workers` processes.

    Documents are tokenized in chunks of at most `CHUNK_DOCUMENTS`; with `max_blocks`, the first chunk is small and
    the next ones are sized from the tokens per document so far, until the blocks are full.
    """
    import pyarrow.compute as pc

    packer = Packer(seq_len, max_blocks)
    n, start = len(split), 0
    chunk = min(n, CHUNK_DOCUMENTS if max_blocks is None else TOKENIZE_BATCH * workers)
    while start < n and not packer.full:
        end = min(n, start + chunk)
        part = split if (start, end) == (0, n) else split.select(range(start, end))
        label = desc if (start, end) == (0, n) else f"{desc} (documents {start:,}-{end:,} of {n:,})"
        mapped = _map_chunk(part, field, tokenizer, workers, label)
        if len(mapped):
            column = mapped.data.column("ids")
            flat = pc.list_flatten(column).to_numpy(zero_copy_only=False).copy()  # writable, for torch
            lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype("int64")
            packer.add(torch.from_numpy(flat), torch.from_numpy(lengths))
        start = end
        if packer.limit is not None and not packer.full:
            per_doc = max(packer.total, 1) / start
            chunk = max(TOKENIZE_BATCH * workers, math.ceil((packer.limit - packer.total) / per_doc * 1.1))
        chunk = min(chunk, CHUNK_DOCUMENTS)
    return packer.result()


# ------------------------------------------------------------------------------------------------------- streaming

@dataclass
class StreamBlocks:
    """Blocks packed from a stream."""

    train: torch.Tensor
    train_doc_ids: torch.Tensor
    validation: torch.Tensor
    validation_source: str
    """Where validation came from: the `validation` split, or the first N documents held out."""


def _batches(stream: Any, cfg: DataConfig, field: str):
    for batch in stream.iter(batch_size=TOKENIZE_BATCH):
        if field not in batch:
            raise column_error(cfg, field, list(batch))
        yield batch


def pack_stream(splits: Splits, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> StreamBlocks:
    """Blocks of a streamed dataset: `cfg.max_train_blocks` training and up to `cfg.eval_blocks` validation blocks.

    Without a validation split, the first documents are held out until `eval_blocks` blocks are full and training
    starts at the next document.
    """
    from tqdm.auto import tqdm

    if cfg.max_train_blocks is None:
        raise ConfigError("--streaming needs --max-train-blocks")
    eos, field = tokenizer.eos_token_id, splits.field
    train, held = Packer(cfg.seq_len, cfg.max_train_blocks), Packer(cfg.seq_len, cfg.eval_blocks)
    if splits.validation is not None and cfg.eval_blocks > 0:
        for batch in _batches(splits.validation, cfg, field):
            held.take(encode(batch, tokenizer=tokenizer, field=field, eos=eos)["ids"])
            if held.full:
                break
    hold_out = splits.validation is None and cfg.eval_blocks > 0
    bar = tqdm(total=cfg.max_train_blocks, desc="tokenizing train (stream)", unit="block", mininterval=2.0,
               leave=False)
    for batch in _batches(splits.train, cfg, field):
        docs = encode(batch, tokenizer=tokenizer, field=field, eos=eos)["ids"]
        if hold_out and not held.full:
            docs = docs[held.take(docs):]
        done = train.blocks_done
        train.take(docs)
        bar.update(train.blocks_done - done)
        if train.full:
            break
    bar.close()
    blocks, doc_ids = train.result()
    validation, _ = held.result()
    source = "the 'validation' split" if splits.validation is not None else \
        f"the first {held.documents} documents, held out" if hold_out else "none (eval-blocks 0)"
    return StreamBlocks(blocks, doc_ids, validation, source)
