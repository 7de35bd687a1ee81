"""Resuming a run: the step every federation group resumes from, and whether this run may resume from it.

Resume takes the checkpoint `latest` names if complete (`checkpoint_files.incomplete_reason`), else the newest
complete one that loads, logging what it skipped and why. It refuses (ConfigError naming the option) a run whose
optimizer, optimizer settings, learning rate, schedule or precision differ: the checkpoint's would silently win.
`--steps` may change (not below the checkpoint's step): the schedule stays the series' first (warm-up and cosine over
its first run's steps), and steps beyond it run at its final rate (`min-lr-ratio` x `lr`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from flwr_sharded.config import TrainConfig, config_to_dict
from flwr_sharded.errors import ConfigError
from flwr_sharded.training.checkpoint_files import read_meta
from flwr_sharded.training.checkpoint_series import group_dir, holdings, intact_steps

MUST_MATCH = ("parallel.method", "parallel.federations", "parallel.replicas", "parallel.shards",
              "parallel.group_shards", "parallel.outer", "model.name", "data.dataset", "data.seq_len",
              "data.partition", "batch_size", "grad_accum", "seed", "optim.optimizer")
"""What a resumed run must share with its checkpoint: layout, model, data, batches, seed and optimizer."""
CHANGEABLE = ("optim.lr", "optim.beta1", "optim.beta2", "optim.weight_decay", "optim.warmup", "optim.min_lr_ratio",
              "model.precision")
"""What a resumed run must share with its checkpoint too, listed together when refused: learning rate, optimizer
settings, schedule, precision."""



def _setting(config: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(config, dict) or part not in config:
            return KeyError
        config = config[part]
    return config


def changed_settings(saved: dict[str, Any], cfg: TrainConfig) -> list[tuple[str, Any, Any]]:
    """(option, checkpoint's value, this run's value) of every `CHANGEABLE` option that differs."""
    mine = config_to_dict(cfg)
    out = []
    for key in CHANGEABLE:
        old, new = _setting(saved, key), _setting(mine, key)
        if old is not KeyError and old != new:  # an option the checkpoint predates cannot be compared
            out.append((key, old, new))
    return out


def check_compatible(cfg: TrainConfig, checkpoint: Path) -> None:
    """ConfigError unless `cfg` may resume from `checkpoint` (see `MUST_MATCH`, `CHANGEABLE`)."""
    saved = read_meta(checkpoint)["config"]
    mine = config_to_dict(cfg)
    for key in MUST_MATCH:
        old, new = _setting(saved, key), _setting(mine, key)
        if old is not KeyError and old != new:
            why = " (its state does not carry over to another optimizer)" if key == "optim.optimizer" else ""
            raise ConfigError(f"--resume: the checkpoint {checkpoint} was written with {key}={old!r}, this run has "
                              f"{new!r}{why}")
    # the outer state's layout: a reduced (or top-k) wire keeps the global shards (fp32 fedavg never did), fragments
    # have their own, error feedback its residuals (a top-k sync's: weighted by the sum merge, not by scatter-mean);
    # checkpoints from before an option hold what the sync did without it
    topk_merge = (("sync_topk_merge", "sum"),) if cfg.parallel.sync_topk is not None else ()
    for key, default in (("sync_dtype", "float32"), ("sync_fragments", 1), ("sync_error_feedback", False),
                         ("sync_topk", None), *topk_merge):
        saved_value = _setting(saved, f"parallel.{key}")
        saved_value = default if saved_value is KeyError else saved_value
        if saved_value != getattr(cfg.parallel, key):
            raise ConfigError(f"--resume: the checkpoint {checkpoint} was written with parallel.{key}={saved_value!r},"
                              f" this run has {getattr(cfg.parallel, key)!r}")
    step = int(read_meta(checkpoint)["step"])
    if cfg.steps < step:
        raise ConfigError(f"--resume: --steps {cfg.steps} is below the checkpoint's step {step} ({checkpoint}); "
                          f"give at least {step} steps (more extend the run)")
    changes = changed_settings(saved, cfg)
    if changes:
        raise ConfigError(
            f"--resume: the checkpoint {checkpoint} was written with "
            f"{', '.join(f'{k}={old!r}' for k, old, _ in changes)}; this run has "
            f"{', '.join(f'{k}={new!r}' for k, _, new in changes)}. Resuming would keep the checkpoint's optimizer "
            f"state and schedule: resume with the checkpoint's values")


def schedule_span(meta: dict[str, Any]) -> int:
    """The steps a checkpoint's learning-rate schedule spans: its series' first run's `steps`."""
    return int(meta.get("schedule_steps", meta["config"]["steps"]))


def resumed_line(checkpoint: Path, meta: dict[str, Any], cfg: TrainConfig) -> str:
    """What a resume says: the step, the checkpoint, and what happens to the schedule when `--steps` changed."""
    step, span = int(meta["step"]), schedule_span(meta)
    line = f"resumed from step {step} (checkpoint {checkpoint})"
    if cfg.steps > span:
        final = cfg.optim.lr * cfg.optim.min_lr_ratio
        line += (f"; --steps {cfg.steps} extends the run: the learning-rate schedule keeps its {span} steps, steps "
                 f"{max(span, step) + 1}-{cfg.steps} run at its final rate {final:.3g}")
    elif cfg.steps < span:
        line += f"; the run ends at step {cfg.steps}, within its schedule of {span} steps"
    return line


def check_resumable(cfg: TrainConfig, root: str | Path, groups: Sequence[int] | None = None) -> Path:
    """Before any work: the series of every group in `groups` (default: the run's federation groups; a Flower group
    names its own) has a complete checkpoint of one common step, written by a compatible run; the first group's of
    the newest such step (the step every group resumes from)."""
    groups = list(range(cfg.parallel.federations) if groups is None else groups)
    held = [intact_steps(group_dir(root, f)) for f in groups]
    common = set.intersection(*(set(intact) for intact, _ in held))
    if not common:
        skipped = "; ".join(f"{'' if len(groups) == 1 else f'group {f}: '}{'; '.join(s)}"
                            for f, (_, s) in zip(groups, held) if s)
        what = (f"no complete checkpoint in {group_dir(root, groups[0])}" if len(groups) == 1 else
                f"no complete checkpoint of a step that every federation group holds, under {root} "
                f"({holdings([(f, list(intact)) for f, (intact, _) in zip(groups, held)])})")
        raise ConfigError(f"--resume: {what}" + (f" (skipped {skipped})" if skipped else ""))
    checkpoint = next(path for step, path in held[0][0].items() if step in common)  # group 0's preference
    check_compatible(cfg, checkpoint)
    return checkpoint
