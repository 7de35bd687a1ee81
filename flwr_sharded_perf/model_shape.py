"""The model's shape as the cost model sees it (from a preset, a config.json or counts), and one GPU's compute time."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr_sharded.errors import ConfigError
from flwr_sharded_perf.costmodel import Units, positive_int
from flwr_sharded.presets import PRESETS, Preset, UnpricedShape, parameter_counts


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs to know about a decoder-only (Llama-like, dense or mixture-of-experts) transformer."""

    num_params: int
    num_layers: int
    """Transformer blocks: one FSDP2 unit each."""
    root_params: int
    """Parameters outside the blocks (embeddings, head, final norm): the root unit."""
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    name: str = "custom"
    kv_size: int | None = None
    """Width of the k and v projections (key/value heads x head size; activations); None: `hidden_size` (MHA)."""
    active_params: int | None = None
    """Parameters one token computes with (a mixture of experts: the routed ones only); None: `num_params`."""
    largest_tensor: int | None = None
    """Elements of the largest parameter tensor; None: the embedding or an MLP matrix of the dense shape."""

    def __post_init__(self) -> None:
        for name in ("num_params", "num_layers", "hidden_size", "intermediate_size", "vocab_size"):
            positive_int(name, getattr(self, name))
        if not 0 <= self.root_params < self.num_params:
            raise ConfigError(f"root_params must be in [0, num_params), got {self.root_params}")
        for name in ("kv_size", "largest_tensor"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        if self.active_params is not None and not 0 < self.active_params <= self.num_params:
            raise ConfigError(f"active_params must be in (0, num_params], got {self.active_params}")

    @property
    def compute_params(self) -> int:
        """The parameters a token's forward and backward compute with (`active_params`, else all)."""
        return self.active_params or self.num_params

    @classmethod
    def from_counts(cls, num_params: int, num_layers: int, *, hidden_size: int | None = None,
                    vocab_size: int = 32000, name: str = "custom") -> ModelShape:
        """A model known only by its size: all parameters in the blocks; h from 12 h^2 params per block if not given."""
        positive_int("num_params", num_params)
        positive_int("num_layers", num_layers)
        h = hidden_size or max(1, round(math.sqrt(num_params / (12 * num_layers))))
        return cls(num_params=num_params, num_layers=num_layers, root_params=0, hidden_size=h,
                   intermediate_size=4 * h, vocab_size=vocab_size, name=name)

    def largest_param(self) -> int:
        """Elements of the largest parameter tensor: `largest_tensor`, else the embedding (vocab x h) or an MLP matrix
        (h x i)."""
        if self.largest_tensor is not None:
            return self.largest_tensor
        return max(self.vocab_size * self.hidden_size if self.root_params else 0,
                   self.hidden_size * self.intermediate_size)

    def units(self, bytes_per_param: float) -> Units:
        """FSDP2 units in bytes: equal blocks and the root."""
        block = (self.num_params - self.root_params) / self.num_layers
        return Units(blocks=(block * bytes_per_param,) * self.num_layers, root=self.root_params * bytes_per_param)


def compute_time(num_params: float, tokens: float, flops_per_gpu: float, *,
                 flops_per_param_token: float = 6.0) -> float:
    """Seconds of compute for one GPU's batch: flops_per_param_token (6; 8 checkpointed) x params x tokens / FLOP/s."""
    if not flops_per_gpu > 0:
        raise ConfigError(f"flops_per_gpu must be positive, got {flops_per_gpu!r}")
    return flops_per_param_token * num_params * tokens / flops_per_gpu


def model_from_preset(name: str, vocab_size: int = 32000) -> ModelShape:
    """Shape of a preset of `flwr_sharded.presets.PRESETS` (its own vocabulary, else `vocab_size`)."""
    if name not in PRESETS:
        raise ConfigError(f"--model: unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return shape_of(PRESETS[name], vocab_size, name=name)


def model_from_name(name: str, vocab_size: int = 32000) -> ModelShape:
    """Shape of any model `train --model` takes: a preset, or a Hugging Face directory or hub id (its config.json)."""
    if name in PRESETS:
        return model_from_preset(name, vocab_size)
    return shape_from_config(read_model_config(name), name)


def read_model_config(name: str) -> dict[str, Any]:
    """The config.json of a local model directory, or of a hub id (fetched alone, or read from the cache)."""
    path = Path(name).expanduser()
    if path.is_dir():
        file = path / "config.json"
        if not file.is_file():
            raise ConfigError(f"--model: {path} has no config.json")
    elif len(name.split("/")) == 2 and all(name.split("/")):
        from huggingface_hub import hf_hub_download

        try:
            file = Path(hf_hub_download(name, "config.json"))
        except Exception as exc:  # network, authentication, a missing repository or an empty offline cache
            raise ConfigError(f"--model: cannot read the config.json of {name!r}: {' '.join(str(exc).split())}"
                              ) from exc
    else:
        raise ConfigError(f"--model: unknown model {name!r}; use a preset ({', '.join(PRESETS)}), a Hugging Face id "
                          f"(org/name) or a local model directory")
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model: cannot read {file}: {exc}") from exc


def shape_from_config(config: dict[str, Any], name: str = "custom") -> ModelShape:
    """The shape a `transformers` config.json describes (a multimodal one: its `text_config`), read through
    `presets.parameter_counts`: head_dim, experts (total and active), untied heads."""
    c = config if "hidden_size" in config else config.get("text_config") or config
    try:
        counts = parameter_counts(config)
        return ModelShape(num_params=counts.total, num_layers=int(c["num_hidden_layers"]), root_params=counts.root,
                          hidden_size=int(c["hidden_size"]), intermediate_size=counts.intermediate,
                          vocab_size=int(c["vocab_size"]), name=name, kv_size=counts.kv_size,
                          active_params=counts.active, largest_tensor=counts.largest)
    except UnpricedShape as exc:
        raise ConfigError(f"--model {name}: the planner cannot price {exc}; give --params and --layers") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"--model {name}: its config.json does not describe a Llama-like decoder ({exc!r}); the "
                          f"planner needs hidden_size, num_hidden_layers, num_attention_heads, intermediate_size and "
                          f"vocab_size (or give --params and --layers)") from None


def shape_of(p: Preset, vocab_size: int = 32000, *, name: str = "custom") -> ModelShape:
    """Shape of a `Preset` (its own vocabulary, else `vocab_size`)."""
    return shape_from_config({**p.config(vocab_size), "model_type": p.model_type}, name)
