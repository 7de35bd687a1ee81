"""Site-aware (two-level) reduction: federation members that share a site (a fast network behind one slow uplink)
reduce-scatter a bucket inside the site in fp32, all-reduce each member's 1/L share across the sites through the wire
(a quantized wire rounds only there, where the bytes cross the slow tier), and all-gather it inside the site.

With P members in G sites of L each and S bytes of fp32 shard, a flat ring sends 2 (P - 1) / P x S per member and
crosses every site's uplink with it; the two-level reduction sends 2 (G - 1) / G x S / L per member across sites,
the L members of a site each on 1/L of the shard (`flwr_sharded_perf.costmodel` prices both). With one site, or one
member per site, it is the flat ring, which then runs instead (`SiteLayout.two_level`). `SiteLayout` is torch-free
(the cost model and planner use it); the groups and the reduction import torch when used.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Callable, Sequence

from flwr_sharded.errors import ConfigError

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from flwr_sharded.parallel.workspace import Workspace


@dataclass(frozen=True)
class SiteLayout:
    """Which site each federation member is at (member index -> site: a name, or a cluster file's group index), and
    the groups it makes: G sites of L members each."""

    sites: tuple[Hashable, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "sites", tuple(self.sites))
        sizes = {name: self.sites.count(name) for name in self.names}
        if not sizes or len(set(sizes.values())) > 1:
            raise ConfigError(f"sync sites {','.join(map(str, self.sites))}: every site must hold as many federation "
                              f"members for a two-level reduction (members per site: "
                              f"{', '.join(f'{k}={v}' for k, v in sizes.items())})")

    @classmethod
    def parse(cls, text: str) -> SiteLayout:
        """From a comma-separated list of site names, one per member (e.g. "a,a,b,b")."""
        names = tuple(s.strip() for s in text.split(","))
        if not all(names):
            raise ConfigError(f"sync sites {text!r}: an empty site name")
        return cls(names)

    @classmethod
    def even(cls, G: int, L: int) -> SiteLayout:
        """G sites of L members: member i at site i // L."""
        if G < 1 or L < 1:
            raise ConfigError(f"sites: G and L must be >= 1, got G={G}, L={L}")
        return cls(tuple(i // L for i in range(G * L)))

    @property
    def names(self) -> list[Hashable]:
        """The sites in order of their first member."""
        return list(dict.fromkeys(self.sites))

    @property
    def G(self) -> int:
        """The number of sites."""
        return len(self.names)

    @property
    def L(self) -> int:
        """Members per site."""
        return len(self.sites) // self.G

    @property
    def members(self) -> int:
        """Members in all (G L)."""
        return len(self.sites)

    @property
    def two_level(self) -> bool:
        """Whether the reduction has two levels: more than one site and more than one member per site (else it is
        the flat ring)."""
        return self.G > 1 and self.L > 1

    def members_of(self, site: int) -> list[int]:
        """The member indices of site `site` (an index into `names`), in member order."""
        return [m for m, name in enumerate(self.sites) if name == self.names[site]]

    def position(self, member: int) -> tuple[int, int]:
        """(site index, index inside the site) of `member`."""
        site = self.names.index(self.sites[member])
        return site, self.members_of(site).index(member)

    def across(self, j: int) -> list[int]:
        """The j-th member of every site, in site order: the members that reduce share j across the sites."""
        return [self.members_of(g)[j] for g in range(self.G)]

    def site_rings(self) -> list[list[int]]:
        """The members of each site (the first level's groups)."""
        return [self.members_of(g) for g in range(self.G)]

    def cross_rings(self) -> list[list[int]]:
        """The j-th member of every site, for each j (the second level's groups)."""
        return [self.across(j) for j in range(self.L)]


@dataclass
class SiteGroups:
    """One rank's process groups of a two-level reduction over its federation group `flat`."""

    flat: dist.ProcessGroup
    """Every member (admission, votes and rules that need every member's shards run over it)."""
    site: dist.ProcessGroup
    """The members at this rank's site."""
    across: dist.ProcessGroup
    """The members holding the same share as this rank at every site."""
    layout: SiteLayout

    def reduce(self, flat: torch.Tensor, workspace: Workspace,
               sum_across: Callable[[torch.Tensor, torch.Tensor | None], int],
               residual: torch.Tensor | None = None) -> int:
        """SUM `flat` (fp32, this rank's weighted values) over every member in place: reduce-scatter inside the site,
        `sum_across(share, residual_share)` (the wire's sum over `across`, returning the bytes it sent) on this
        rank's share, all-gather inside the site. `residual`: the wire's error-feedback residual of `flat`, of which
        the share's part is passed on. Returns the bytes this rank sent."""
        import torch.distributed as dist

        from flwr_sharded.parallel.collectives import bounded
        from flwr_sharded.parallel.ring import ring_reduce_scatter
        from flwr_sharded.parallel.torch_compat import all_gather_single, reduce_scatter_single

        L, j, n = self.layout.L, dist.get_rank(self.site), flat.numel()
        part = -(-n // L)  # the share of each site member, the last padded with zeros
        whole = workspace.get("site_whole", part * L, flat.dtype, flat.device)
        share = workspace.get("site_share", part, flat.dtype, flat.device)
        whole[:n].copy_(flat)
        whole[n:].zero_()
        if dist.get_backend(self.site) == "gloo":  # gloo's own reduce-scatter sends as much as an all-reduce
            ring_reduce_scatter(whole, share, self.site, workspace)
        else:
            bounded(reduce_scatter_single, share, whole, group=self.site)
        lo, hi = min(j * part, n), min((j + 1) * part, n)
        sent = 2 * (L - 1) * part * flat.element_size()  # the site's reduce-scatter and all-gather (ring bytes)
        if hi > lo:  # the same on every member of `across` (equal sites): all of them reduce, or none
            sent += sum_across(share[:hi - lo], residual[lo:hi] if residual is not None else None)
        bounded(all_gather_single, whole, share, group=self.site)
        flat.copy_(whole[:n])
        return sent


def site_groups(layout: SiteLayout, columns: Sequence[Sequence[int]], column: int, member: int,
                flat: dist.ProcessGroup, timeout: timedelta) -> SiteGroups:
    """Build the site and share groups of every federation column (`columns`: for each shard index, the global ranks
    of its members in member order) with `new_group`, a collective of the world: every rank calls this alike. Returns
    those of this rank, member `member` of column `column`, whose federation group is `flat`."""
    import torch.distributed as dist

    made = []
    for ranks in columns:
        sites = [dist.new_group([ranks[m] for m in layout.members_of(g)], timeout=timeout)
                 for g in range(layout.G)]
        shares = [dist.new_group([ranks[m] for m in layout.across(j)], timeout=timeout) for j in range(layout.L)]
        made.append((sites, shares))
    g, j = layout.position(member)
    sites, shares = made[column]
    return SiteGroups(flat=flat, site=sites[g], across=shares[j], layout=layout)
