"""The test suite; `REPO` is the repository's root (where the tests find the package's files, apps and docs),
`PACKAGES` the packages it holds."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("flwr_sharded", "flwr_sharded_perf")
