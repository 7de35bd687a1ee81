"""A run's directory, what every run (static or through Flower) leaves behind: config.json, metrics.jsonl (records of
kind train/eval per step or round per Flower round, each with `elapsed_s` and `tokens_seen`, then one of kind
summary), summary.json, model/ (Hugging Face format) and tensorboard/. A resumed run continues its checkpoint's run's
metrics and time (`RunDir.continue_from`). Torch-free unless TensorBoard is on.
"""

from __future__ import annotations

import json
import math
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from flwr_sharded.errors import ConfigError

DEFAULT_PARENT = "outputs"
CONFIG, METRICS, SUMMARY, MODEL, TENSORBOARD = "config.json", "metrics.jsonl", "summary.json", "model", "tensorboard"


def default_run_dir(suffix: str = "", parent: str | Path = DEFAULT_PARENT) -> Path:
    """`outputs/<date>_<time><suffix>` under the working directory, made unique with `-2`, `-3`, ... if taken."""
    base = Path(parent) / (datetime.now().strftime("%Y-%m-%d_%H-%M-%S") + suffix)
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path.absolute()


def check_run_dir(path: str | Path, *, resume: bool, option: str = "--run-dir") -> Path:
    """`path` as an absolute path, refusing one that already holds a run unless the run resumes."""
    path = Path(path).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{option} {path} exists and is not a directory")
    if (path / METRICS).exists() and not resume:
        raise ConfigError(f"{option} {path} already holds a run ({METRICS}); choose another directory, or resume")
    return path


class RunDir:
    """Writes one run's directory; metrics also go to TensorBoard and W&B when asked."""

    def __init__(self, path: str | Path, *, config: dict[str, Any], tensorboard: bool = False,
                 wandb_project: str | None = None, name: str | None = None) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.started = time.time()
        _write_json(self.path / CONFIG, config)
        self._metrics = open(self.path / METRICS, "a", buffering=1)
        self.elapsed_offset = 0.0
        """Added to every record's `elapsed_s`: the earlier run's time, in a continued directory."""
        self._tb = self._wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ConfigError("tensorboard needs the tensorboard package: pip install 'flwr_sharded[tensorboard]'"
                                  ) from exc
            self._tb = SummaryWriter(str(self.path / TENSORBOARD))
        if wandb_project:
            try:
                import wandb
            except ImportError as exc:
                raise ConfigError("wandb-project needs the wandb package: pip install 'flwr_sharded[wandb]'") from exc
            self._wandb = wandb.init(project=wandb_project, name=name or self.path.name, dir=str(self.path),
                                     config=config)

    @property
    def model_dir(self) -> Path:
        return self.path / MODEL

    def continue_from(self, previous: str | Path, step: int | None, checkpoint: str | Path) -> None:
        """Start metrics.jsonl with the records of the run directory `previous` up to `step` (later steps, redone
        from the checkpoint, and its summary left out; None: every step) and a record of kind resume; `previous`
        may be this directory."""
        path = Path(previous) / METRICS
        kept = [r for r in read_records(previous) if r.get("kind") != "summary"
                and (step is None or int(r.get("step", 0)) <= step)] if path.is_file() else []
        self._metrics.close()
        _write_text(self.path / METRICS, "".join(json.dumps(r, default=_jsonable) + "\n" for r in kept))
        self._metrics = open(self.path / METRICS, "a", buffering=1)
        self.elapsed_offset = max((float(r["elapsed_s"]) for r in kept if "elapsed_s" in r), default=0.0)
        self.log({"kind": "resume", "step": step, "checkpoint": str(checkpoint), "previous": str(Path(previous)),
                  "continued_records": len(kept)})

    def log(self, record: dict[str, Any]) -> None:
        """Append one record (a dict with `kind`) to metrics.jsonl, and its numbers to TensorBoard and W&B."""
        if self.elapsed_offset and "elapsed_s" in record:
            record = {**record, "elapsed_s": record["elapsed_s"] + self.elapsed_offset}
        self._metrics.write(json.dumps(record, default=_jsonable) + "\n")
        step = record.get("step", record.get("round"))
        numbers = {f"{record.get('kind', 'train')}/{k}": v for k, v in record.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "round")
                   and math.isfinite(v)}
        if self._tb is not None and step is not None:
            for key, value in numbers.items():
                self._tb.add_scalar(key, value, int(step))
        if self._wandb is not None and step is not None:
            self._wandb.log(numbers, step=int(step))

    def finish(self, summary: dict[str, Any]) -> Path:
        """Write summary.json (with the wall time), append the same as metrics.jsonl's last record (kind summary)
        and close every sink; returns the summary's path."""
        summary = {"elapsed_s": time.time() - self.started, **summary}
        _write_json(self.path / SUMMARY, summary)
        if not self._metrics.closed:
            self._metrics.write(json.dumps({"kind": "summary", **summary}, default=_jsonable) + "\n")
        self.close()
        return self.path / SUMMARY

    def close(self) -> None:
        if not self._metrics.closed:
            self._metrics.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def read_records(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every record of a run's metrics.jsonl (a torn last line, of a run still writing, is skipped)."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a run directory: it has no {METRICS}")
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _write_text(path: Path, text: str) -> None:
    """Write `path` whole or not at all (a temporary file renamed over it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _write_json(path: Path, obj: Any) -> None:
    _write_text(path, json.dumps(obj, indent=2, default=_jsonable) + "\n")


def _jsonable(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else str(value)  # a tensor's or numpy scalar's number, a path


def perplexity(loss: float) -> float:
    """exp(loss) of a record's mean token loss; inf for a diverged or undefined loss."""
    return math.exp(loss) if loss == loss and loss < 50 else float("inf")
