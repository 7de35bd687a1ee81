"""The outer rules declare what the rest of the project reads (names, traits, options, memory) in one place."""

from __future__ import annotations

import pytest
import re
import subprocess
import sys

import torch

from tests.multiproc import REPO


def _doc(field: str) -> str:
    from flwr_sharded.config import ParallelConfig
    from flwr_sharded.schema import options

    return next(o for o in options(ParallelConfig) if o.path[-1] == field).doc


def test_the_option_docstrings_name_exactly_the_registered_rules_and_their_defaults():
    from flwr_sharded.parallel.rules import RULES, rule_options

    named = re.findall(r"\b([a-z]+(?:-[a-z]+)?)\b(?: \(DiLoCo\))?(?:,| or)", _doc("outer"))
    assert named == list(RULES), named
    lrs = {n: o["lr"] for n, o in ((n, rule_options(c)) for n, c in RULES.items()) if "lr" in o}
    assert {n: float(v) for n, v in re.findall(r"([a-z-]+) (\d+(?:\.\d+)?)", _doc("outer_lr"))} == lrs
    takes_momentum = [n for n, c in RULES.items() if "momentum" in rule_options(c)]
    assert _doc("outer_momentum").startswith(f"Outer momentum of {' and '.join(takes_momentum)}; ")
    assert {rule_options(RULES[n])["momentum"] for n in takes_momentum} == {
        float(re.search(r"unset: (\d+(?:\.\d+)?)", _doc("outer_momentum")).group(1))}


def test_each_rule_declares_the_state_its_init_state_makes():
    from flwr_sharded.parallel.rules import RULES

    for name, cls in RULES.items():
        state = cls().init_state(torch.zeros(7))
        buffers = [t for t in state.values() if t.numel() == 7]
        assert len(buffers) == cls.state_buffers and all(t.dtype == torch.float32 for t in buffers), name
        assert cls.stateful == bool(state), name
        assert cls.linear == (cls.temp_buckets_per_member == 0), name


@pytest.mark.dist
def test_the_rules_load_without_torch():
    code = ("import sys; import flwr_sharded.parallel.rules as o, flwr_sharded.flower.node_policy; "
            "print(len(o.RULES), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(REPO), "PATH": ""})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["7", "False"], out.stdout
