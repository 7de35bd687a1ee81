"""Time to a target eval perplexity from a run's eval curve, and an FL run's compute utilisation."""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence


def time_to_target(curve: Sequence[Mapping[str, Any]], target_ppl: float) -> float | None:
    """The first training time at which the eval perplexity is at or below `target_ppl`, interpolated linearly in log
    perplexity (the eval loss) against time between the two eval points around it; the first point's time when that
    point is already there (nothing earlier to interpolate from); None when never reached. `curve`: a run's `eval`
    entries ({step, time_s, eval_ppl, ...}) in the order logged; points without a finite perplexity are skipped."""
    if not target_ppl or not math.isfinite(target_ppl) or target_ppl <= 0:
        return None
    goal, before = math.log(target_ppl), None
    for point in curve:
        ppl = point.get("eval_ppl")
        if ppl is None or not math.isfinite(ppl) or ppl <= 0:
            continue
        t, y = float(point["time_s"]), math.log(ppl)
        if y <= goal:
            if before is None or y == goal:
                return t
            t0, y0 = before
            return t0 + (t - t0) * (y0 - goal) / (y0 - y)
        before = (t, y)
    return None


def compute_utilisation(run: Mapping[str, Any], no_sync: Mapping[str, Any]) -> float | None:
    """The fraction of a run's wall time spent computing: the no-sync run's mean step time over the run's (the
    "vs no-sync (means)" column's times); None without both. Load noise can put it above 1."""
    mine, limit = run.get("step_s_mean"), no_sync.get("step_s_mean")
    return limit / mine if mine and limit else None
