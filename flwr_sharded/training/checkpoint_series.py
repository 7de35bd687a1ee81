"""A checkpoint series on disk, one per federation group in `DIR/group-<f>/`: its names (`step-N/`, `step-N.tmp/`
being written, `step-N.old/` left by a commit cut short, `latest` naming the newest committed one), and which of its
checkpoints are complete, preferred first (`checkpoint_files.incomplete_reason` tells a complete one)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from flwr_sharded.training import checkpoint_files

LATEST = "latest"
TMP, OLD = ".tmp", ".old"


def group_dir(root: str | Path, fed_index: int) -> Path:
    return Path(root) / f"group-{fed_index}"


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(path: Path) -> int | None:
    """The step of a committed (`step-N`) or mid-commit (`step-N.old`) checkpoint directory; None otherwise."""
    name = path.name[:-len(OLD)] if path.name.endswith(OLD) else path.name
    if not name.startswith("step-") or not name[5:].isdigit():
        return None
    return int(name[5:])


def candidates(directory: str | Path) -> list[Path]:
    """The checkpoints of a series that may be complete, preferred first: the one `latest` names, then the others
    (`step-N/`, and `step-N.old/` left by a commit cut short), newest step first."""
    directory = Path(directory)
    out: list[Path] = []
    try:
        named = (directory / LATEST).read_text().strip()
    except OSError:
        named = ""
    if named and step_of(Path(named)) is not None and "/" not in named:
        out.append(directory / named)
    others = [p for p in directory.glob("step-*") if step_of(p) is not None and p.is_dir()]
    others.sort(key=lambda p: (step_of(p), not p.name.endswith(OLD)), reverse=True)
    return out + [p for p in others if p not in out]


def find_checkpoint(directory: str | Path) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint of a series (`candidates` order), and what was skipped on the way and why."""
    skipped = []
    for path in candidates(directory):
        reason = checkpoint_files.incomplete_reason(path)
        if not reason:
            return path, skipped
        skipped.append(f"{path.name} ({reason})")
    return None, skipped


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete checkpoint of one group's series, or None."""
    return find_checkpoint(directory)[0]


def intact_steps(directory: str | Path) -> tuple[dict[int, Path], list[str]]:
    """Every step of a series that has a complete checkpoint, preferred first (`candidates` order: the one `latest`
    names, then the newest), each with its preferred directory; and what was skipped and why."""
    intact: dict[int, Path] = {}
    skipped: list[str] = []
    for path in candidates(directory):
        step = step_of(path)
        if step is None or step in intact:
            continue
        reason = checkpoint_files.incomplete_reason(path)
        if reason:
            skipped.append(f"{path.name} ({reason})")
        else:
            intact[step] = path
    return intact, skipped


def holdings(held: Sequence[tuple[int, Sequence[int]]]) -> str:
    """What each federation group holds, for an error: `held` is (group index, its intact steps) per rank."""
    by_group = {f: sorted(steps, reverse=True) for f, steps in held}
    return "; ".join(f"group {f}: {', '.join(map(str, steps)) or 'none'}" for f, steps in sorted(by_group.items()))
