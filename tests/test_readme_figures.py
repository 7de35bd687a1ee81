"""The README's quick start quotes what `make demo` prints at its end (train loss, train and eval perplexity of the
last round); these figures are the same on every run of this kind of machine for the same seed. The demo's
training, through the static engine (the same steps, samples and syncs as the Flower simulation:
`tests/flower/test_simulation.py::test_simulation_loss_curve_matches_the_static_engine`), must print them."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from tests.multiproc import REPO, train_ranks

APP_CONFIG = REPO / "apps" / "llama_fl_hsdp" / "pyproject.toml"


def _app_config() -> dict:
    import tomllib

    return tomllib.loads(APP_CONFIG.read_text())["tool"]["flwr"]["app"]["config"]


def _quoted() -> tuple[float, float, float, float, float]:
    """(train loss, train ppl, eval ppl) of the README's last round line, and its COMPLETED line's (train, eval ppl)."""
    readme = (REPO / "README.md").read_text()
    last = re.findall(r"round \d+: train loss ([\d.]+) ppl ([\d.]+), eval ppl ([\d.]+)", readme)[-1]
    done = re.search(r"the run COMPLETED: \d+ round\(s\), train ppl ([\d.]+), eval ppl ([\d.]+)", readme)
    return (*map(float, last), *map(float, done.groups()))


@pytest.mark.dist
@pytest.mark.slow  # 300 steps on 4 ranks (~1 min)
@pytest.mark.timeout(400)
def test_the_demo_prints_the_figures_the_readme_quotes(data_dir, tmp_path):
    c = _app_config()
    k, a, rounds = c["syncs-per-round"], c["aggregate-every"], c["num-server-rounds"]
    run_dir = tmp_path / "run"
    args = ["--method", c["method"], "--federations", "2", "--shards", str(c["shards"]), "--model", c["model"],
            "--seq-len", str(c["seq-len"]), "--batch-size", str(c["batch-size"]), "--eval-blocks",
            str(c["eval-blocks"]), "--lr", str(c["lr"]), "--weight-decay", str(c["weight-decay"]), "--warmup",
            str(c["warmup"]), "--min-lr-ratio", str(c["min-lr-ratio"]), "--grad-clip", str(c["grad-clip"]),
            "--seed", str(c["seed"]), "--steps", str(rounds * k * a), "--aggregate-every", str(a),
            "--eval-every", str(k * a), "--log-every", "1", "--data-dir", str(data_dir), "--run-dir", str(run_dir),
            "--no-save-model", "--no-progress"]
    result = train_ranks(4, args, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    last_round = losses[-k * a:]
    train_loss = sum(last_round) / len(last_round)  # the round record's train loss: its steps' mean
    eval_loss = [r["eval_loss"] for r in records if r["kind"] == "eval"][-1]
    printed = (f"{train_loss:.4f}", f"{math.exp(train_loss):.2f}", f"{math.exp(eval_loss):.2f}")
    loss, train_ppl, eval_ppl, done_train, done_eval = _quoted()
    assert printed == (f"{loss:.4f}", f"{train_ppl:.2f}", f"{eval_ppl:.2f}"), (printed, Path("README.md"))
    assert (f"{done_train:.2f}", f"{done_eval:.2f}") == printed[1:]
