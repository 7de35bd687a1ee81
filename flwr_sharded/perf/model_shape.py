"""What one GPU's training step costs besides communication: the model's shape, compute time and memory."""

from __future__ import annotations

import math
from dataclasses import dataclass

from flwr_sharded.errors import ConfigError
from flwr_sharded.perf.costmodel import Units, _positive_int


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs to know about a decoder-only (Llama-like) transformer."""

    num_params: int
    """Total parameters."""
    num_layers: int
    """Transformer blocks: one FSDP2 unit each."""
    root_params: int
    """Parameters outside the blocks (embeddings, head, final norm): the root unit."""
    hidden_size: int
    """Model width h."""
    intermediate_size: int
    """MLP width i."""
    vocab_size: int
    """Vocabulary size (logits memory)."""
    name: str = "custom"
    """Label for reports."""

    def __post_init__(self) -> None:
        for name in ("num_params", "num_layers", "hidden_size", "intermediate_size", "vocab_size"):
            _positive_int(name, getattr(self, name))
        if not 0 <= self.root_params < self.num_params:
            raise ConfigError(f"root_params must be in [0, num_params), got {self.root_params}")

    @classmethod
    def from_counts(cls, num_params: int, num_layers: int, *, hidden_size: int | None = None,
                    vocab_size: int = 32000, name: str = "custom") -> ModelShape:
        """A model known only by its size: all parameters in the blocks; h from 12 h^2 params per block if not given."""
        _positive_int("num_params", num_params)
        _positive_int("num_layers", num_layers)
        h = hidden_size or max(1, round(math.sqrt(num_params / (12 * num_layers))))
        return cls(num_params=num_params, num_layers=num_layers, root_params=0, hidden_size=h,
                   intermediate_size=4 * h, vocab_size=vocab_size, name=name)

    def units(self, bytes_per_param: float) -> Units:
        """FSDP2 units in bytes: equal blocks and the root."""
        block = (self.num_params - self.root_params) / self.num_layers
        return Units(blocks=(block * bytes_per_param,) * self.num_layers, root=self.root_params * bytes_per_param)


def compute_time(num_params: float, tokens: float, flops_per_gpu: float, *,
                 flops_per_param_token: float = 6.0) -> float:
    """Seconds of compute for one GPU's batch: flops_per_param_token * params * tokens / achievable FLOP/s.

    6 = forward (2) + backward (4); 8 with activation checkpointing (forward recomputed). Ignores attention's
    quadratic term and counts the embedding lookup as a matmul (small, conservative).
    """
    if not flops_per_gpu > 0:
        raise ConfigError(f"flops_per_gpu must be positive, got {flops_per_gpu!r}")
    return flops_per_param_token * num_params * tokens / flops_per_gpu


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU during a training step."""

    states: float
    """Parameters, gradients and AdamW's two moments, sharded over S (replicated over R and F)."""
    gathered: float
    """Unsharded FSDP2 buffers: root unit + two blocks (current and prefetched), and one unit of full gradients."""
    activations: float
    """Saved activations of one batch (see `memory_per_gpu`)."""

    @property
    def total(self) -> float:
        return self.states + self.gathered + self.activations


def memory_per_gpu(shape: ModelShape, *, S: int, tokens: int, bytes_per_param: float = 2.0,
                   state_bytes_per_param: float | None = None,
                   activation_checkpointing: bool = False) -> MemoryEstimate:
    """Estimate of the bytes one GPU holds: states / S + gathered buffers + activations.

    `state_bytes_per_param` defaults to 4 x `bytes_per_param` (parameter, gradient, exp_avg, exp_avg_sq in one
    dtype; use 16 for fp32 master weights with bf16 compute). Activations, in the compute dtype (`bytes_per_param`),
    per token: (9 h + 4 i) per block, 3 h outside the blocks, plus fp32 logits (4 bytes x vocab). Measured with
    saved-tensor hooks on Hugging Face's LlamaForCausalLM (sdpa attention, no dropout). With activation checkpointing
    only each block's input (h) is kept, plus one block's activations while it is recomputed.
    """
    _positive_int("S", S)
    _positive_int("tokens", tokens)
    state_bytes = 4 * bytes_per_param if state_bytes_per_param is None else state_bytes_per_param
    h, i, L = shape.hidden_size, shape.intermediate_size, shape.num_layers
    block = (shape.num_params - shape.root_params) / L
    gathered = 0.0
    if S > 1:
        gathered = bytes_per_param * (shape.root_params + 2 * block + max(shape.root_params, block))
    per_block = 9 * h + 4 * i
    kept = L * h + per_block if activation_checkpointing else L * per_block
    activations = tokens * ((kept + 3 * h) * bytes_per_param + 4 * shape.vocab_size)
    return MemoryEstimate(states=state_bytes * shape.num_params / S, gathered=gathered, activations=activations)
