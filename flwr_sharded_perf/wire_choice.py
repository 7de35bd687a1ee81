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
    """Where a top-k sync of the benchmark reached parity: its fraction and the syncs it needed (None: not within the
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


MEASURED = SparseParity(fraction=0.10, syncs=32, longest_run_syncs=32, longest_run_gap=0.0067,
                        recipe="--sync-dtype int8 --sync-error-feedback --sync-topk-merge sum --sync-error-decay 1")
"""Where the benchmark saw top-k at parity (benchmarks/README.md, 2026-12-02 and 2026-12-04): top-10% after 32
syncs, +0.67% (3.2 model-equivalents sent); at 0.32 of them (top-1% x 32 syncs) the best recipe (SparseLoCo's
merge, the restart at the residual without decay, a dense flush) was still +4.9%, and +11.6% after 64 syncs; at 0.64
with top-2% and the sum merge, +13.7%."""


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
        why = (f"top-k ({measured.recipe}) at {measured.fraction:g} was still "
               f"{measured.longest_run_gap:+.1%} from the fp32 sync after {measured.longest_run_syncs} syncs")
    else:
        why = (f"top-k at {fraction:g} needs about {needed:.0f} syncs to come within {PARITY_TOLERANCE:.0%} of the "
               f"fp32 sync's eval perplexity (the benchmark's: {measured.exposure:g} model-equivalents sent in all)")
    return (f"{syncs} syncs of top-k at {fraction:g} ({sparse:.3g}x the fp32 sync's bytes over {groups} groups): "
            f"{why}; below that, --sync-dtype {DENSE_LOW_BIT} --sync-error-feedback (dense, {dense:.3g}x) keeps "
            f"its quality")
