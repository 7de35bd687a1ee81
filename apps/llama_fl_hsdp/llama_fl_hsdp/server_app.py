"""The ServerApp: the run from the run config, its strategy (DecentralizedFedAvg: config-only messages, the groups
all-reduce their shards among themselves; ServerShardFedAvg with aggregation="server"; or the `strategy` key's
class), and the run directory its rounds, summary and model go to."""

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from flwr_sharded.flower.server.app import load_run, record_outcome, run_directory, strategy_class

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    run = load_run(context.run_config, grid)
    strategy_cls = strategy_class(run)
    with run_directory(run, context.run_id) as run_dir:
        strategy = strategy_cls(run, run_dir=run_dir)
        strategy.start(grid=grid)
        record_outcome(run_dir, strategy)
