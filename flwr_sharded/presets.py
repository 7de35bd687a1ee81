"""The model presets: Llama shapes by name, the one declaration that training builds (`training.models`) and the
planner prices (`perf.model_shape`); torch-free."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    """A Llama shape; the vocabulary comes from the tokenizer unless the preset fixes it."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    tie_word_embeddings: bool = True
    vocab_size: int | None = None
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0

    def num_parameters(self, vocab_size: int | None = None) -> int:
        """Parameter count, computed from the shape (matches `LlamaForCausalLM`)."""
        vocab = self.vocab_size or vocab_size
        if vocab is None:
            raise ValueError("vocab_size is needed to count parameters")
        h, head_dim = self.hidden_size, self.hidden_size // self.num_attention_heads
        attn = h * h * 2 + 2 * h * head_dim * self.num_key_value_heads
        block = attn + 3 * h * self.intermediate_size + 2 * h
        embed = vocab * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * block + embed + h


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
}
