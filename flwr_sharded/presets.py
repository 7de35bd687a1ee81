"""The model presets (shapes by name, Llama and other families) and what a decoder's config implies about its
parameters: the one declaration that training builds (`training.models`) and the planner prices
(`perf.model_shape`); torch-free."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

QK_NORM_FAMILIES = frozenset({"qwen3", "qwen3_moe", "gemma3_text"})
"""Families whose attention normalises queries and keys per head (two head_dim weights per block)."""

FUSED_PROJECTIONS = frozenset({"phi3"})
"""Families whose q/k/v projections are one tensor, and gate/up projections another (the largest tensor)."""

NORMS_PER_BLOCK = {"gemma2": 4, "gemma3_text": 4}
"""Norm weights (of hidden_size) per block where not the Llama-like two."""

_UNPRICED_KEYS = ("q_lora_rank", "kv_lora_rank", "n_shared_experts", "shared_expert_intermediate_size",
                  "num_shared_experts", "linear_num_key_heads")
"""Config keys of shapes the count below does not describe (latent attention, shared experts, linear attention)."""


class UnpricedShape(ValueError):
    """A config whose shape `parameter_counts` does not describe (latent attention, shared experts, ...)."""


@dataclass(frozen=True)
class Preset:
    """A decoder's shape: `model_type` names its `transformers` family (a Llama by default) and `extra` holds the
    family's own config keys (head_dim, experts) as that family's config names them. The vocabulary comes from the
    tokenizer unless the preset fixes it."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    tie_word_embeddings: bool = True
    vocab_size: int | None = None
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    model_type: str = "llama"
    extra: Mapping[str, Any] = field(default_factory=dict)

    def config(self, vocab_size: int | None = None, max_seq_len: int = 0) -> dict[str, Any]:
        """The keyword arguments of the family's `transformers` config (`model_type` apart)."""
        vocab = self.vocab_size or vocab_size
        if vocab is None:
            raise ValueError("vocab_size is needed: the preset fixes none")
        plain = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                 if f.name not in ("model_type", "extra")}
        return {**plain, **self.extra, "vocab_size": vocab,
                "max_position_embeddings": max(self.max_position_embeddings, max_seq_len)}

    def num_parameters(self, vocab_size: int | None = None) -> int:
        """Parameter count, computed from the shape (equals the built model's)."""
        return parameter_counts({**self.config(vocab_size), "model_type": self.model_type}).total


@dataclass(frozen=True)
class ParameterCounts:
    """A decoder's parameters as its config implies them."""

    total: int
    active: int
    """What one token computes with: all but the experts the router does not pick (`total` for a dense model)."""
    root: int
    """Outside the blocks: embeddings, untied head, final norm."""
    largest: int
    """Elements of the largest tensor (embedding, an MLP matrix or a layer's fused experts)."""
    intermediate: int
    """The MLP width one token passes through (its experts' together for a mixture of experts)."""
    kv_size: int
    """Width of the k and v projections (key/value heads x head size)."""


def parameter_counts(config: Mapping[str, Any]) -> ParameterCounts:
    """Counts of a Llama-like decoder from its `transformers` config as a dict (config.json; a multimodal one's
    `text_config`): head_dim, query/key norms, attention and MLP biases, mixtures of experts (Mixtral's
    num_local_experts, Qwen-MoE's num_experts, moe_intermediate_size, mlp_only_layers, decoder_sparse_step), untied
    heads. UnpricedShape for a shape it does not describe, KeyError/ValueError for a config that is no decoder's."""
    c = config if "hidden_size" in config else config.get("text_config") or config
    unpriced = [k for k in _UNPRICED_KEYS if c.get(k)]
    if unpriced:
        raise UnpricedShape(f"{c.get('model_type')}'s {', '.join(unpriced)} (a shape the count does not describe)")
    family = c.get("model_type") or config.get("model_type") or "llama"
    h, layers, heads = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["num_attention_heads"])
    kv, vocab, inter = int(c.get("num_key_value_heads") or heads), int(c["vocab_size"]), int(c["intermediate_size"])
    head_dim = int(c.get("head_dim") or h // heads)
    q, k = heads * head_dim, kv * head_dim
    attention = 2 * h * q + 2 * h * k + (q + 2 * k + h if c.get("attention_bias") else 0)
    attention += 2 * head_dim if family in QK_NORM_FAMILIES else 0
    norms = NORMS_PER_BLOCK.get(family, 2) * h

    def mlp(width: int) -> int:
        return 3 * h * width + (2 * width + h if c.get("mlp_bias") else 0)

    experts = int(c.get("num_local_experts") or c.get("num_experts") or 0)
    per_token = int(c.get("num_experts_per_tok") or 0) if experts else 0
    expert_width = int(c.get("moe_intermediate_size") or inter)
    dense_only, step = set(c.get("mlp_only_layers") or ()), int(c.get("decoder_sparse_step") or 1)
    sparse = sum(1 for i in range(layers) if experts and i not in dense_only and (i + 1) % step == 0)
    tied = c.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
    root = vocab * h * (1 if tied else 2) + h
    total = (root + layers * (attention + norms) + (layers - sparse) * mlp(inter)
             + sparse * (experts * h + experts * 3 * h * expert_width))
    active = total - sparse * (experts - per_token) * 3 * h * expert_width
    fused = 2 if family in FUSED_PROJECTIONS else 1
    largest = max(vocab * h, fused * h * inter if sparse < layers else 0, 2 * h * expert_width * experts * (sparse > 0),
                  h * (q + 2 * k) if fused > 1 else h * q)
    return ParameterCounts(total=total, active=active, root=root, largest=largest,
                           intermediate=per_token * expert_width if sparse == layers else inter, kv_size=k)


PRESETS: dict[str, Preset] = {
    # For tests: well under 1 M parameters with an 8k vocabulary.
    "tiny": Preset(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=64),
    # The default: about 5 M parameters, 1-2 s per step on two CPU cores.
    "small": Preset(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                    intermediate_size=688),
    "medium": Preset(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                     intermediate_size=1376),
    "llama-1b": Preset(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                       intermediate_size=8192, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    "llama-3b": Preset(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                       intermediate_size=8192, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    # The paper's model (Llama-3.1-8B shape).
    "llama3.1-8b": Preset(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                          intermediate_size=14336, tie_word_embeddings=False, vocab_size=128256,
                          max_position_embeddings=8192, rope_theta=500000.0),
    # A Qwen3 of the tiny shape: head_dim set apart from hidden / heads, per-head query and key norms.
    "qwen3-tiny": Preset(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, model_type="qwen3", extra={"head_dim": 16}),
    # A Mixtral-style mixture of experts for tests: 4 experts, 2 per token, fused 3-D expert weights.
    "moe-tiny": Preset(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=64, tie_word_embeddings=False, model_type="mixtral",
                       extra={"num_local_experts": 4, "num_experts_per_tok": 2}),
    # Qwen3-30B-A3B's shape (128 experts, 8 per token): 30.5 B parameters, 3.3 B active.
    "qwen3-30b-a3b": Preset(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                            intermediate_size=6144, tie_word_embeddings=False, vocab_size=151936,
                            max_position_embeddings=40960, rope_theta=1000000.0, model_type="qwen3_moe",
                            extra={"head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                                   "moe_intermediate_size": 768}),
}
