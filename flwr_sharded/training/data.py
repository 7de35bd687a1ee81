"""Training data: checks, the tokenizer, and token-block packing and caching.

`load_blocks` turns a dataset (the embedded corpus of `flwr_sharded.training.corpus`, local files or a Hugging Face
hub id) into fixed-length token blocks, cached per (dataset, tokenizer, seq_len, text_field, max_train_blocks).
Which blocks each rank sees: `flwr_sharded.training.partition`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from filelock import FileLock

from flwr_sharded.config import DataConfig, data_dir_of

from flwr_sharded.errors import ConfigError
from flwr_sharded.training.corpus import EMBEDDED, embedded_prepared, atomic_write

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
"""Local file suffix -> `datasets` builder. A .txt file is read as one document per paragraph (blank-line separated)."""
HOLDOUT_FRACTION = 0.01
"""Share of documents (the last ones) held out for validation when a dataset has no validation split."""
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_TOKENIZE_BATCH = 1000


# -------------------------------------------------------------------------------------------------- checks, tokenizer

def _looks_local(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or Path(name).suffix in BUILDERS or "\\" in name


def _check_source(name: str, option: str) -> None:
    """A dataset/tokenizer name must be an existing path, or else not path-like and shaped like a hub id."""
    if Path(name).expanduser().exists():
        return
    if _looks_local(name):
        raise ConfigError(f"{option}: local path {name} does not exist")
    if not _HUB_ID.match(name):
        raise ConfigError(f"{option}: {name!r} is neither an existing path nor a Hugging Face id (org/name or name)")


def check_data(cfg: DataConfig) -> None:
    """Fail fast with a ConfigError if the data directory, dataset or tokenizer named by `cfg` cannot be used."""
    data_dir = data_dir_of(cfg)
    prepare = f"run `flwr-sharded prepare-data --data-dir {data_dir}`"
    if not data_dir.is_dir():
        raise ConfigError(f"data directory {data_dir} does not exist; {prepare}")
    if cfg.dataset == EMBEDDED:
        if not embedded_prepared(data_dir):
            raise ConfigError(f"--dataset {EMBEDDED}: the embedded corpus is not prepared in {data_dir}; {prepare}")
    else:
        _check_source(cfg.dataset, "--dataset")
        path = Path(cfg.dataset).expanduser()
        if path.exists():
            _local_files(path)
    _check_tokenizer(cfg)


def _check_tokenizer(cfg: DataConfig) -> None:
    if cfg.tokenizer is not None:
        _check_source(cfg.tokenizer, "--tokenizer")
    elif not (data_dir_of(cfg) / "tokenizer" / "tokenizer.json").is_file():
        raise ConfigError(f"no tokenizer in {data_dir_of(cfg) / 'tokenizer'}; run `flwr-sharded prepare-data "
                          f"--data-dir {data_dir_of(cfg)}` or set --tokenizer")


def load_tokenizer(cfg: DataConfig) -> PreTrainedTokenizerBase:
    """`cfg.tokenizer` (hub id or path), else the tokenizer prepared in `cfg.data_dir`."""
    from transformers import AutoTokenizer

    _check_tokenizer(cfg)
    name = cfg.tokenizer or str(data_dir_of(cfg) / "tokenizer")
    try:
        return AutoTokenizer.from_pretrained(name)
    except OSError as exc:
        raise ConfigError(f"--tokenizer: cannot load {name!r}: {exc}") from exc


def _tokenizer_identity(tokenizer: PreTrainedTokenizerBase) -> str:
    """Hash of the tokenizer's full definition, so caches follow the tokenizer and not its path."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = f"{type(tokenizer).__name__}:{tokenizer.eos_token_id}:{len(tokenizer)}"
    return hashlib.sha256((extra + text).encode()).hexdigest()


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
    """len(tokenizer), the model's vocabulary size."""


def _local_files(path: Path) -> tuple[str, dict[str, list[str]]]:
    """The `datasets` builder and split -> files of a local file or directory.

    In a directory, files whose names start with `train` / `validation` form those splits; with no `train*` file,
    every supported file is training data.
    """
    if path.is_file():
        files = [path]
        if path.suffix not in BUILDERS:
            raise ConfigError(f"--dataset: unsupported file type {path.suffix!r} ({path}); use {', '.join(BUILDERS)}")
    else:
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in BUILDERS)
        if not files:
            raise ConfigError(f"--dataset: directory {path} holds no {'/'.join(BUILDERS)} files")
    builders = {BUILDERS[p.suffix] for p in files}
    if len(builders) > 1:
        raise ConfigError(f"--dataset: directory {path} mixes file types ({', '.join(sorted(builders))}); use one")
    train = [str(p) for p in files if p.name.startswith("train")]
    validation = [str(p) for p in files if p.name.startswith("validation")]
    if validation and not train:
        raise ConfigError(f"--dataset: directory {path} has validation* files but no train* file")
    splits = {"train": train, "validation": validation} if train and validation else \
        {"train": train or [str(p) for p in files]}
    return builders.pop(), splits


def _dataset_path(cfg: DataConfig) -> Path | None:
    """The local directory or file of `cfg.dataset`, or None for a hub id."""
    if cfg.dataset == EMBEDDED:
        return data_dir_of(cfg) / EMBEDDED
    path = Path(cfg.dataset).expanduser()
    return path if path.exists() else None


def _load_splits(cfg: DataConfig) -> tuple[Any, Any, str]:
    """(train, validation, text column) as `datasets.Dataset`s; without a validation split, the last 1% of
    documents are held out."""
    import datasets

    path = _dataset_path(cfg)
    if path is not None:
        builder, data_files = _local_files(path)
        options = {"sample_by": "paragraph"} if builder == "text" else {}
        cache_dir = str(data_dir_of(cfg) / "cache" / "datasets")
        splits = datasets.load_dataset(builder, data_files=data_files, cache_dir=cache_dir, **options)
        field = "text" if builder == "text" else cfg.text_field
    else:
        try:
            splits = datasets.load_dataset(cfg.dataset, cfg.dataset_config)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--dataset: cannot load hub dataset {cfg.dataset!r}: {exc}") from exc
        if "train" not in splits:
            raise ConfigError(f"--dataset: {cfg.dataset} has no 'train' split (splits: {', '.join(splits)})")
        field = cfg.text_field
    train, validation = splits["train"], splits.get("validation")
    for split in (train, validation):
        if split is not None and field not in split.column_names:
            raise ConfigError(f"--text-field: column {field!r} not in {cfg.dataset} "
                              f"(columns: {', '.join(split.column_names)})")
    if validation is None:
        n = len(train)
        n_val = math.ceil(n * HOLDOUT_FRACTION)
        if n - n_val < 1:
            raise ConfigError(f"--dataset: {cfg.dataset} has no validation split and too few documents ({n}) "
                              f"to hold {HOLDOUT_FRACTION:.0%} out")
        train, validation = train.select(range(n - n_val)), train.select(range(n - n_val, n))
    return train, validation, field


def _pack(split: Any, field: str, tokenizer: PreTrainedTokenizerBase, seq_len: int,
          max_blocks: int | None, desc: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize documents (eos after each), concatenate and cut into (N, seq_len) blocks, dropping the tail.

    Stops reading once `max_blocks` blocks are full. Returns (blocks, index of the document each block starts in).
    """
    from tqdm.auto import tqdm

    eos = tokenizer.eos_token_id
    limit = None if max_blocks is None else max_blocks * seq_len
    pieces, doc_starts, total = [], [], 0
    bar = tqdm(total=len(split), desc=f"tokenizing {desc}", unit="doc", mininterval=2.0, leave=False)
    for batch in split.iter(batch_size=_TOKENIZE_BATCH):
        bar.update(len(batch[field]))
        texts = [t for t in batch[field] if t]
        if not texts:
            continue
        for ids in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]:
            doc_starts.append(total)
            pieces.append(torch.tensor(ids + [eos], dtype=torch.int64))
            total += len(ids) + 1
        if limit is not None and total >= limit:
            break
    bar.close()
    n = total // seq_len if max_blocks is None else min(total // seq_len, max_blocks)
    tokens = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64)
    blocks = tokens[: n * seq_len].view(n, seq_len).clone()
    starts = torch.arange(n, dtype=torch.int64) * seq_len
    doc_ids = torch.searchsorted(torch.tensor(doc_starts, dtype=torch.int64), starts, right=True) - 1
    return blocks, doc_ids


def _cache_key(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> str:
    path = _dataset_path(cfg)
    if path is None:
        source: Any = [cfg.dataset, cfg.dataset_config]
    else:
        files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
        source = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    identity = {"dataset": source, "tokenizer": _tokenizer_identity(tokenizer), "seq_len": cfg.seq_len,
                "text_field": cfg.text_field, "max_train_blocks": cfg.max_train_blocks}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]


def load_blocks(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> TokenBlocks:
    """Token blocks of `cfg.dataset`, from `data_dir/cache/<key>.pt` when present, else built and cached.

    `max_train_blocks` keeps the first N training blocks and also bounds the validation blocks tokenized.
    """
    check_data(cfg)
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
    train_split, val_split, field = _load_splits(cfg)
    train, doc_ids = _pack(train_split, field, tokenizer, cfg.seq_len, cfg.max_train_blocks, "train")
    validation, _ = _pack(val_split, field, tokenizer, cfg.seq_len, cfg.max_train_blocks, "validation")
    if len(train) == 0:
        raise ConfigError(f"--dataset: {cfg.dataset} gives no training block of {cfg.seq_len} tokens")
    # int32 on disk halves the file; every supported vocabulary fits.
    saved = {"train": train.int(), "validation": validation.int(), "train_doc_ids": doc_ids,
             "vocab_size": len(tokenizer), "dataset": cfg.dataset, "tokenizer": tokenizer.name_or_path,
             "seq_len": cfg.seq_len}
    atomic_write(path, lambda tmp: torch.save(saved, tmp))
    logger.info("tokenized %s: %d train / %d validation blocks of %d tokens in %.1f s -> %s", cfg.dataset,
                len(train), len(validation), cfg.seq_len, time.perf_counter() - start, path)
