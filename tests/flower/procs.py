"""Process helpers for the Flower tests: the loopback deployment harness (`tests/local_flower.py`) and the
repository's app, demo script and fast settings."""

from __future__ import annotations


from flwr_sharded.flower.launch import pid_alive  # noqa: F401  (re-exported for the tests)
from tests import REPO
from tests.local_flower import (VENV_BIN, Proc, Procs, base_env, cmdline, free_port, group_pids,  # noqa: F401
                                kill_tree_by_env, launch_group, launch_superlink, pids_matching, pids_with_env,
                                round_records, run_config_args, start_group, start_groups, strip_ansi, wait_group,
                                wait_listening, wait_until, write_flwr_home)

APP = REPO / "apps" / "llama_fl_hsdp"
DEMO = APP / "run_simulation.sh"

# Small and fast settings shared by simulation and deployment runs (so their results can be compared).
FAST_RUN_CONFIG = {"model": "tiny", "seq-len": 32, "batch-size": 2, "eval-blocks": 8, "aggregate-every": 4,
                   "syncs-per-round": 2, "num-server-rounds": 2, "lr": 0.003, "seed": 7}

__all__ = ["APP", "DEMO", "FAST_RUN_CONFIG", "REPO", "VENV_BIN", "Proc", "Procs", "base_env", "cmdline", "free_port",
           "group_pids", "kill_tree_by_env", "launch_group", "launch_superlink", "pid_alive", "pids_matching",
           "pids_with_env", "round_records", "run_config_args", "start_group", "start_groups", "strip_ansi",
           "wait_group", "wait_listening", "wait_until", "write_flwr_home"]
