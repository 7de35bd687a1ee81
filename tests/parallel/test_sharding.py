"""FSDP2 sharding of Hugging Face models: any architecture, and options that must not change the numbers."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.multiproc import run_ranks


def _reference_and_sharded(rank: int, world: int, arch: str, options: dict):
    """One SGD step on the same batch, sharded over `world` ranks and unsharded in-process; return max difference."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from flwr_sharded.config import ParallelConfig
    from flwr_sharded.parallel.sharding import apply_activation_checkpointing, apply_fsdp, mixed_precision_policy
    from flwr_sharded.training.models import transformer_blocks
    from flwr_sharded.parallel.topology import init_topology

    topo = init_topology(ParallelConfig(method="fsdp", shards=world))
    torch.manual_seed(0)
    if arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                           bos_token_id=0, eos_token_id=0))  # no dropout: deterministic
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, intermediate_size=64))
    reference = copy.deepcopy(model)
    if options.get("activation_checkpointing"):
        apply_activation_checkpointing(model)
    apply_fsdp(model, transformer_blocks(model), topo.fsdp_mesh, mp_policy=mixed_precision_policy("fp32", "cpu"),
               reshard_after_forward=options.get("reshard_after_forward", True))
    batch = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))  # same batch on every rank
    for m in (model, reference):
        m.train()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m(input_ids=batch, labels=batch).loss.backward()
        opt.step()
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    ref = reference.state_dict()
    from torch.distributed.fsdp import FSDPModule

    units = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    return max(float((full[k] - ref[k]).abs().max()) for k in ref), len(model.state_dict()), units


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize("arch,options", [
    ("llama", {}),
    ("llama", {"activation_checkpointing": True}),
    ("llama", {"reshard_after_forward": False}),
    ("gpt2", {}),
])
def test_sharded_step_equals_unsharded_step(arch, options):
    """Units as torchtitan's: the input embedding, each block, [final norm, head], the root; tied embeddings (GPT-2)
    stay in the root."""
    for diff, n_tensors, units in run_ranks(_reference_and_sharded, 2, arch, options):
        assert n_tensors > 5
        assert diff < 1e-6, diff
        if arch == "llama":
            assert units == ["", "model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]
        else:
            assert units == ["", "transformer.h.0", "transformer.h.1"], units


def test_blocks_are_found_from_the_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    from flwr_sharded.training.models import build_model, transformer_blocks

    llama = build_model("tiny", vocab_size=64, max_seq_len=32)
    assert [type(b).__name__ for b in transformer_blocks(llama)] == ["LlamaDecoderLayer"] * 2
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=3, n_head=2, bos_token_id=0, eos_token_id=0))
    assert [type(b).__name__ for b in transformer_blocks(gpt2)] == ["GPT2Block"] * 3


def test_presets():
    from flwr_sharded.training.models import PRESETS, build_model

    tiny = build_model("tiny", vocab_size=8192, max_seq_len=64)
    n_tiny = sum(p.numel() for p in tiny.parameters())
    assert n_tiny < 500_000 and n_tiny == PRESETS["tiny"].num_parameters(8192)
    small = build_model("small", vocab_size=8192, max_seq_len=256)
    n_small = sum(p.numel() for p in small.parameters())
    assert 4_000_000 < n_small < 6_000_000 and n_small == PRESETS["small"].num_parameters(8192)
    assert 7.9e9 < PRESETS["llama3.1-8b"].num_parameters() < 8.1e9
