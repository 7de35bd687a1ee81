"""The trainer: after `evaluate()` the model is resharded, so shards written after it (as a merge, catch-up or restore
writes them) are what the next step trains from (two gloo ranks: FSDP2 over one rank aliases the gathered parameters
to the shards; the tiny model); gradient accumulation reduce-scatters every micro-batch and steps as holding the
unsharded gradients does; AdamW is fused on CUDA parameters only."""

from __future__ import annotations

import pytest
import torch

from tests.multiproc import run_ranks


def _shards_after_a_write(rank: int, world: int, data_dir: str, reshard: bool) -> list[list[torch.Tensor]]:
    """Without and with an evaluation between two steps: one step, (evaluation,) every shard halved, one more
    step; this rank's shards after it."""
    from flwr_sharded.config import TrainConfig
    from flwr_sharded.parallel.alignment import local_shard
    from flwr_sharded.parallel.topology import init_topology
    from flwr_sharded.training.trainer import Trainer

    cfg = TrainConfig()
    cfg.parallel.method, cfg.parallel.shards = "fsdp", world
    cfg.model.name, cfg.data.data_dir, cfg.data.seq_len, cfg.data.eval_blocks = "tiny", data_dir, 32, 4
    cfg.batch_size, cfg.steps, cfg.optim.lr, cfg.model.reshard_after_forward = 2, 4, 3e-3, reshard
    topo = init_topology(cfg.parallel)
    out = []
    for evaluate in (False, True):
        t = Trainer(cfg, topo)
        params = list(t.model.parameters())  # the sharded parameters, as the sync and the rollback point hold them
        t.step()
        if evaluate:
            t.evaluate()
        with torch.no_grad():
            for p in params:
                local_shard(p).mul_(0.5)
        t.step()
        out.append([local_shard(p).detach().clone() for p in params])
    return out


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize("reshard", [False, True], ids=["kept-after-forward", "resharded-after-forward"])
def test_a_step_after_evaluation_trains_from_the_shards_written_since(data_dir, reshard):
    """With `reshard-after-forward` off, FSDP2 keeps every unit gathered after a forward with no backward."""
    for without, with_eval in run_ranks(_shards_after_a_write, 2, str(data_dir), reshard, timeout=150):
        torch.testing.assert_close(with_eval, without, rtol=0, atol=0)


def _accumulated(rank: int, world: int, data_dir: str, replicas: int) -> list[tuple[list[float], list[torch.Tensor]]]:
    """Two steps of two micro-batches, reduce-scattering each micro-batch and holding the gradients unsharded: the
    losses and this rank's shards of each."""
    from flwr_sharded.config import TrainConfig
    from flwr_sharded.parallel.alignment import local_shard
    from flwr_sharded.parallel.topology import init_topology
    from flwr_sharded.training.trainer import Trainer

    cfg = TrainConfig()
    cfg.parallel.method = "hsdp" if replicas > 1 else "fsdp"
    cfg.parallel.replicas, cfg.parallel.shards = replicas, world // replicas
    cfg.model.name, cfg.data.data_dir, cfg.data.seq_len, cfg.data.eval_blocks = "tiny", data_dir, 32, 4
    cfg.batch_size, cfg.grad_accum, cfg.steps, cfg.optim.lr = 1, 2, 4, 3e-3
    topo = init_topology(cfg.parallel)
    out = []
    for every in (True, False):
        t = Trainer(cfg, topo)
        t.reduce_every_micro_batch = every
        losses = [float(t.step()) for _ in range(2)]
        out.append((losses, [local_shard(p).detach().clone() for p in t.model.parameters()]))
    return out


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world,replicas", [(2, 1), (4, 2)], ids=["fsdp", "hsdp"])
def test_gradient_accumulation_reduces_every_micro_batch_with_the_same_steps(data_dir, world, replicas):
    """HSDP: the replicas' all-reduce of the partial reductions once per step."""
    results = run_ranks(_accumulated, world, str(data_dir), replicas, timeout=210)
    for (losses, shards), (held_losses, held_shards) in results:
        assert losses == pytest.approx(held_losses, abs=1e-6)
        torch.testing.assert_close(shards, held_shards, rtol=0, atol=1e-5)  # sums in another order, through Adam


def test_adamw_is_fused_on_cuda_parameters_only():
    from types import SimpleNamespace

    from flwr_sharded.training.trainer import build_optimizer, fused_on

    on = [SimpleNamespace(device=torch.device("cuda", 0))] * 2
    assert fused_on(on) and not fused_on([on[0], SimpleNamespace(device=torch.device("cpu"))]) and not fused_on([])
    from flwr_sharded.config import TrainConfig

    cpu = build_optimizer(torch.nn.Linear(2, 2), TrainConfig())
    assert type(cpu).__name__ == "AdamW" and not cpu.defaults["fused"]
