"""FedProx's proximal term on shards equals its definition on the whole model: the gradient of
loss + mu/2 * ||w - w_sync||^2 computed by autograd on an unsharded copy."""

from __future__ import annotations

import pytest

from tests.multiproc import run_ranks

pytestmark = pytest.mark.dist  # every test here starts processes

MU = 0.3


def _sharded_and_central(rank: int, world: int) -> tuple[float, float, float]:
    import copy

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from flwr_sharded.config import ParallelConfig
    from flwr_sharded.parallel.sharding import apply_fsdp, mixed_precision_policy
    from flwr_sharded.parallel.topology import init_topology
    from flwr_sharded.training.models import transformer_blocks
    from flwr_sharded.training.proximal import ProximalTerm

    topo = init_topology(ParallelConfig(method="fsdp", shards=world))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                         num_key_value_heads=1, intermediate_size=32))
    reference = copy.deepcopy(model)
    anchor = {k: v.detach().clone() for k, v in reference.named_parameters()}
    apply_fsdp(model, transformer_blocks(model), topo.fsdp_mesh, mp_policy=mixed_precision_policy("fp32", "cpu"))
    term = ProximalTerm(model)
    term.set_anchor()  # w_sync: the weights both copies start from
    with torch.no_grad():  # move away from the anchor, identically on both copies
        for p in reference.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
        for name, p in model.named_parameters():
            full = dict(reference.named_parameters())[name]
            p.copy_(torch.distributed.tensor.distribute_tensor(full.detach(), p.device_mesh, p.placements))
    batch = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    model(input_ids=batch, labels=batch).loss.backward()
    term.add_gradient(MU)
    loss = reference(input_ids=batch, labels=batch).loss
    proximal = 0.5 * MU * sum((p - anchor[n]).pow(2).sum() for n, p in reference.named_parameters())
    (loss + proximal).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    diff = max(float((grads[n] - p.grad).abs().max()) for n, p in reference.named_parameters())
    value = torch.tensor([term.value(MU)], dtype=torch.float64)
    torch.distributed.all_reduce(value)
    return diff, float(value), float(proximal)


@pytest.mark.timeout(180)
def test_proximal_gradient_on_shards_equals_autograd_on_the_whole_model():
    for diff, sharded_value, central_value in run_ranks(_sharded_and_central, 2):
        assert diff < 1e-6, diff
        assert sharded_value == pytest.approx(central_value, rel=1e-6)
        assert central_value > 1e-3  # the weights did move away from the anchor: the term is not trivially zero
