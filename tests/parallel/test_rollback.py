"""The rollback point restores shards, optimizer moments, step and learning-rate schedule exactly as committed."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import torch

from flwr_sharded.parallel.rollback import RollbackPoint


def _trainer(seed: int = 0) -> SimpleNamespace:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / 20)))
    return SimpleNamespace(model=model, optimizer=optimizer, scheduler=scheduler, step_count=0)


def _point(t: SimpleNamespace, outer=None) -> RollbackPoint:
    def set_clock(state: dict) -> None:
        t.step_count = state["step"]
        t.scheduler.load_state_dict(state["scheduler"])
        for group, lr in zip(t.optimizer.param_groups, t.scheduler.get_last_lr()):
            group["lr"] = lr

    return RollbackPoint([(list(t.model.parameters()), outer)], t.optimizer,
                         clock=lambda: {"step": t.step_count, "scheduler": t.scheduler.state_dict()},
                         set_clock=set_clock)


def _step(t: SimpleNamespace, n: int = 1) -> None:
    for _ in range(n):
        t.model(torch.randn(3, 4)).square().mean().backward()
        t.optimizer.step()
        t.scheduler.step()
        t.optimizer.zero_grad()
        t.step_count += 1


def _state(t: SimpleNamespace) -> dict:
    return {"params": [p.detach().clone() for p in t.model.parameters()],
            "optimizer": copy.deepcopy(t.optimizer.state_dict()), "step": t.step_count,
            "lr": [g["lr"] for g in t.optimizer.param_groups], "scheduler": t.scheduler.state_dict()}


def _assert_same(a: dict, b: dict) -> None:
    torch.testing.assert_close(a["params"], b["params"], rtol=0, atol=0)
    torch.testing.assert_close(a["optimizer"]["state"], b["optimizer"]["state"], rtol=0, atol=0)
    assert (a["step"], a["lr"], a["scheduler"]) == (b["step"], b["lr"], b["scheduler"])


def test_restore_returns_to_the_commit_and_training_goes_on_as_from_it():
    t = _trainer()
    _step(t, 3)
    point = _point(t)
    point.commit()
    committed = _state(t)
    _step(t, 4)
    assert t.step_count == 7 and t.optimizer.param_groups[0]["lr"] != committed["lr"][0]
    point.restore()
    _assert_same(_state(t), committed)
    torch.manual_seed(5)
    _step(t, 2)  # training from the restored state equals training from the commit
    twin = _trainer()
    _step(twin, 3)
    torch.manual_seed(5)
    _step(twin, 2)
    _assert_same(_state(t), _state(twin))


def test_state_that_did_not_exist_at_the_commit_is_dropped_and_moments_alone_can_be_restored():
    t = _trainer()
    point = _point(t)
    point.commit()  # before the first step: AdamW has no state yet
    _step(t, 2)
    point.restore()
    assert not t.optimizer.state and t.step_count == 0
    _step(t, 2)
    point.commit()
    moments = copy.deepcopy(t.optimizer.state_dict()["state"])
    _step(t, 1)
    with torch.no_grad():
        for p in t.model.parameters():
            t.optimizer.state[p]["exp_avg"].fill_(float("nan"))
    params, step = [p.detach().clone() for p in t.model.parameters()], t.step_count
    point.restore_optimizer(0)  # a member healed by the others' mean: only its moments go back
    torch.testing.assert_close(t.optimizer.state_dict()["state"], moments, rtol=0, atol=0)
    torch.testing.assert_close([p.detach() for p in t.model.parameters()], params, rtol=0, atol=0)
    assert t.step_count == step


class _Outer:
    """A sync's outer state as `GlobalState` keeps it: global shards, the rule's state, residuals (live tensors)."""

    keeps, captured = True, True

    def __init__(self) -> None:
        self.shards = [torch.randn(6), torch.randn(4)]
        self.rule_state = [{"momentum": torch.randn(6)}, {"momentum": torch.randn(4)}]
        self.residuals = {0: torch.randn(6)}

    def state_dict(self) -> dict:
        return {"rule": "Nesterov", "global": self.shards, "state": self.rule_state, "residuals": self.residuals}

    def load_state_dict(self, state: dict) -> None:
        self.shards, self.rule_state, self.residuals = state["global"], state["state"], dict(state["residuals"])


def _host_buffers(point: RollbackPoint) -> list[int]:
    """The data pointers of every host copy the point holds (shards, moments, outer state)."""
    out = [copy.data_ptr() for _, _, saved in point._parts for copy in saved]
    out += [v.data_ptr() for moments in point._moments for m in moments for v in (m or {}).values()
            if isinstance(v, torch.Tensor)]
    outer = [v for o in point._outer if o for v in [*o["global"], *[s["momentum"] for s in o["state"]],
                                                   *o["residuals"].values()]]
    return out + [v.data_ptr() for v in outer]


def test_commits_reuse_their_host_buffers_and_restore_writes_in_place():
    t = _trainer()
    outer = _Outer()
    point = _point(t, outer)
    _step(t, 1)
    point.commit()
    buffers = _host_buffers(point)
    assert len(buffers) == 4 + 12 + 5  # 4 shards, their 2 moments and step each, the outer state's 5 tensors
    _step(t, 2)
    with torch.no_grad():
        for tensor in [*outer.shards, *[s["momentum"] for s in outer.rule_state], *outer.residuals.values()]:
            tensor.add_(1.0)
    point.commit()
    assert _host_buffers(point) == buffers  # the same host memory, commit after commit
    momenta = [s["momentum"] for s in outer.rule_state]
    committed = _state(t), {"global": [x.clone() for x in outer.shards], "momentum": [x.clone() for x in momenta]}
    live = [p.data_ptr() for p in t.model.parameters()]
    live += [v.data_ptr() for p in t.model.parameters() for v in t.optimizer.state[p].values() if v.dim() > 0]
    live_outer = [x.data_ptr() for x in [*outer.shards, *[s["momentum"] for s in outer.rule_state],
                                         *outer.residuals.values()]]
    _step(t, 2)
    with torch.no_grad():
        for tensor in [*outer.shards, *outer.residuals.values()]:
            tensor.mul_(3.0)
    point.restore()
    _assert_same(_state(t), committed[0])
    torch.testing.assert_close(outer.shards, committed[1]["global"], rtol=0, atol=0)
    torch.testing.assert_close([s["momentum"] for s in outer.rule_state], committed[1]["momentum"], rtol=0, atol=0)
    after = [p.data_ptr() for p in t.model.parameters()]
    after += [v.data_ptr() for p in t.model.parameters() for v in t.optimizer.state[p].values() if v.dim() > 0]
    assert after == live  # written into the tensors that were there: no second copy on the device
    assert [x.data_ptr() for x in [*outer.shards, *[s["momentum"] for s in outer.rule_state],
                                   *outer.residuals.values()]] == live_outer


def test_a_pending_commit_is_returned_to_only_once_confirmed():
    """An overlapped sync's commit is pending until the members confirm it: a restore before that returns to the
    confirmed commit (the pending one dropped), after `confirm` to the pending one, shards, moments and clock."""
    t = _trainer()
    _step(t, 2)
    point = _point(t)
    point.commit()
    confirmed = _state(t)
    _step(t, 2)
    point.commit(0, pending=True)
    assert point.pending == [0]
    _step(t, 1)
    point.restore()
    assert point.pending == []
    _assert_same(_state(t), confirmed)

    _step(t, 3)
    point.commit(0, pending=True)
    pending = _state(t)
    _step(t, 2)
    point.confirm()
    assert point.pending == []
    point.restore()
    _assert_same(_state(t), pending)
    _step(t, 1)
    point.restore()  # the confirmed commit stays what a restore returns to
    _assert_same(_state(t), pending)
