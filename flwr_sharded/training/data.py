"""Training data: checks, and token blocks built once per data directory and cached.

`load_blocks` turns a dataset (the embedded corpus of `flwr_sharded.training.corpus`, local files or a Hugging Face
hub id; `flwr_sharded.training.sources`) into fixed-length token blocks (`flwr_sharded.training.packing`), cached
per (dataset, tokenizer, seq_len, text_field, max_train_blocks, ...). The tokenizer: `flwr_sharded.training.vocab`.
Which blocks each rank sees: `flwr_sharded.training.partition`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from filelock import FileLock

from flwr_sharded.config import DataConfig, data_dir_of
from flwr_sharded.errors import ConfigError
from flwr_sharded.training.corpus import EMBEDDED, embedded_prepared, atomic_write
from flwr_sharded.training.packing import default_workers, pack_dataset, pack_stream
from flwr_sharded.training.sources import BUILDERS, Splits, check_dataset, dataset_path, local_layout, open_splits
from flwr_sharded.training.vocab import check_tokenizer, load_tokenizer, tokenizer_identity, tokenizer_rows

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["BUILDERS", "HOLDOUT_FRACTION", "TokenBlocks", "check_data", "load_blocks", "load_tokenizer"]

logger = logging.getLogger(__name__)

HOLDOUT_FRACTION = 0.01
"""Share of documents (the last ones) held out for validation when a map-style dataset has no validation split."""


# ------------------------------------------------------------------------------------------------------------ checks

def check_data(cfg: DataConfig, model: str | None = None) -> None:
    """Fail fast with a ConfigError if the data directory, dataset or tokenizer named by `cfg` cannot be used.

    `model`: the run's `--model`; a hub id or model directory brings the tokenizer when `cfg.tokenizer` is unset.
    """
    _check_dataset(cfg)
    check_tokenizer(cfg, model)


def _check_dataset(cfg: DataConfig) -> None:
    data_dir = data_dir_of(cfg)
    prepare = f"run `flwr-sharded prepare-data --data-dir {data_dir}`"
    if not data_dir.is_dir():
        raise ConfigError(f"data directory {data_dir} (--data-dir) does not exist; {prepare}")
    if cfg.dataset == EMBEDDED:
        if not embedded_prepared(data_dir):
            raise ConfigError(f"--dataset {EMBEDDED}: the embedded corpus is not prepared in {data_dir}; {prepare}")
    else:
        check_dataset(cfg)


# ------------------------------------------------------------------------------------------------ loading and packing

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
    """Token blocks of `cfg.dataset`, from `data_dir/cache/<key>.pt` when present, else built and cached.

    `max_train_blocks` keeps the first N training blocks and also bounds the validation blocks tokenized (with
    `streaming`, `eval_blocks` does). The cache is built under a file lock: one rank per data directory tokenizes,
    the others wait and read its file.
    """
    _check_dataset(cfg)
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"--tokenizer: {tokenizer.name_or_path!r} has no eos token, needed between documents")
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
        stream = pack_stream(splits, cfg, tokenizer)
        train, doc_ids, validation, source = stream.train, stream.train_doc_ids, stream.validation, \
            stream.validation_source
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
