"""Phase timings and metric sinks (JSON lines, optional TensorBoard)."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch


class PhaseTimer:
    """Times named phases (forward, backward, optimizer, sync) without adding device synchronisations.

    On GPU each phase is bracketed by CUDA events that are only read in `collect()`, which the caller runs at
    logging time, when it synchronises anyway. On CPU, where kernels run synchronously, it uses a wall clock.
    """

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"
        self._pending: list[tuple[str, Any, Any]] = []
        self._totals: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((name, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._totals[name] += time.perf_counter() - t0

    def collect(self) -> dict[str, float]:
        """Seconds spent in each phase since the last call."""
        if self._pending:
            self._pending[-1][2].synchronize()
            for name, start, end in self._pending:
                self._totals[name] += start.elapsed_time(end) / 1000.0
            self._pending.clear()
        totals, self._totals = dict(self._totals), defaultdict(float)
        return totals


class MetricsWriter:
    """Writes one JSON object per line (and TensorBoard scalars when asked); a no-op on non-logging ranks."""

    def __init__(self, path: str | None, tensorboard_dir: str | None = None, enabled: bool = True) -> None:
        self._file = None
        self._tb = None
        if not enabled:
            return
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1)
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise RuntimeError("--tensorboard needs the tensorboard package: pip install tensorboard") from exc
            self._tb = SummaryWriter(tensorboard_dir)

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
        if self._tb is not None and "step" in record:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tb.add_scalar(f"{record.get('kind', 'train')}/{key}", value, record["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
