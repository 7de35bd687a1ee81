"""Where a run's text and tokenizer come from: the dataset (the embedded corpus, a local file, a flat directory of
files, a copy of a hub repository, or a hub id), its checks and its splits opened with `datasets`; the tokenizer
(`tokenizer`, else a hub or local model's own, else for presets the one prepared in `data-dir`), and its vocabulary
against the model's embedding, checked without building the model."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr_sharded.config import DataConfig, TrainConfig, data_dir_of
from flwr_sharded.errors import ConfigError
from flwr_sharded.presets import PRESETS
from flwr_sharded.training.corpus import EMBEDDED, embedded_prepared

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".json.gz": "json", ".jsonl.gz": "json",
            ".parquet": "parquet"}
"""Local file suffix -> `datasets` builder. A .txt file is read as one document per paragraph (blank-line separated)."""
PARQUET_REVISION = "refs/convert/parquet"
"""The Hub's Parquet conversion of a dataset: one directory per configuration, `<config>/<split>/*.parquet`."""
_VALIDATION = re.compile(r"(^|[-._ ])validation([-._ 0-9]|$)")
"""A validation file's name: `validation` as a word, e.g. validation.jsonl or c4-it-validation.tfrecord-0.json.gz."""
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_SCRIPT_ERROR = "Dataset scripts are no longer supported"
"""The start of the RuntimeError `datasets` >= 4 raises for a dataset with a loading script."""


def suffix(path: Path) -> str:
    """The suffix that picks a builder: `.json.gz` and `.jsonl.gz` count as one."""
    double = "".join(path.suffixes[-2:])
    return double if double in BUILDERS else path.suffix


def check_source(name: str, option: str) -> None:
    """A dataset/tokenizer name must be an existing path, or else not path-like and shaped like a hub id."""
    if Path(name).expanduser().exists():
        return
    if name.startswith(("/", ".", "~")) or suffix(Path(name)) in BUILDERS or "\\" in name:
        raise ConfigError(f"{option}: local path {name} does not exist")
    if not _HUB_ID.match(name):
        raise ConfigError(f"{option}: {name!r} is neither an existing path nor a Hugging Face id (org/name or name)")


def script_error(dataset: str, script: str) -> ConfigError:
    """The error for a dataset that needs its loading script, and the ways out."""
    import datasets

    return ConfigError(
        f"--dataset {dataset}: a script-based dataset (its loading script is {script}); datasets >= 4 (installed: "
        f"{datasets.__version__}) no longer runs loading scripts. Use its Parquet conversion (--dataset-revision "
        f"{PARQUET_REVISION}, with --dataset-config naming the configuration; the .parquet files are also listed "
        f"under 'Auto-converted to Parquet' on the dataset's Hub page), or a local copy of its data files "
        f"(--dataset path/to/files: {', '.join(BUILDERS)})")


# ----------------------------------------------------------------------------------------------------- local layouts

@dataclass(frozen=True)
class LocalFiles:
    """A local file or flat directory: one `datasets` builder and its split -> files."""

    builder: str
    splits: dict[str, list[str]]


def local_layout(path: Path, dataset: str) -> LocalFiles | None:
    """How `datasets` reads a local dataset path: `LocalFiles`, or None for a repository copy (data files only below
    its top). In a flat directory, files named with the word `validation` are that split and `train*` files (else
    every other file) the training split; a dataset that needs its loading script is refused, as datasets >= 4 does."""
    if path.is_file():
        if path.suffix == ".py":
            raise script_error(dataset, path.name)
        if suffix(path) not in BUILDERS:
            raise ConfigError(f"--dataset: unsupported file type {suffix(path)!r} ({path}); use "
                              f"{', '.join(BUILDERS)}")
        files = [path]
    else:
        files = sorted(p for p in path.iterdir() if p.is_file() and suffix(p) in BUILDERS)
        if not files:
            scripts = sorted(p.name for p in path.glob("*.py"))
            if f"{path.name}.py" in scripts:  # what datasets looks for in a repository, and refuses
                raise script_error(dataset, f"{path.name}.py")
            if any(p.is_file() and suffix(p) in BUILDERS for p in path.rglob("*")):
                return None
            if scripts:
                raise script_error(dataset, scripts[0])
            raise ConfigError(f"--dataset: directory {path} holds no {'/'.join(BUILDERS)} files")
    builders = {BUILDERS[suffix(p)] for p in files}
    if len(builders) > 1:
        raise ConfigError(f"--dataset: directory {path} mixes file types ({', '.join(sorted(builders))}); use one")
    validation = [str(p) for p in files if _VALIDATION.search(p.name)]
    train = [str(p) for p in files if p.name.startswith("train")] or \
        [str(p) for p in files if str(p) not in validation]
    if not train:
        raise ConfigError(f"--dataset: directory {path} has validation files but no training file")
    return LocalFiles(builders.pop(), {"train": train, "validation": validation} if validation else {"train": train})


def dataset_path(cfg: DataConfig) -> Path | None:
    """The local directory or file of `cfg.dataset`, or None for a hub id."""
    if cfg.dataset == EMBEDDED:
        return data_dir_of(cfg) / EMBEDDED
    path = Path(cfg.dataset).expanduser()
    return path if path.exists() else None


def check_dataset(cfg: DataConfig) -> None:
    """The offline checks of the data directory and `cfg.dataset`."""
    data_dir = data_dir_of(cfg)
    prepare = f"run `flwr-sharded prepare-data --data-dir {data_dir}`"
    if not data_dir.is_dir():
        raise ConfigError(f"data directory {data_dir} (--data-dir) does not exist; {prepare}")
    if cfg.dataset == EMBEDDED:
        if not embedded_prepared(data_dir):
            raise ConfigError(f"--dataset {EMBEDDED}: the embedded corpus is not prepared in {data_dir}; {prepare}")
        return
    check_source(cfg.dataset, "--dataset")
    path = dataset_path(cfg)
    if path is not None:
        if cfg.dataset_revision:
            raise ConfigError(f"--dataset-revision {cfg.dataset_revision} applies to hub datasets, not to the local "
                              f"path {path}")
        local_layout(path, cfg.dataset)


# ----------------------------------------------------------------------------------------------------------- opening

@dataclass
class Splits:
    """The opened splits of a dataset (`datasets.Dataset`s, `IterableDataset`s when streaming; no validation: None)
    and the column holding the text."""

    train: Any
    validation: Any | None
    field: str


def load_arguments(cfg: DataConfig, path: Path | None) -> dict[str, Any]:
    """Keyword arguments of `datasets.load_dataset` for a hub id or a repository copy at `path`; `dataset-config` is
    the `data_dir` where each configuration is a directory (the Parquet conversion, a copy without a README)."""
    kwargs: dict[str, Any] = {"path": str(path) if path is not None else cfg.dataset}
    as_directory = cfg.dataset_revision == PARQUET_REVISION if path is None else \
        not (path / "README.md").is_file() and bool(cfg.dataset_config) and (path / cfg.dataset_config).is_dir()
    if cfg.dataset_config:
        kwargs["data_dir" if as_directory else "name"] = cfg.dataset_config
    if cfg.dataset_revision:
        kwargs["revision"] = cfg.dataset_revision
    return kwargs


def open_splits(cfg: DataConfig, streaming: bool = False) -> Splits:
    """The train and (if the dataset has one) validation split of `cfg.dataset`; ConfigError if they do not open."""
    import datasets

    path = dataset_path(cfg)
    layout = local_layout(path, cfg.dataset) if path is not None else None
    cache_dir = str(data_dir_of(cfg) / "cache" / "datasets")
    field = cfg.text_field
    try:
        if layout is not None:
            options = {"sample_by": "paragraph"} if layout.builder == "text" else {}
            splits = datasets.load_dataset(layout.builder, data_files=layout.splits, cache_dir=cache_dir,
                                           streaming=streaming, **options)
            field = "text" if layout.builder == "text" else field
        else:
            kwargs = load_arguments(cfg, path)
            if path is not None:
                kwargs["cache_dir"] = cache_dir
            splits = datasets.load_dataset(**kwargs, streaming=streaming)
    except RuntimeError as exc:
        if _SCRIPT_ERROR in str(exc):
            raise script_error(cfg.dataset, str(exc).rsplit(" ", 1)[-1]) from None
        raise
    except (OSError, ValueError) as exc:  # not found, offline, gated, no such configuration or revision, ...
        where = "local dataset" if path is not None else "hub dataset"
        raise ConfigError(f"--dataset: cannot load {where} {cfg.dataset!r}: {exc}") from exc
    if "train" not in splits:
        raise ConfigError(f"--dataset: {cfg.dataset} has no 'train' split (splits: {', '.join(splits)})")
    train, validation = splits["train"], splits.get("validation")
    for split in (train, validation):
        columns = getattr(split, "column_names", None)
        if split is not None and columns is not None and field not in columns:
            raise column_error(cfg, field, columns)
    return Splits(train, validation, field)


def column_error(cfg: DataConfig, field: str, columns: Any) -> ConfigError:
    return ConfigError(f"--text-field: column {field!r} not in {cfg.dataset} (columns: {', '.join(columns)})")


# --------------------------------------------------------------------------------------------------------- tokenizer

def _own_tokenizer(model: str | None) -> bool:
    """A hub id or local model directory (not a preset): it brings its own tokenizer."""
    return model is not None and model not in PRESETS


def tokenizer_name(data: DataConfig, model: str | None = None) -> str:
    """The tokenizer id or path: `data.tokenizer`, else `model` if it is no preset, else the one in `data-dir`."""
    if data.tokenizer:
        return data.tokenizer
    if _own_tokenizer(model):
        return model  # type: ignore[return-value]
    return str(data_dir_of(data) / "tokenizer")


def check_tokenizer(data: DataConfig, model: str | None = None) -> None:
    """The offline checks of the tokenizer a run will use (the model's own is checked with `--model`)."""
    if data.tokenizer is not None:
        check_source(data.tokenizer, "--tokenizer")
    elif not _own_tokenizer(model) and not (data_dir_of(data) / "tokenizer" / "tokenizer.json").is_file():
        raise ConfigError(f"no tokenizer in {data_dir_of(data) / 'tokenizer'}; run `flwr-sharded prepare-data "
                          f"--data-dir {data_dir_of(data)}` or set --tokenizer")


def load_tokenizer(data: DataConfig, model: str | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of `tokenizer_name(data, model)`; `model` is the run's `--model` (None: presets' rule)."""
    from transformers import AutoTokenizer

    check_tokenizer(data, model)
    name = tokenizer_name(data, model)
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as exc:
        reason = " ".join(str(exc).split())
        if data.tokenizer is None and _own_tokenizer(model):
            raise ConfigError(f"--model {model}: cannot load its tokenizer ({reason}); set --tokenizer") from exc
        raise ConfigError(f"--tokenizer: cannot load {name!r}: {reason}") from exc


def tokenizer_identity(tokenizer: PreTrainedTokenizerBase) -> str:
    """Hash of the tokenizer's full definition, so caches follow the tokenizer and not its path."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = f"{type(tokenizer).__name__}:{tokenizer.eos_token_id}:{len(tokenizer)}"
    return hashlib.sha256((extra + text).encode()).hexdigest()


def model_vocab_size(model: str) -> int | None:
    """Rows of the model's embedding: a preset's fixed `vocab_size`, or `vocab_size` in a hub/local model's config
    (config.json only: the model is not built); None for presets that take the tokenizer's size."""
    if model in PRESETS:
        return PRESETS[model].vocab_size
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError, KeyError) as exc:
        reason = " ".join(str(exc).split())
        raise ConfigError(f"--model: cannot read the configuration (config.json) of {model!r}: {reason}") from exc
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text, "vocab_size", None)
    if not isinstance(size, int):
        raise ConfigError(f"--model {model}: its configuration ({type(config).__name__}) gives no vocab_size")
    return size


def tokenizer_rows(tokenizer: PreTrainedTokenizerBase) -> tuple[int, int]:
    """(len(tokenizer), largest token id + 1): the embedding needs max of the two rows."""
    largest = max(tokenizer.get_vocab().values(), default=-1)
    return len(tokenizer), largest + 1


def check_eos(tokenizer: PreTrainedTokenizerBase) -> None:
    """ConfigError if the tokenizer has no eos token (the corpus puts one after each document)."""
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"--tokenizer: {tokenizer.name_or_path!r} has no eos token, needed between documents")


def check_vocab(cfg: TrainConfig, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
    """ConfigError naming `--tokenizer` and `--model` if the tokenizer the run uses (`tokenizer_name`: a hub or local
    model's own unless `--tokenizer` is set) has no eos token or more tokens than the model's embedding."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.data, cfg.model.name)
    check_eos(tokenizer)
    size = model_vocab_size(cfg.model.name)
    if size is None:
        return  # the preset's embedding is sized from the tokenizer
    length, needed = tokenizer_rows(tokenizer)
    if max(length, needed) > size:
        own = _own_tokenizer(cfg.model.name)
        source = "the model's own" if cfg.data.tokenizer is None and own else tokenizer_name(cfg.data, cfg.model.name)
        where = "in its config.json" if own else "fixed by the preset"
        raise ConfigError(f"--tokenizer ({source}) has {length} tokens (largest id {needed - 1}) but --model "
                          f"{cfg.model.name} embeds only {size} (vocab_size {where}); use a tokenizer of at most "
                          f"{size} tokens or a model whose vocab_size is at least {max(length, needed)}")
