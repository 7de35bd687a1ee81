"""The test suite; `REPO` is the repository's root (where the tests find the package's files, apps and docs)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
