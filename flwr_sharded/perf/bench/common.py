"""What the benchmark's modules share: the repository root, the runs' labels and progress output."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
LABELS = {"fsdp": "FSDP", "hsdp": "HSDP", "fl-fsdp": "FL+FSDP", "fl-hsdp": "FL+HSDP", "no-sync": "FL+FSDP no-sync"}


def _say(message: str) -> None:
    print(message, flush=True)
