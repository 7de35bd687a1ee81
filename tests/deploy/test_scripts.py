"""Every script under deploy/ parses (`bash -n`), passes shellcheck where it is installed, and prints its usage."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.flower.procs import REPO

DEPLOY = REPO / "deploy"
SCRIPTS = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".sh", ".sbatch", ".env"))


def test_there_are_scripts():
    names = {p.relative_to(DEPLOY).as_posix() for p in SCRIPTS}
    assert {"env.sh", "slurm/superlink.sbatch", "slurm/group.sbatch", "slurm/all-in-one.sbatch",
            "tls/make-certs.sh", "auth/make-supernode-keys.sh"} <= names
    assert any(n.startswith("slurm/cross-facility/") for n in names)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_bash_syntax(script):
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed (apt-get install shellcheck)")
def test_shellcheck():
    out = subprocess.run(["shellcheck", "-x", *map(str, SCRIPTS)], capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert out.returncode == 0, out.stdout[-6000:]


@pytest.mark.parametrize("script", ["tls/make-certs.sh", "auth/make-supernode-keys.sh",
                                    "slurm/cross-facility/submit-groups.sh"])
def test_usage(script):
    out = subprocess.run(["bash", str(DEPLOY / script), "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "deploy/" in out.stdout


@pytest.mark.parametrize("script", sorted(p.name for p in (DEPLOY / "slurm").glob("*.sbatch")))
def test_sbatch_headers(script):
    text = (DEPLOY / "slurm" / script).read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and "#SBATCH --job-name=" in text and "set -euo pipefail" in text
    assert 'source "$FLWR_SHARDED_REPO/deploy/env.sh"' in text


def test_the_gpu_check_says_so_and_exits_cleanly_without_a_gpu():
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: run benchmarks/gpu_check.py itself")
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py")], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0 and "no CUDA GPU" in out.stdout, out.stderr
