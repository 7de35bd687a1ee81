"""Every result a benchmark writes says how to rerun it: `flwr_sharded_perf.provenance` (the command as typed, the
commit, the date, the load), and every script under benchmarks/ that writes JSON records it."""

from __future__ import annotations

import ast
import datetime
import subprocess
import sys

import pytest

from flwr_sharded_perf.provenance import REPO, command_line, provenance



def _calls(tree: ast.AST) -> set[str]:
    return {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            for node in ast.walk(tree) if isinstance(node, ast.Call)}


SHARED_REPORT = {"gpu_check_multi.py"}
"""Scripts whose result file another module writes (gpu_check.py's `write_report`, which records provenance)."""
WRITERS = [p for p in sorted([*(REPO / "benchmarks").glob("*.py"), REPO / "flwr_sharded_perf" / "bench" /
                              "scenarios.py"]) if {"dump", "dumps"} & _calls(ast.parse(p.read_text()))
           and p.name not in SHARED_REPORT]
"""Every module under benchmarks/ (and the bench's) that writes JSON."""


def test_the_command_is_what_to_type_again_from_the_repository_root():
    assert command_line([str(REPO / "benchmarks" / "sync_bench.py"), "--only", "a b|c"]) == \
        "python benchmarks/sync_bench.py --only 'a b|c'"
    assert command_line([str(REPO / ".venv" / "bin" / "flwr-sharded"), "bench", "--repeats", "3"]) == \
        "flwr-sharded bench --repeats 3"


@pytest.mark.parametrize("script", WRITERS, ids=lambda p: p.name)
def test_every_benchmark_that_writes_json_records_its_provenance(script):
    assert "provenance" in _calls(ast.parse(script.read_text())), f"{script.name} writes JSON without provenance()"


def test_the_writers_are_found():
    assert {"sync_bench.py", "overlap_quality.py", "gpu_check.py", "scenarios.py"} <= {p.name for p in WRITERS}


@pytest.mark.dist  # git runs in a process of its own
def test_provenance_names_this_checkout_and_the_moment():
    out = provenance([str(REPO / "benchmarks" / "quantize_bench.py")])
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          timeout=10).stdout.strip()
    assert out["commit"] == head and isinstance(out["dirty"], bool)
    assert out["command"] == "python benchmarks/quantize_bench.py"
    assert abs(datetime.datetime.fromisoformat(out["date"]) - datetime.datetime.now()).total_seconds() < 60
    assert len(out["load"]) == 3 and out["cpus"] >= 1 and out["python"] == ".".join(map(str, sys.version_info[:3]))
    assert out["torch"]
