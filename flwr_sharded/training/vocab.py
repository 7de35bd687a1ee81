"""Which tokenizer a run uses (`tokenizer`, else a hub or local model's own, else for presets the one prepared in
`data-dir`), and whether its vocabulary fits the model's embedding, checked without building the model."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

from flwr_sharded.config import DataConfig, TrainConfig, data_dir_of
from flwr_sharded.errors import ConfigError
from flwr_sharded.presets import PRESETS
from flwr_sharded.training.sources import check_source

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


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


# --------------------------------------------------------------------------------------------------- vocabulary

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


def check_vocab(cfg: TrainConfig, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
    """ConfigError naming `--tokenizer` and `--model` if the tokenizer has more tokens than the model's embedding."""
    size = model_vocab_size(cfg.model.name)
    if size is None:
        return  # the preset's embedding is sized from the tokenizer
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.data, cfg.model.name)
    length, needed = tokenizer_rows(tokenizer)
    if max(length, needed) > size:
        own = _own_tokenizer(cfg.model.name)
        source = "the model's own" if cfg.data.tokenizer is None and own else tokenizer_name(cfg.data, cfg.model.name)
        where = "in its config.json" if own else "fixed by the preset"
        raise ConfigError(f"--tokenizer ({source}) has {length} tokens (largest id {needed - 1}) but --model "
                          f"{cfg.model.name} embeds only {size} (vocab_size {where}); use a tokenizer of at most "
                          f"{size} tokens or a model whose vocab_size is at least {max(length, needed)}")
