"""What the benchmark's modules share: the repository root, the runs' labels and progress output."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
LABELS = {"fsdp": "FSDP", "hsdp": "HSDP", "fl-fsdp": "FL+FSDP", "fl-hsdp": "FL+HSDP", "no-sync": "FL+FSDP no-sync",
          "fl-fsdp-overlap": "FL+FSDP overlapped", "fl-fsdp-int8": "FL+FSDP int8",
          "fl-fsdp-overlap-int8": "FL+FSDP overlapped int8", "fl-fsdp-int4": "FL+FSDP int4",
          "fl-fsdp-overlap-int4": "FL+FSDP overlapped int4", "fl-fsdp-topk": "FL+FSDP top-k",
          "fl-fsdp-overlap-topk": "FL+FSDP overlapped top-k"}


def _say(message: str) -> None:
    print(message, flush=True)
