"""Outer optimizers and custom rules: element-wise on shards, checked against whole-tensor references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flwr_sharded.parallel.rules import (FedAdam, FedAvg, FedAvgM, FedYogi, Median, Nesterov, TrimmedMean,
                                         make_rule, weighted_mean)
from tests.multiproc import run_ranks

RULES = [FedAvg(), FedAvgM(), Nesterov(), FedAdam(), FedYogi(), TrimmedMean(trim=1), Median()]


def _rounds(seed: int = 0, n: int = 1000, members: int = 4, rounds: int = 3):
    gen = torch.Generator().manual_seed(seed)
    start = torch.randn(n, generator=gen)
    return start, [[(start + 0.1 * torch.randn(n, generator=gen), float(w + 1)) for w in range(members)]
                   for _ in range(rounds)]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: type(r).__name__)
def test_rules_are_element_wise(rule):
    """Applying a rule to shards (chunks with their own state) equals applying it to the whole tensor."""
    start, rounds = _rounds()
    whole, state = start.clone(), rule.init_state(start)
    chunks = list(start.clone().split([300, 500, 200]))
    states = [rule.init_state(c) for c in chunks]
    for members in rounds:
        whole, state = rule.aggregate(whole, members, state)
        pieces = [[(x.split([300, 500, 200])[i], w) for x, w in members] for i in range(3)]
        results = [rule.aggregate(c, p, s) for c, p, s in zip(chunks, pieces, states)]
        chunks, states = [r[0] for r in results], [r[1] for r in results]
    assert torch.allclose(torch.cat(chunks), whole, atol=1e-6)


@pytest.mark.parametrize("rule,options", [(FedAvgM(lr=0.5, momentum=0.8), {"momentum": 0.8}),
                                          (Nesterov(), {"momentum": 0.9, "nesterov": True})])
def test_momentum_rules_equal_torch_sgd_on_the_pseudo_gradient(rule, options):
    start, rounds = _rounds()
    param = torch.nn.Parameter(start.clone())
    opt = torch.optim.SGD([param], lr=rule.lr, **options)
    mine, state = start.clone(), rule.init_state(start)
    for members in rounds:
        mean = weighted_mean(members)
        param.grad = param.detach() - mean  # DiLoCo's outer gradient
        opt.step()
        mine, state = rule.aggregate(mine, members, state)
    assert torch.allclose(mine, param.detach(), atol=1e-6)


def _adaptive_reference(start, rounds, lr, b1, b2, tau, yogi):
    """FedAdam / FedYogi of Reddi et al. (2021), Algorithm 2, in numpy on whole tensors."""
    x, m, v = start.numpy().astype(np.float64), 0.0, 0.0
    for members in rounds:
        total = sum(w for _, w in members)
        mean = sum(w * s.numpy().astype(np.float64) for s, w in members) / total
        delta = mean - x
        m = b1 * m + (1 - b1) * delta
        v = v - (1 - b2) * delta**2 * np.sign(v - delta**2) if yogi else b2 * v + (1 - b2) * delta**2
        x = x + lr * m / (np.sqrt(v) + tau)
    return torch.from_numpy(x)


@pytest.mark.parametrize("rule", [FedAdam(bias_correction=False), FedYogi(), FedAdam(lr=0.05, bias_correction=False)],
                         ids=str)
def test_adaptive_rules_equal_the_published_algorithm(rule):
    """Reddi et al.'s Algorithm 2 (FedAdam and FedYogi without bias correction, as the paper writes them)."""
    start, rounds = _rounds()
    mine, state = start.clone(), rule.init_state(start)
    for members in rounds:
        mine, state = rule.aggregate(mine, members, state)
    reference = _adaptive_reference(start, rounds, rule.lr, rule.beta1, rule.beta2, rule.tau,
                                    yogi=isinstance(rule, FedYogi))
    assert torch.allclose(mine.double(), reference, atol=1e-5)


def test_fedavg_is_the_weighted_mean_and_trimmed_mean_drops_outliers():
    a, b, c = torch.zeros(3), torch.ones(3), torch.full((3,), 100.0)
    assert torch.allclose(FedAvg().aggregate(a, [(a, 1.0), (b, 3.0)], {})[0], torch.full((3,), 0.75))
    assert torch.allclose(TrimmedMean(trim=1).aggregate(a, [(a, 1.0), (b, 1.0), (c, 1.0)], {})[0], b)
    with pytest.raises(ValueError, match="more than 2"):
        TrimmedMean(trim=1).aggregate(a, [(a, 1.0), (b, 1.0)], {})


def _members_with_a_hostile_one(n: int, hostile: bool, seed: int = 7) -> list[torch.Tensor]:
    """n members' shards of 257 values near 0; with `hostile`, the last one sends 1e30 everywhere."""
    gen = torch.Generator().manual_seed(seed)
    members = [torch.randn(257, generator=gen) for _ in range(n)]
    if hostile:
        members[-1] = torch.full((257,), 1e30)
    return members


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("hostile", [False, True])
def test_median_is_torch_median_and_averages_the_two_middle_values_for_an_even_count(n, hostile):
    members = _members_with_a_hostile_one(n, hostile)
    stacked = torch.stack(members)
    result, _ = Median().aggregate(None, [(m, float(i + 1)) for i, m in enumerate(members)], {})  # weights ignored
    if n % 2:
        torch.testing.assert_close(result, stacked.median(dim=0).values, rtol=0, atol=0)
    else:  # torch.median gives the lower middle value; the rule (numpy, Flower's FedMedian) their mean
        ordered = stacked.sort(dim=0).values
        reference = (ordered[n // 2 - 1].double() + ordered[n // 2].double()) / 2
        torch.testing.assert_close(result, reference.float(), rtol=0, atol=0)
        torch.testing.assert_close(result, torch.from_numpy(np.median(stacked.numpy(), axis=0)))
    if hostile and n >= 3:  # the 1e30 member cannot move the result past the honest ones
        honest = stacked[:-1]
        assert bool((result >= honest.min(dim=0).values).all() and (result <= honest.max(dim=0).values).all())


@pytest.mark.parametrize("n,trim", [(3, 1), (4, 1), (5, 1), (5, 2), (6, 2), (7, 3), (24, 5), (25, 5)])  # 25: sort
@pytest.mark.parametrize("hostile", [False, True])
def test_trimmed_mean_is_the_sorted_trim(n, trim, hostile):
    members = _members_with_a_hostile_one(n, hostile)
    stacked = torch.stack(members)
    result, _ = TrimmedMean(trim=trim).aggregate(None, [(m, 1.0) for m in members], {})
    reference = stacked.sort(dim=0).values[trim:n - trim].double().mean(dim=0).float()
    torch.testing.assert_close(result, reference, rtol=0, atol=1e-7)
    if hostile:
        honest = stacked[:-1]
        assert bool((result >= honest.min(dim=0).values).all() and (result <= honest.max(dim=0).values).all())


def test_the_server_median_is_the_decentralised_median():
    """`server-rule` median (a chunk's stack at the server) and the `median` rule agree, an even count included."""
    from flwr_sharded.flower.server.aggregation import ChunkStack

    for n in (2, 3, 4):
        members = _members_with_a_hostile_one(n, hostile=n > 2)
        stack = ChunkStack({"w": (0, 257)}, {"w": (257,)}, {"w": torch.float32}, slots=n)
        for slot, m in enumerate(members):
            stack.put(slot, "w", 0, m)
        server = stack.combine("median", trim=1, n=n)["w"]
        torch.testing.assert_close(server, Median().aggregate(None, [(m, 1.0) for m in members], {})[0],
                                   rtol=0, atol=0)


def test_make_rule_errors():
    from flwr_sharded.errors import ConfigError

    assert isinstance(make_rule("nesterov", lr=0.5), Nesterov)
    with pytest.raises(ConfigError, match="must be one of fedavg"):
        make_rule("adagrad")
    with pytest.raises(ConfigError, match="fedadam"):
        make_rule("fedadam", momentum=0.9)
    assert isinstance(make_rule("flwr_sharded.parallel.rules:TrimmedMean", trim=2), TrimmedMean)
    with pytest.raises(ConfigError, match="not a ShardRule"):
        make_rule("flwr_sharded.parallel.rules:weighted_mean")
    with pytest.raises(ConfigError, match="cannot import"):
        make_rule("no_such_module:Rule")


def _decentralised_rule_worker(rank: int, world: int, rule_name: str, F: int, S: int):
    """Two syncs with a rule over real FSDP2 shards, against the rule applied centrally to whole tensors."""
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from flwr_sharded.config import ParallelConfig
    from flwr_sharded.parallel.sharding import apply_fsdp, mixed_precision_policy
    from flwr_sharded.training.models import transformer_blocks
    from flwr_sharded.parallel.alignment import local_shard
    from flwr_sharded.parallel.sync import ShardSync
    from flwr_sharded.parallel.topology import init_topology

    topo = init_topology(ParallelConfig(method="fl-fsdp", federations=F, shards=S))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=32)
    model = LlamaForCausalLM(config)
    model = apply_fsdp(model, transformer_blocks(model), topo.fsdp_mesh,
                       mp_policy=mixed_precision_policy("fp32", "cpu"))
    rule = make_rule(rule_name)
    sync = ShardSync(model.named_parameters(), fed_group=topo.fed_group, rule=rule, bucket_bytes=4096)
    sync.capture_global()
    names = [n for n, _ in model.named_parameters()]
    global_full = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    states = {n: rule.init_state(t) for n, t in global_full.items()}
    errors = []
    for round_ in range(2):
        gen = torch.Generator().manual_seed(1000 * round_ + topo.fed_index)  # same noise on a group's ranks
        with torch.no_grad():
            for p in model.parameters():
                noise = torch.randn(p.shape, generator=gen)  # whole-tensor noise, sliced like the shard
                local = local_shard(p)
                local.add_(noise[topo.shard_index * local.shape[0]:][:local.shape[0]] if p.dim() else noise)
        weight = float(topo.fed_index + 1)
        full = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
        everyone: list = [None] * world
        dist.all_gather_object(everyone, (topo.fed_index, topo.shard_index, weight, full))
        members = {f: (w, m) for f, s, w, m in everyone if s == 0}
        for n in names:
            global_full[n], states[n] = rule.aggregate(global_full[n], [(m[n], w) for w, m in members.values()],
                                                       states[n])
        sync.sync(weight)
        errors.append(max(float((p.full_tensor() - global_full[n]).abs().max())
                          for n, p in model.named_parameters()))
    return errors


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("rule_name,F,S", [("nesterov", 2, 2), ("fedyogi", 2, 2), ("trimmed-mean", 3, 1)])
def test_decentralised_sync_with_a_rule_matches_the_whole_tensor_reference(rule_name, F, S):
    for errors in run_ranks(_decentralised_rule_worker, F * S, rule_name, F, S):
        assert max(errors) < 1e-5, errors


def _flower_rounds(strategy, start: dict, rounds: list[list[tuple[dict, int]]]) -> list[dict]:
    """Flower's own strategy over rounds of (arrays, num-examples) replies, from `start`; the model after each."""
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1  # messages need a run outside a run

    from flwr.serverapp.strategy.fedopt import FedOpt

    current = ArrayRecord({k: v.clone() for k, v in start.items()})
    out = []
    for r, replies in enumerate(rounds, start=1):
        # what each strategy's configure_train keeps of the round's global model (FedOpt: numpy arrays)
        strategy.current_arrays = ({k: a.numpy() for k, a in current.items()} if isinstance(strategy, FedOpt)
                                   else current)
        messages = []
        for arrays, n in replies:
            content = RecordDict({"arrays": ArrayRecord({k: v.clone() for k, v in arrays.items()}),
                                  "metrics": MetricRecord({"num-examples": n})})
            message = Message(content, dst_node_id=1, message_type="train")
            messages.append(Message(content, reply_to=message))
        arrays, _ = strategy.aggregate_train(r, messages)
        current = arrays
        out.append({k: torch.from_numpy(a.numpy()) for k, a in arrays.items()})
    return out


@pytest.mark.parametrize("name,flower,ours", [
    ("fedavgm", lambda fl: fl.FedAvgM(server_momentum=0.9, server_learning_rate=0.8), lambda: FedAvgM(lr=0.8)),
    ("fedadam", lambda fl: fl.FedAdam(), lambda: FedAdam()),
    ("fedyogi", lambda fl: fl.FedYogi(), lambda: FedYogi()),
    ("trimmed-mean", lambda fl: fl.FedTrimmedAvg(beta=0.25), lambda: TrimmedMean(trim=1)),  # int(0.25 * 4) = 1
    ("median", lambda fl: fl.FedMedian(), lambda: Median()),  # four members: the mean of the two middle values
])
def test_rules_named_after_flower_strategies_compute_what_they_compute(name, flower, ours):
    """Four members, three rounds of replies with unequal weights: each rule (on one flat shard) gives the model
    Flower's strategy of the same name gives, to fp32 precision."""
    import flwr.serverapp.strategy as fl

    gen = torch.Generator().manual_seed(3)
    start = {"w": torch.randn(6, 5, generator=gen), "b": torch.randn(5, generator=gen)}
    rounds = [[({k: v + 0.1 * (m + 1) * torch.randn(v.shape, generator=gen) for k, v in start.items()}, 10 * (m + 1))
               for m in range(4)] for _ in range(3)]
    expected = _flower_rounds(flower(fl), start, rounds)
    rule = ours()
    current = {k: v.clone() for k, v in start.items()}
    for r, replies in enumerate(rounds):
        flat_global = torch.cat([current[k].reshape(-1) for k in ("w", "b")])
        if r == 0:
            state = rule.init_state(flat_global)
        members = [(torch.cat([a[k].reshape(-1) for k in ("w", "b")]), float(n)) for a, n in replies]
        new, state = rule.aggregate(flat_global, members, state)
        current = {"w": new[:30].reshape(6, 5), "b": new[30:]}
        for k in current:
            assert torch.allclose(current[k], expected[r][k].float(), atol=2e-6, rtol=1e-5), (name, r, k)
