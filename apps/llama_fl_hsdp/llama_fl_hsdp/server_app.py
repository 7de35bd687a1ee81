"""The ServerApp: the run from the run config, its strategy (DecentralizedFedAvg: config-only messages, the groups
all-reduce their shards among themselves; ServerShardFedAvg with aggregation="server"; or the `strategy` key's
class, e.g. one of this app's `strategies`), and the run directory its rounds, summary and model go to.

`strategy` and `outer` may name modules of this package (`__package__`) and of flwr_sharded; any other module
must be allowed by the SuperLink's operator (`FLWR_SHARDED_ALLOWED_IMPORTS`)."""

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from flwr_sharded.flower.server.app import load_run, record_outcome, run_directory, strategy_class

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    run = load_run(context.run_config, grid, app_package=__package__)
    strategy_cls = strategy_class(run, app_package=__package__)
    with run_directory(run, context.run_id) as run_dir:
        strategy = strategy_cls(run, run_dir=run_dir)
        strategy.start(grid=grid)
        record_outcome(run_dir, strategy)
