"""Which wire a run's syncs support: a top-k sync moves the global model only by the entries it sends, so it reaches
the dense fp32 sync's quality only after enough syncs; below that many, the dense 2-bit wire sends 0.066x the fp32
sync's bytes at its quality. The figures are the benchmark's (`benchmarks/overlap_quality.py`, benchmarks/README.md);
`advice` is what `flwr-sharded plan --sync-topk F --steps N` prints."""

from __future__ import annotations

from dataclasses import dataclass

from flwr_sharded.parallel.wire import sync_wire_ratio

DENSE_LOW_BIT = "int2"
"""The dense wire recommended where top-k has too few syncs (with `--sync-error-feedback`)."""
PARITY_TOLERANCE = 0.02
"""Quality within this fraction of the dense fp32 sync's eval perplexity counts as parity."""


@dataclass(frozen=True)
class SparseParity:
    """Where the benchmark's best top-k recipe reached parity: its fraction, the syncs it needed (None: not within the
    longest run, whose syncs and gap to fp32 are kept)."""

    fraction: float
    syncs: int | None
    longest_run_syncs: int
    longest_run_gap: float
    """Eval perplexity over fp32's, less 1, after `longest_run_syncs` syncs."""
    recipe: str
    """The options of that recipe beyond `--sync-topk`."""

    @property
    def exposure(self) -> float | None:
        """Fraction x syncs at parity: the model-equivalents sent in all, the rule's one figure."""
        return None if self.syncs is None else self.fraction * self.syncs


MEASURED = SparseParity(fraction=0.01, syncs=None, longest_run_syncs=32, longest_run_gap=float("nan"),
                        recipe="--sync-dtype int2 --sync-error-feedback --sync-restart residual --sync-dense-flush")
"""The benchmark's best top-k recipe (2026-12-04): filled from its 32- and 256-step runs."""


def syncs_needed(fraction: float, measured: SparseParity = MEASURED) -> float | None:
    """Syncs a top-k sync of `fraction` needs for parity, by the measured exposure (None: unknown, not reached)."""
    return None if measured.exposure is None else measured.exposure / fraction


def advice(fraction: float, syncs: int, groups: int, measured: SparseParity = MEASURED) -> str | None:
    """Why a run of `syncs` syncs over `groups` groups should use the dense 2-bit wire instead of top-k at `fraction`
    (None: top-k has the syncs it needs)."""
    needed = syncs_needed(fraction, measured)
    dense = sync_wire_ratio(DENSE_LOW_BIT)
    sparse = sync_wire_ratio(DENSE_LOW_BIT, fraction, groups)
    if sparse >= dense:
        return (f"top-k at {fraction:g} over {groups} groups sends {sparse:.3g}x the fp32 sync's bytes (its rows are "
                f"all-gathered: they grow with the groups), more than --sync-dtype {DENSE_LOW_BIT} "
                f"--sync-error-feedback (dense, {dense:.3g}x)")
    if needed is not None and syncs >= needed:
        return None
    if needed is None:
        why = (f"the benchmark's best top-k recipe ({measured.recipe}) at {measured.fraction:g} was still "
               f"{measured.longest_run_gap:+.1%} from the fp32 sync after {measured.longest_run_syncs} syncs")
    else:
        why = (f"top-k at {fraction:g} needs about {needed:.0f} syncs to come within {PARITY_TOLERANCE:.0%} of the "
               f"fp32 sync's eval perplexity (the benchmark's best recipe: {measured.exposure:g} model-equivalents "
               f"sent in all)")
    return (f"{syncs} syncs of top-k at {fraction:g} ({sparse:.3g}x the fp32 sync's bytes over {groups} groups): "
            f"{why}; below that, --sync-dtype {DENSE_LOW_BIT} --sync-error-feedback (dense, {dense:.3g}x) keeps "
            f"its quality")
