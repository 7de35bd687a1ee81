"""`python -m flwr_sharded_perf.bench`: the runner that `cli._reexec` starts inside the namespaces."""

import sys

from flwr_sharded_perf.bench.cli import _inner_entry

if __name__ == "__main__":
    sys.exit(_inner_entry())
