"""The GPU checks (`benchmarks/gpu_check.py`, `benchmarks/gpu_check_multi.py`) in their dry mode on CPU, end to end,
so that they cannot rot while no GPU runs them; without a GPU and without --dry they refuse, saying why."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests import REPO



def _check(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


@pytest.mark.dist
@pytest.mark.slow  # two dry runs of every stage (~1 min); the refusals below run in `make test`
@pytest.mark.timeout(300)
@pytest.mark.parametrize("script,skipped", [("gpu_check.py", set()), ("gpu_check_multi.py", {"overlap"})])
def test_the_dry_run_passes_every_stage_it_can_run_on_cpu(script, skipped, data_dir, tmp_path):
    out = _check(script, "--dry", "--out", str(tmp_path), "--data-dir", str(data_dir))
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads((tmp_path / script.replace(".py", ".json")).read_text())
    assert report["dry"] and report["ok"]
    assert {n for n, r in report["stages"].items() if r["status"] == "skip"} == skipped, report["stages"]
    assert all(r["status"] == "pass" for n, r in report["stages"].items() if n not in skipped), report["stages"]
    summary = (tmp_path / "summary.md").read_text()
    assert "no stage failed" in summary and all(f"| {name} |" in summary for name in report["stages"])
    log = (tmp_path / script.replace(".py", ".log")).read_text()
    assert all(f"===== {name} (" in log for name in report["stages"] if name not in skipped)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([script.replace(".py", ".json"), "summary.md",
                                                                  script.replace(".py", ".log")])


@pytest.mark.dist
@pytest.mark.parametrize("script,needs", [("gpu_check.py", 1), ("gpu_check_multi.py", 2)])
def test_without_the_gpus_it_needs_the_check_refuses_and_says_so(script, needs, tmp_path):
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= needs:
        pytest.skip(f"this machine has the GPUs {script} needs: run it itself")
    out = _check(script, "--out", str(tmp_path), timeout=120)
    assert out.returncode == 2 and "nothing was checked" in out.stderr and "--dry" in out.stderr, out.stderr
    assert not list(tmp_path.iterdir())


def test_a_missing_corpus_is_named_before_any_stage(tmp_path):
    import runpy

    sys_argv = sys.argv
    sys.argv = ["gpu_check.py", "--dry", "--out", str(tmp_path / "out"), "--data-dir", str(tmp_path / "none")]
    try:
        with pytest.raises(SystemExit, match="no prepared corpus"):
            runpy.run_path(str(REPO / "benchmarks" / "gpu_check.py"), run_name="__main__")
    finally:
        sys.argv = sys_argv
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script", ["gpu_check.py", "gpu_check_multi.py"])
def test_the_stages_seconds_fit_the_budget(script, monkeypatch):
    """Every stage's cap, added up, within the check's budget (8 minutes of the GPU's 15): no stage can starve the
    ones after it."""
    import importlib

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    module = importlib.import_module(script.removesuffix(".py"))
    base = importlib.import_module("gpu_check")
    assert sum(stage.timeout for stage in module.STAGES) <= base.BUDGET_S == 480
