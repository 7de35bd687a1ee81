"""Sharded start-up on the meta device: the full initial weights depend on the seed alone, never on the layout."""

from __future__ import annotations

import pytest
import torch

from tests.multiproc import run_ranks

LAYOUTS = {1: [dict(method="fsdp", shards=1)], 2: [dict(method="fsdp", shards=2)],
           4: [dict(method="fsdp", shards=4), dict(method="hsdp", replicas=2, shards=2),
               dict(method="fl-fsdp", federations=2, shards=2)]}


def _build(topo, seed: int, name: str = "tiny", **kwargs):
    from flwr_sharded.parallel.sharding import mixed_precision_policy
    from flwr_sharded.training.model_init import build_sharded_model

    return build_sharded_model(name, vocab_size=96, max_seq_len=32, mesh=topo.fsdp_mesh, seed=seed,
                               mp_policy=mixed_precision_policy("fp32", "cpu"), **kwargs)


def _full(model) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def _init_on_ranks(rank: int, world: int):
    """For each layout of this world: the full state of seed 7 (and a step's loss), plus seed 8 once."""
    from flwr_sharded.config import ParallelConfig
    from flwr_sharded.parallel.topology import init_topology

    out = {}
    for i, layout in enumerate(LAYOUTS[world]):
        topo = init_topology(ParallelConfig(**layout))
        model = _build(topo, 7, activation_checkpointing=i == 1)
        inner = model.model
        assert model.lm_head.weight is inner.embed_tokens.weight  # tied, one parameter
        full = _full(model)
        buffers = {k: v.clone() for k, v in model.named_buffers()}
        batch = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        out[str(layout)] = {"full": full, "buffers": buffers, "loss": float(loss),
                            "grad_finite": all(bool(p.grad.full_tensor().isfinite().all()) for p in model.parameters())}
    topo = init_topology(ParallelConfig(**LAYOUTS[world][0]))
    out["seed8"] = _full(_build(topo, 8))
    return out if rank == 0 else None


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_initial_weights_depend_on_the_seed_alone():
    from transformers import LlamaConfig, LlamaForCausalLM

    runs = {world: run_ranks(_init_on_ranks, world, timeout=240)[0] for world in (1, 2, 4)}
    reference = runs[1][str(LAYOUTS[1][0])]
    for world, result in runs.items():
        for layout in LAYOUTS[world]:
            got = result[str(layout)]
            assert got["full"].keys() == reference["full"].keys()
            for key, value in reference["full"].items():
                assert torch.equal(got["full"][key], value), (world, layout, key)
            assert got["loss"] == pytest.approx(reference["loss"], abs=1e-5)
            assert got["grad_finite"]
    other = runs[2]["seed8"]
    assert all(not torch.equal(other[k], v) for k, v in reference["full"].items() if "norm" not in k)
    assert all(torch.equal(other[k], v) for k, v in reference["full"].items() if "norm" in k)  # ones

    # the distributions of Hugging Face's init, and the rotary buffers recomputed as a plain build has them
    full = reference["full"]
    std = LlamaConfig().initializer_range
    weights = torch.cat([v.flatten() for k, v in full.items() if k.endswith("proj.weight") or "embed" in k])
    assert weights.mean().abs() < 1e-3 and abs(float(weights.std()) - std) < 1e-3
    assert all(torch.equal(v, torch.ones_like(v)) for k, v in full.items() if "norm" in k)
    plain = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=2048))
    for name, buffer in plain.named_buffers():
        assert torch.equal(reference["buffers"][name], buffer), name
    assert "lm_head.weight" in full and torch.equal(full["lm_head.weight"], full["model.embed_tokens.weight"])


def test_the_padding_row_is_zero_and_block_rows_match_a_whole_draw():
    from flwr_sharded.training.model_init import INIT_BLOCK_ROWS, fill_normal_rows

    whole = torch.empty(3 * INIT_BLOCK_ROWS + 5, 4)
    fill_normal_rows(whole, start=0, full_rows=whole.shape[0], std=0.02, seed=3, name="w")
    for start, stop in [(0, 1), (10, 150), (63, 65), (190, 197)]:
        part = torch.empty(stop - start, 4)
        fill_normal_rows(part, start=start, full_rows=whole.shape[0], std=0.02, seed=3, name="w")
        assert torch.equal(part, whole[start:stop])


def _padded(rank: int, world: int):
    from transformers import LlamaConfig

    from flwr_sharded.config import ParallelConfig
    from flwr_sharded.parallel.sharding import apply_fsdp, mixed_precision_policy
    from flwr_sharded.parallel.topology import init_topology
    from flwr_sharded.training.model_init import build_meta_model, init_local_shards, materialize, record_init
    from flwr_sharded.training.models import transformer_blocks

    topo = init_topology(ParallelConfig(method="fsdp", shards=world))
    model = build_meta_model(LlamaConfig(vocab_size=70, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, intermediate_size=32, pad_token_id=67,
                                         tie_word_embeddings=False))
    plan = record_init(model)
    apply_fsdp(model, transformer_blocks(model), topo.fsdp_mesh, mp_policy=mixed_precision_policy("fp32", "cpu"))
    materialize(model, "cpu")
    init_local_shards(model, 0, plan)
    return _full(model)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_an_untied_model_with_a_padding_row():
    full = run_ranks(_padded, 2, timeout=100)[0]
    embed = full["model.embed_tokens.weight"]
    assert torch.equal(embed[67], torch.zeros(16)) and embed[66].abs().sum() > 0
    assert not torch.equal(full["lm_head.weight"], embed)
