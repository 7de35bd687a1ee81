"""The ServerApp: DecentralizedFedAvg (config-only messages; the groups all-reduce their shards among themselves) or,
with aggregation="server", ServerShardFedAvg (shards travel through this server, for groups that share no network)."""

from logging import ERROR

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log

from flwr_sharded.errors import ConfigError
from flwr_sharded.flower.strategy import DecentralizedFedAvg
from llama_fl_hsdp.task import deadlines, flag, run_spec

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    try:
        spec = run_spec(cfg)
    except ConfigError as exc:
        log(ERROR, "%s", exc)
        raise
    if spec.aggregation == "server":
        from flwr_sharded.flower.server_strategy import ServerShardFedAvg as strategy_class
    else:
        strategy_class = DecentralizedFedAvg
    strategy = strategy_class(
        spec, deadlines(cfg), evaluate_in_train=flag(cfg, "evaluate-in-train", True),
        metrics_path=str(cfg.get("metrics-path", "")), save_dir=str(cfg.get("save-dir", "")),
        stop_groups=flag(cfg, "stop-groups"), group_idle_timeout=float(cfg.get("group-idle-timeout", 600.0)))
    strategy.start(grid=grid, num_rounds=spec.rounds)
