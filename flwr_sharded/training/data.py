"""Training data as token blocks: each document's tokens then an eos, concatenated and cut into (N, seq_len) blocks
(the tail dropped), built once per data directory and cached; by several processes (`Dataset.map`) for a map-style
dataset, in this process for a stream, the same blocks for the same documents. Where documents and the tokenizer come
from: `flwr_sharded.training.sources`; who sees which blocks: `flwr_sharded.training.partition`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from filelock import FileLock

from flwr_sharded.config import DataConfig, data_dir_of
from flwr_sharded.errors import ConfigError
from flwr_sharded.training.corpus import atomic_write
from flwr_sharded.training.sources import (Splits, check_dataset, check_eos, check_tokenizer, column_error,
                                          dataset_path, load_tokenizer, local_layout, open_splits, tokenizer_identity,
                                          tokenizer_rows)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["HOLDOUT_FRACTION", "TokenBlocks", "check_data", "load_blocks", "load_tokenizer", "pack_dataset"]

logger = logging.getLogger(__name__)

HOLDOUT_FRACTION = 0.01
"""Share of documents (the last ones) held out for validation when a map-style dataset has no validation split."""
TOKENIZE_BATCH = 1000
"""Documents per tokenizer call."""
CHUNK_DOCUMENTS = 200_000
"""Most documents one `Dataset.map` tokenizes: bounds the memory its output takes before it is packed."""


def default_workers() -> int:
    """min(8, the CPUs this process may run on)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, cpus))


def tokenize_documents(batch: dict[str, list[Any]], *, tokenizer: PreTrainedTokenizerBase, field: str,
                       eos: int) -> dict[str, list[list[int]]]:
    """Token ids of a batch's non-empty documents, an eos after each (a `Dataset.map` function)."""
    texts = [t for t in batch[field] if t]
    ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"] if texts else []
    return {"ids": [x + [eos] for x in ids]}


class Packer:
    """Concatenates documents' tokens and cuts them into blocks; `full` once `max_blocks` blocks are."""

    def __init__(self, seq_len: int, max_blocks: int | None) -> None:
        self.seq_len, self.max_blocks = seq_len, max_blocks
        self.limit = None if max_blocks is None else max_blocks * seq_len
        self.pieces: list[torch.Tensor] = []
        self.lengths: list[torch.Tensor] = []
        self.total = self.documents = 0

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


def _map_chunk(part: Any, field: str, tokenizer: PreTrainedTokenizerBase, workers: int, desc: str) -> Any:
    import datasets

    procs = max(1, min(workers, math.ceil(len(part) / TOKENIZE_BATCH)))  # a worker per full batch, at most
    ids = getattr(datasets, "List", datasets.Sequence)(datasets.Value("int32"))  # List: datasets >= 4
    return part.map(tokenize_documents, batched=True,
                    batch_size=min(TOKENIZE_BATCH, max(1, math.ceil(len(part) / procs))),
                    num_proc=procs if procs > 1 else None, remove_columns=part.column_names,
                    features=datasets.Features({"ids": ids}),
                    fn_kwargs={"tokenizer": tokenizer, "field": field, "eos": tokenizer.eos_token_id},
                    keep_in_memory=True, load_from_cache_file=False, new_fingerprint=f"flwr-sharded-{desc}",
                    desc=f"tokenizing {desc}")


def pack_dataset(split: Any, field: str, tokenizer: PreTrainedTokenizerBase, seq_len: int, max_blocks: int | None,
                 workers: int, desc: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of a map-style dataset, tokenized by `workers` processes in chunks of at most `CHUNK_DOCUMENTS`
    documents (with `max_blocks`: a small first chunk, then sized from the tokens per document so far)."""
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


def _batches(stream: Any, cfg: DataConfig, field: str):
    for batch in stream.iter(batch_size=TOKENIZE_BATCH):
        if field not in batch:
            raise column_error(cfg, field, list(batch))
        yield batch


def pack_stream(splits: Splits, cfg: DataConfig,
                tokenizer: PreTrainedTokenizerBase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """(train blocks, their documents, validation blocks, where these came from) of a streamed dataset:
    `cfg.max_train_blocks` training and up to `cfg.eval_blocks` validation blocks (without a validation split, from
    the first documents, training starting at the next one)."""
    from tqdm.auto import tqdm

    if cfg.max_train_blocks is None:
        raise ConfigError("--streaming needs --max-train-blocks")
    eos, field = tokenizer.eos_token_id, splits.field
    train, held = Packer(cfg.seq_len, cfg.max_train_blocks), Packer(cfg.seq_len, cfg.eval_blocks)
    if splits.validation is not None and cfg.eval_blocks > 0:
        for batch in _batches(splits.validation, cfg, field):
            held.take(tokenize_documents(batch, tokenizer=tokenizer, field=field, eos=eos)["ids"])
            if held.full:
                break
    hold_out = splits.validation is None and cfg.eval_blocks > 0
    bar = tqdm(total=cfg.max_train_blocks, desc="tokenizing train (stream)", unit="block", mininterval=2.0,
               leave=False)
    for batch in _batches(splits.train, cfg, field):
        docs = tokenize_documents(batch, tokenizer=tokenizer, field=field, eos=eos)["ids"]
        if hold_out and not held.full:
            docs = docs[held.take(docs):]
        done = train.blocks_done
        train.take(docs)
        bar.update(train.blocks_done - done)
        if train.full:
            break
    bar.close()
    source = "the 'validation' split" if splits.validation is not None else \
        f"the first {held.documents} documents, held out" if hold_out else "none (eval-blocks 0)"
    return (*train.result(), held.result()[0], source)


# ------------------------------------------------------------------------------------------------------------ checks

def check_data(cfg: DataConfig, model: str | None = None) -> None:
    """ConfigError if the data directory, dataset or tokenizer of `cfg` cannot be used (`model`, the run's `--model`,
    brings the tokenizer when `cfg.tokenizer` is unset and it is a hub id or directory)."""
    check_dataset(cfg)
    check_tokenizer(cfg, model)


# ------------------------------------------------------------------------------------------------------ caching

@dataclass
class TokenBlocks:
    """Packed token blocks of one dataset and tokenizer."""

    train: torch.Tensor
    """int64 (N_train, seq_len)."""
    validation: torch.Tensor
    """int64 (N_val, seq_len)."""
    train_doc_ids: torch.Tensor
    """int64 (N_train,): index of the document each train block starts in (non-decreasing)."""
    vocab_size: int
    """Rows the embedding needs: len(tokenizer), or the largest token id + 1 if larger (a preset's vocabulary)."""


def _holdout(cfg: DataConfig, splits: Splits) -> tuple[Any, Any]:
    """(train, validation) of a map-style dataset; without a validation split the last 1% of documents."""
    train, validation = splits.train, splits.validation
    if validation is not None:
        return train, validation
    n = len(train)
    n_val = math.ceil(n * HOLDOUT_FRACTION)
    if n - n_val < 1:
        raise ConfigError(f"--dataset: {cfg.dataset} has no validation split and too few documents ({n}) "
                          f"to hold {HOLDOUT_FRACTION:.0%} out")
    return train.select(range(n - n_val)), train.select(range(n - n_val, n))


def _cache_key(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> str:
    path = dataset_path(cfg)
    if path is None:
        source: Any = [cfg.dataset, cfg.dataset_config]
    else:
        flat = path.is_file() or local_layout(path, cfg.dataset) is not None
        files = [path] if path.is_file() else sorted(
            p for p in (path.iterdir() if flat else path.rglob("*"))
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))  # not .cache/
        source = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
        if not flat:
            source.append(cfg.dataset_config)
    identity = {"dataset": source, "tokenizer": tokenizer_identity(tokenizer), "seq_len": cfg.seq_len,
                "text_field": cfg.text_field, "max_train_blocks": cfg.max_train_blocks}
    if cfg.dataset_revision:  # options added later enter the key only when set, so older caches stay valid
        identity["revision"] = cfg.dataset_revision
    if cfg.streaming:  # a stream holds out other documents and packs only eval_blocks validation blocks
        identity["streaming"] = {"eval_blocks": cfg.eval_blocks}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]


def load_blocks(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> TokenBlocks:
    """Token blocks of `cfg.dataset` from `data_dir/cache/<key>.pt`, built there first under a file lock (one rank
    per data directory tokenizes, the others wait); `max_train_blocks` bounds the training blocks and the validation
    blocks tokenized (with `streaming`, `eval_blocks` bounds these)."""
    check_dataset(cfg)
    check_eos(tokenizer)
    cache_dir = data_dir_of(cfg) / "cache"
    cache_dir.mkdir(exist_ok=True)
    path = cache_dir / f"{_cache_key(cfg, tokenizer)}.pt"
    if not path.is_file():
        with FileLock(str(path.with_suffix(".lock"))):
            if not path.is_file():
                _build_cache(cfg, tokenizer, path)
    saved = torch.load(path, weights_only=True)
    blocks = TokenBlocks(train=saved["train"].long(), validation=saved["validation"].long(),
                         train_doc_ids=saved["train_doc_ids"], vocab_size=saved["vocab_size"])
    if len(blocks.validation) == 0 and cfg.eval_blocks > 0:
        raise ConfigError(f"--dataset: {cfg.dataset} gives no validation block of {cfg.seq_len} tokens; "
                          f"lower --seq-len or set --eval-blocks 0")
    return blocks


def _build_cache(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, path: Path) -> None:
    start = time.perf_counter()
    splits = open_splits(cfg, streaming=cfg.streaming)
    if cfg.streaming:
        train, doc_ids, validation, source = pack_stream(splits, cfg, tokenizer)
    else:
        workers = cfg.tokenize_workers or default_workers()
        train_split, val_split = _holdout(cfg, splits)
        train, doc_ids = pack_dataset(train_split, splits.field, tokenizer, cfg.seq_len, cfg.max_train_blocks,
                                      workers, "train")
        validation, _ = pack_dataset(val_split, splits.field, tokenizer, cfg.seq_len, cfg.max_train_blocks, workers,
                                     "validation")
        source = "the 'validation' split" if splits.validation is not None else \
            f"the last {len(val_split)} documents, held out"
    if len(train) == 0:
        raise ConfigError(f"--dataset: {cfg.dataset} gives no training block of {cfg.seq_len} tokens")
    # int32 on disk halves the file; every supported vocabulary fits.
    saved = {"train": train.int(), "validation": validation.int(), "train_doc_ids": doc_ids,
             "vocab_size": max(tokenizer_rows(tokenizer)), "dataset": cfg.dataset, "tokenizer": tokenizer.name_or_path,
             "seq_len": cfg.seq_len, "validation_source": source}
    atomic_write(path, lambda tmp: torch.save(saved, tmp))
    logger.info("tokenized %s%s: %d train / %d validation blocks of %d tokens (validation: %s) in %.1f s -> %s",
                cfg.dataset, " (streamed)" if cfg.streaming else "", len(train), len(validation), cfg.seq_len,
                source, time.perf_counter() - start, path)
