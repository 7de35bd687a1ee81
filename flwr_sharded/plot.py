"""`flwr-sharded plot RUN_DIR [RUN_DIR ...] -o FILE.png`: train and eval perplexity of runs against wall-clock time
and against tokens, so methods can be compared (static runs per logged step, Flower runs per round); the legend,
under the axes, names each run by its directory, method, and for FL methods A, the wire dtype and the fragments."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from flwr_sharded.errors import ConfigError
from flwr_sharded.run_dir import CONFIG, read_records

Curve = tuple[list[float], list[float], list[float]]
"""(elapsed seconds, tokens seen, perplexity) of one series."""


def curves(run_dir: str | Path) -> dict[str, Curve]:
    """'train' and 'eval' perplexity series of one run directory (empty series are left out)."""
    series: dict[str, Curve] = {"train": ([], [], []), "eval": ([], [], [])}
    for r in read_records(run_dir):
        points = {"train": [("train", r.get("ppl"))], "eval": [("eval", r.get("eval_ppl"))],
                  "round": [("train", r.get("train_ppl")), ("eval", r.get("eval_ppl"))]}.get(r.get("kind"), [])
        for name, ppl in points:
            if ppl is not None and "elapsed_s" in r and "tokens_seen" in r:
                for values, x in zip(series[name], (r["elapsed_s"], r["tokens_seen"], ppl)):
                    values.append(float(x))
    return {name: c for name, c in series.items() if c[0]}


def label(run_dir: str | Path) -> str:
    """The run's directory name and what tells runs apart: the method, Flower's aggregation path, and for FL methods
    A, the sync's wire dtype and fragments (from config.json; defaults where it predates a key)."""
    path = Path(run_dir)
    try:
        config: dict[str, Any] = json.loads((path / CONFIG).read_text())
    except (OSError, json.JSONDecodeError):
        return path.name
    flower = "train" in config
    p = (config["train"] if flower else config).get("parallel", {})
    method = p.get("method", "?")
    parts = [f"{method} (Flower, {config.get('federation', {}).get('aggregation', 'decentralized')})" if flower
             else method]
    if method.startswith("fl-"):
        fragments = int(p.get("sync_fragments", 1))
        parts += [f"A={p['aggregate_every']}"] if "aggregate_every" in p else []
        parts.append(f"{p.get('sync_dtype', 'float32')} wire" + (f", {fragments} fragments" if fragments > 1 else ""))
    return f"{path.name}: {', '.join(parts)}"


def plot(run_dirs: list[str | Path], out: str | Path) -> Path:
    """Write a 2 x 2 figure (train/eval perplexity against time/tokens) of the runs to `out`."""
    import matplotlib.pyplot as plt

    fig = figure(run_dirs)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def figure(run_dirs: list[str | Path]) -> Any:
    """The 2 x 2 matplotlib figure of `plot`, with one legend entry per run under the axes."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("plot needs matplotlib: pip install 'flwr_sharded[plot]'") from exc
    data = [(label(d), curves(d)) for d in run_dirs]
    if not any(c for _, c in data):
        raise ConfigError(f"none of {', '.join(map(str, run_dirs))} has perplexity records to plot")
    rows = max(1, math.ceil(len(data) / 2))  # the legend goes under the axes, two runs a row: it covers no curve
    fig, axes = plt.subplots(2, 2, figsize=(12, 8 + 0.3 * rows), sharey="row")
    for row, kind in enumerate(("train", "eval")):
        for col, (axis, name) in enumerate(((0, "wall-clock time (s)"), (1, "tokens seen"))):
            ax = axes[row][col]
            for text, series in data:
                if kind in series:
                    ax.plot(series[kind][axis], series[kind][2], marker="." if kind == "eval" else None, label=text)
            ax.set_xlabel(name)
            ax.set_ylabel(f"{kind} perplexity")
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
    legend = {}  # one entry per run, from whichever axes drew it
    for ax in axes.flat:
        legend.update({text: handle for handle, text in zip(*ax.get_legend_handles_labels()) if text not in legend})
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=min(2, len(legend)), fontsize="small",
               frameon=False)
    fig.tight_layout(rect=(0, 0.04 * rows + 0.01, 1, 1))
    return fig


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("plot", help="plot train/eval perplexity of run directories against time and "
                                                "tokens", description=__doc__)
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (with metrics.jsonl)")
    parser.add_argument("-o", "--out", required=True, metavar="FILE.png", help="the figure to write")
    parser.set_defaults(func=_run_plot)


def _run_plot(args: argparse.Namespace) -> int:
    try:
        print(f"wrote {plot(args.run_dirs, args.out)}")
    except ConfigError as exc:
        print(f"flwr-sharded plot: error: {exc}", file=sys.stderr)
        return 2
    return 0
