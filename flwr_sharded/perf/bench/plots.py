"""The benchmark's plots: time to perplexity and the sweep of A."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flwr_sharded.perf.bench.layouts import LABELS


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """time_to_ppl.png (training perplexity against training time, like the paper's Figure 2) and a_sweep.png."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install 'flwr_sharded[plot]')")
        return []
    main = results["scenarios"].get("main")
    if main is None:
        return []
    written: list[Path] = []

    def save(fig: Any, ax: Any, name: str) -> None:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        written.append(out_dir / name)

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, r in main["runs"].items():
        line, = ax.plot([p["time_s"] for p in r["train"]], [p["ppl"] for p in r["train"]],
                        "--" if key == "no-sync" else "-", label=LABELS[key], marker=".")
        if r["eval"]:
            ax.plot([e["time_s"] for e in r["eval"]], [e["eval_ppl"] for e in r["eval"]], "x", color=line.get_color(),
                    markersize=8)
    ax.set_yscale("log")
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("training perplexity (x: evaluation)")
    ax.set_title(f"{main['topology']['name']}: {results['settings']['model']}, same samples, "
                 f"A={results['settings']['aggregate_every']}")
    save(fig, ax, "time_to_ppl.png")
    if main.get("sweep"):
        fig, ax = plt.subplots(figsize=(6, 3.6))
        As = [r["A"] for r in main["sweep"]]
        ax.plot(As, [r["step_s_mean"] for r in main["sweep"]], "o-", label="FL+FSDP s/step")
        ax.plot(As, [max(r["sync_s_mean"], 1e-4) for r in main["sweep"]], "s--", label="of which sync (s/step)")
        if "no-sync" in main["runs"]:
            ax.axhline(main["runs"]["no-sync"]["step_s_mean"], linestyle="--", color="gray", label="no-sync limit")
        if "fsdp" in main["runs"]:
            ax.axhline(main["runs"]["fsdp"]["step_s_mean"], linestyle=":", color="red", label="FSDP")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(As, [str(a) for a in As])
        ax.set_xlabel("A (steps between syncs)")
        ax.set_ylabel("seconds per step")
        save(fig, ax, "a_sweep.png")
    return written
