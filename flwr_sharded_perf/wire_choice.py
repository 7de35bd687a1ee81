"""Which wire a run's syncs support: a top-k sync moves the global model only by the entries it sends, so it reaches
the dense fp32 sync's quality only after enough syncs; below that many, the dense 2-bit wire sends 0.066x the fp32
sync's bytes at its quality. The figures are the benchmark's (`benchmarks/overlap_quality.py`, benchmarks/README.md):
top-k recommended only where a measurement at no larger a fraction reached parity in as many syncs; `advice` is what
`flwr-sharded plan --sync-topk F --steps N` prints."""

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


MEASURED = (
    SparseParity(fraction=0.10, syncs=32, longest_run_syncs=32, longest_run_gap=0.0067,
                 recipe="--sync-dtype int8 --sync-error-feedback --sync-topk-merge sum --sync-error-decay 1"),
    SparseParity(fraction=0.02, syncs=None, longest_run_syncs=32, longest_run_gap=0.137,
                 recipe="--sync-dtype int8 --sync-error-feedback --sync-topk-merge sum"),
    SparseParity(fraction=0.01, syncs=None, longest_run_syncs=256, longest_run_gap=0.121,
                 recipe="--sync-dtype int2 --sync-error-feedback --sync-restart residual --sync-dense-flush "
                        "--sync-error-decay 1"),
)
"""What the benchmark saw of top-k against the fp32 sync (benchmarks/README.md, 2026-12-02 to 2026-12-05): top-10%
at parity after 32 syncs (+0.67%, 3.2 model-equivalents sent); top-2% +13.7% after 32; top-1% with the best recipe
(SparseLoCo's merge, the restart at the residual without decay, a dense flush) +4.9% after 32 syncs, +11.6% after
64 and +12.1% after 256 (2,048 steps); with A = 2, +9.1% after 128 syncs and +15.7% after 256 (512 steps): the
exposure that brought 10% to parity does not bring 1% there, at any sync count measured."""


def syncs_needed(fraction: float, measured: tuple[SparseParity, ...] = MEASURED) -> float | None:
    """Syncs a top-k sync of `fraction` needs for parity: the fewest by the exposure of a measurement at parity with
    no larger a fraction (sending more each sync needs no more syncs); None where none reached parity."""
    reached = [p.exposure / fraction for p in measured if p.exposure is not None and p.fraction <= fraction]
    return min(reached, default=None)


def _evidence(fraction: float, measured: tuple[SparseParity, ...]) -> SparseParity:
    """The measurement that says most about a `fraction` with no parity in sight: the longest run that did not reach
    it at no smaller a fraction (a lower bound on the syncs), else the closest fraction."""
    unreached = [p for p in measured if p.syncs is None]
    bounding = [p for p in unreached if p.fraction >= fraction]
    if bounding:
        return max(bounding, key=lambda p: (p.longest_run_syncs, -p.fraction))
    return max(unreached, key=lambda p: p.fraction)


def advice(fraction: float, syncs: int, groups: int, measured: tuple[SparseParity, ...] = MEASURED) -> str | None:
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
        seen = _evidence(fraction, measured)
        why = (f"no top-k at {fraction:g} or below reached the fp32 sync's eval perplexity in the benchmark: top-k "
               f"at {seen.fraction:g} ({seen.recipe}) was still {seen.longest_run_gap:+.1%} from it after "
               f"{seen.longest_run_syncs} syncs")
    else:
        why = (f"top-k at {fraction:g} needs about {needed:.0f} syncs to come within {PARITY_TOLERANCE:.0%} of the "
               f"fp32 sync's eval perplexity (the benchmark's: {needed * fraction:g} model-equivalents sent in all)")
    return (f"{syncs} syncs of top-k at {fraction:g} ({sparse:.3g}x the fp32 sync's bytes over {groups} groups): "
            f"{why}; --sync-dtype {DENSE_LOW_BIT} --sync-error-feedback (dense, {dense:.3g}x) keeps its quality")
