"""Top-k in two levels (`--sync-topk` with `--sync-sites`): the site's members reduce-scatter their weighted deltas
(and their weight shares) in fp32 inside the site, each member then selects the top entries of its 1/L share of the
site's sum as the flat top-k selects a member's delta (`sparse.contribute`, chunks counted from the share's start),
all-gathers that one row with the members holding the same share at the other sites (`sites.SiteGroups.across`;
`sites`, a `SiteGroups`, calls this module and is typed Any here), merges
the G rows as the flat top-k merges W (`scatter-mean` or `sum`), and the site all-gathers the merged shares.

Per sync a member sends (G - 1) rows of its share across sites, each about 1/L of a flat top-k row; the flat
all-gather sends every row to each of the (G - 1) L members at the other sites. What member j sends of share j is its
site's: `scatter-mean` selects from the site's weighted mean delta D / S_g (S_g the site's weight share) plus the
decayed residual and heads its row with S_g; `sum` from the weighted sum D plus the decayed residual. Member j's
error-feedback residual holds what its site did not send of share j (zeros elsewhere), also while member j itself is
left out (it still selects its site's share); a sync that leaves out every member of a site keeps the residual of
each of its shares as it was. A dense flush
(`DenseFlush`) sends the share's weighted sum plus its weighted residual through the values wire's sum across sites.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flwr_sharded.parallel.sparse import (DenseFlush, MergedRows, RowLayout, SparseWire, accumulate, contribute,
                                         scatter_mean)

if TYPE_CHECKING:
    import torch

    from flwr_sharded.parallel.workspace import Workspace


class _Share:
    """This member's share of a site's weighted delta: [lo, hi) of the bucket, the site's sum of it and its weight."""

    def __init__(self, delta: torch.Tensor, scale: float, sites: Any, workspace: Workspace) -> None:
        import torch.distributed as dist

        L, n = sites.layout.L, delta.numel()
        self.sites, self.n, self.part = sites, n, -(-n // L)  # the last share is padded with zeros
        stride = self.part + 1  # each chunk ends with its member's weight share: the reduce-scatter sums S_g too
        self.whole = workspace.get("site_topk_whole", stride * L, delta.dtype, delta.device)
        self.share = workspace.get("site_topk_share", stride, delta.dtype, delta.device)
        chunks = self.whole.view(L, stride)
        chunks.zero_()
        for i in range(L):
            chunks[i, :self.bounds(i)[1] - self.bounds(i)[0]].copy_(delta[slice(*self.bounds(i))]).mul_(scale)
        chunks[:, self.part].fill_(scale)
        sites.scatter(self.whole, self.share, workspace)
        self.lo, self.hi = self.bounds(dist.get_rank(sites.site))
        self.values = self.share[:self.hi - self.lo]
        """The site's weighted delta on this share (D), in place: later the share's result."""
        self.weight = float(self.share[self.part])
        """S_g: the sum of the site members' weight shares."""

    def bounds(self, i: int) -> tuple[int, int]:
        """[lo, hi) of site member i's share of the bucket."""
        return min(i * self.part, self.n), min((i + 1) * self.part, self.n)

    @property
    def sent(self) -> int:
        """Bytes this member sent inside the site: the ring reduce-scatter's and the all-gather's."""
        return 2 * (self.sites.layout.L - 1) * self.share.numel() * self.share.element_size()

    def gather(self, flat: torch.Tensor) -> None:
        """`flat` = every site member's share of the result (this one's in `values`), alike on all of them."""
        self.sites.gather(self.whole, self.share)
        chunks = self.whole.view(self.sites.layout.L, self.part + 1)
        for i in range(self.sites.layout.L):
            lo, hi = self.bounds(i)
            flat[lo:hi].copy_(chunks[i, :hi - lo])


def _residual_share(residual: torch.Tensor | None, share: _Share) -> torch.Tensor | None:
    """The share's part of this member's residual, the rest zeroed (it is the other site members'); None where
    there is none, or the site sends nothing this time (it is kept as it is)."""
    if residual is None or share.weight == 0.0:
        return None
    residual[:share.lo].zero_()
    residual[share.hi:].zero_()
    return residual[share.lo:share.hi]


def reduce_two_level(wire: SparseWire | DenseFlush, flat: torch.Tensor, global_k: torch.Tensor, scale: float,
                     sites: Any, workspace: Workspace, residual: torch.Tensor | None) -> int:
    """`wire.reduce` in two levels: the top-k selection (`reduce_topk`) or the dense flush (`reduce_flush`)."""
    if isinstance(wire, DenseFlush):
        return reduce_flush(wire, flat, global_k, scale, sites, workspace, residual)
    if isinstance(wire, SparseWire):
        return reduce_topk(wire, flat, global_k, scale, sites, workspace, residual)
    raise TypeError(f"{type(wire).__name__} is not a top-k wire")


def reduce_topk(wire: SparseWire, flat: torch.Tensor, global_k: torch.Tensor, scale: float, sites: Any,
                workspace: Workspace, residual: torch.Tensor | None) -> int:
    """`SparseWire.reduce` in two levels (module docstring): `flat` holds this rank's values (zeros if `scale` is
    0), on return global_k plus the merged rows of every site, bit-identical on every member. Returns the bytes
    this rank sent."""
    import torch
    import torch.distributed as dist

    from flwr_sharded.parallel.collectives import bounded
    from flwr_sharded.parallel.torch_compat import all_gather_single

    if scale:
        flat.sub_(global_k)
    share = _Share(flat, scale, sites, workspace)
    sent, x = share.sent, share.values
    if x.numel():  # the same on every member of `across`: all of them exchange, or none
        if wire.merge != "sum" and share.weight:
            x.div_(share.weight)  # the site's weighted mean delta
        layout, dev = RowLayout(x.numel(), wire.fraction, wire.values), x.device
        mine = workspace.get("site_topk_mine", layout.bytes, torch.uint8, dev)
        scratch = workspace.get("site_topk_magnitude", x.numel(), torch.float32, dev)
        contribute(x, _residual_share(residual, share), layout, mine, scratch, share.weight, merge="scatter-mean",
                   decay=wire.decay)  # "scatter-mean": x is weighted already (or a mean), the header is S_g
        G = dist.get_world_size(sites.across)
        rows = workspace.get("site_topk_rows", G * layout.bytes, torch.uint8, dev).view(G, layout.bytes)
        bounded(all_gather_single, rows.view(-1), mine, group=sites.across)
        base = global_k[share.lo:share.hi]
        if wire.merge == "sum":
            norms = accumulate(x, rows, layout, base=base)
        else:
            norms = scatter_mean(x, rows, layout, base, scratch)
        wire.merged = MergedRows.of(norms, rows, wire.merge)  # the sites' rows of this share
        sent += (G - 1) * layout.bytes
    share.gather(flat)
    return sent


def reduce_flush(flush: DenseFlush, flat: torch.Tensor, global_k: torch.Tensor, scale: float, sites: Any,
                 workspace: Workspace, residual: torch.Tensor | None) -> int:
    """`DenseFlush.reduce` in two levels: every entry of the share's weighted sum plus its weighted residual
    (`scatter-mean`: S_g x the residual) through the values wire's sum across the sites; the share's residual then
    holds that wire's rounding errors (`scatter-mean`: over S_g). Returns the bytes this rank sent."""
    top = flush.top
    if scale:
        flat.sub_(global_k)
    share = _Share(flat, scale, sites, workspace)
    sent, x = share.sent, share.values
    if x.numel():
        mine = _residual_share(residual, share)
        if mine is not None:
            x.add_(mine, alpha=top.decay * (share.weight if top.merge != "sum" else 1.0))
            mine.zero_()
        feedback = mine if top.values.error_feedback else None
        sent += top.values.sum(x, sites.across, workspace, feedback)
        if feedback is not None and top.merge != "sum":
            feedback.div_(share.weight)
        x.add_(global_k[share.lo:share.hi])
    share.gather(flat)
    return sent
