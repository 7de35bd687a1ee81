"""A throw-away single-node Slurm cluster for the deploy tests (slurmctld + slurmd on localhost, root, auth/none,
state and spool in a temporary directory, its own ports), or - where Slurm is not installed - a harness that runs a
batch script's body directly with the SLURM_* environment and an `srun` shim that executes the step locally."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import time
from pathlib import Path

from tests.flower.procs import Procs, base_env, free_port, wait_until

SRUN_SHIM = """#!/usr/bin/env bash
# srun shim for a one-node harness: drop srun's options, run the command once as task 0 of node 0.
while [[ $# -gt 0 && "$1" == -* ]]; do
    case "$1" in
        --*=*|--exclusive|--oversubscribe) shift ;;
        --*) shift 2 ;;
        *) shift ;;
    esac
done
export SLURM_NODEID=0 SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_STEP_ID=0
exec "$@"
"""


def slurm_available() -> bool:
    return all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "squeue", "scancel"))


def install_slurm() -> str:
    """apt-get install slurm-wlm (root only); returns '' or why it could not."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "not root or no apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", "slurm-wlm"]):
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            return f"{' '.join(cmd)} failed: {out.stderr[-500:]}"
    return "" if slurm_available() else "slurm-wlm installed but its binaries are missing"


class LocalSlurm:
    """slurmctld + slurmd on this machine, one node named like this host, one partition."""

    real = True

    def __init__(self, work: Path, procs: Procs):
        self.work, self.procs = work, procs
        self.host = socket.gethostname().split(".")[0]
        for sub in ("state", "spool", "log"):
            (work / sub).mkdir(parents=True, exist_ok=True)
        cpus = os.cpu_count() or 1
        self.conf = work / "slurm.conf"
        self.conf.write_text("\n".join([
            "ClusterName=flwrtest", f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
            "AuthType=auth/none", "CredType=cred/none", "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={work}/state", f"SlurmdSpoolDir={work}/spool",
            f"SlurmctldPidFile={work}/slurmctld.pid", f"SlurmdPidFile={work}/slurmd.pid",
            f"SlurmctldLogFile={work}/log/slurmctld.log", f"SlurmdLogFile={work}/log/slurmd.log",
            "ProctrackType=proctrack/pgid", "TaskPlugin=task/none", "MpiDefault=none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "ReturnToService=2",
            "SchedulerType=sched/builtin", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=2000 State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8", ""]))
        self.env = base_env(SLURM_CONF=str(self.conf))

    def start(self) -> None:
        self.ctld = self.procs.start("slurmctld", ["slurmctld", "-D", "-i"], env=self.env)
        self.slurmd = self.procs.start("slurmd", ["slurmd", "-D"], env=self.env)

        def idle() -> bool:
            out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=self.env, capture_output=True, text=True,
                                 timeout=20)
            return out.stdout.strip() in ("idle", "mix", "alloc")

        wait_until(lambda: idle() or self.ctld.popen.poll() is not None or self.slurmd.popen.poll() is not None,
                   60, interval=0.5, what="the Slurm node idle")
        if not idle():
            raise RuntimeError(f"Slurm did not come up:\n{self.ctld.text()[-2000:]}\n{self.slurmd.text()[-2000:]}")

    def sbatch(self, script: Path, args: list[str], env: dict[str, str], output: Path,
               options: list[str] = (), wait: bool = True, timeout: float = 300) -> tuple[int, str]:
        cmd = ["sbatch", "--parsable", "-o", str(output), *options, *(["--wait"] if wait else []), str(script), *args]
        out = subprocess.run(cmd, env={**env, **self.env_overrides()}, capture_output=True, text=True,
                             timeout=timeout, cwd=env.get("FLWR_SHARDED_REPO"))
        return out.returncode, out.stdout.strip().split(";")[0] + out.stderr

    def env_overrides(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def jobs(self) -> list[str]:
        out = subprocess.run(["squeue", "-h", "-o", "%i %T"], env=self.env, capture_output=True, text=True,
                             timeout=20)
        return [line for line in out.stdout.splitlines() if line.strip()]

    def close(self) -> None:
        try:
            ids = [line.split()[0] for line in self.jobs()]
            if ids:
                subprocess.run(["scancel", *ids], env=self.env, timeout=20)
                deadline = time.monotonic() + 40
                while self.jobs() and time.monotonic() < deadline:
                    time.sleep(1)
        except (OSError, subprocess.SubprocessError):
            pass


class ShimSlurm:
    """No Slurm here: run the batch script with bash, a one-node SLURM_* environment and the srun shim."""

    real = False

    def __init__(self, work: Path, procs: Procs):
        self.work, self.procs = work, procs
        self.bin = work / "bin"
        self.bin.mkdir(parents=True, exist_ok=True)
        shim = self.bin / "srun"
        shim.write_text(SRUN_SHIM)
        shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
        self.counter = 0

    def start(self) -> None:
        pass

    def sbatch(self, script: Path, args: list[str], env: dict[str, str], output: Path,
               options: list[str] = (), wait: bool = True, timeout: float = 300) -> tuple[int, str]:
        assert wait, "the shim runs batch scripts to completion"
        self.counter += 1
        host = socket.gethostname().split(".")[0]
        job_env = {**env, "PATH": f"{self.bin}{os.pathsep}{env['PATH']}", "SLURM_JOB_ID": str(self.counter),
                   "SLURM_JOB_NODELIST": host, "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1",
                   "SLURM_SUBMIT_DIR": env.get("FLWR_SHARDED_REPO", os.getcwd())}
        proc = self.procs.start(f"job{self.counter}", ["bash", str(script), *args], env=job_env,
                                cwd=Path(job_env["SLURM_SUBMIT_DIR"]))
        try:
            proc.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.procs.kill(proc)
            raise
        shutil.copyfile(proc.log, output)
        return proc.popen.returncode, str(self.counter)

    def close(self) -> None:
        pass
