"""Site-aware (two-level) reduction: federation members that share a site (a fast network behind one slow uplink)
reduce-scatter a bucket inside the site in fp32, all-reduce each member's 1/L share across the sites through the wire
(a quantized wire rounds only there, where the bytes cross the slow tier), and all-gather it inside the site.

With P members in G sites of L each and S bytes of fp32 shard, a flat ring sends 2 (P - 1) / P x S per member and
crosses every site's uplink with it; the two-level reduction sends 2 (G - 1) / G x S / L per member across sites,
the L members of a site each on 1/L of the shard (`flwr_sharded_perf.costmodel` prices both). With one site, or one
member per site, it is the flat ring, which then runs instead (`SiteLayout.two_level`). `why_not_two_level` is the one
statement of when a sync may reduce in two levels. A top-k sync uses the site's reduce-scatter and all-gather around
its own exchange across sites (`flwr_sharded.parallel.sparse_sites`). `SiteLayout` is torch-free (the cost model and
planner use it); the groups and the reduction import torch when used.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Sequence

from flwr_sharded.errors import ConfigError

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from flwr_sharded.parallel.workspace import Workspace


def why_not_two_level(sites: Sequence[Hashable], members: int, *, alike: bool = True, linear: bool = True,
                      restart_residual: bool = False, flat_ok: bool = False,
                      term: tuple[str, str] = ("site", "sites")) -> str | None:
    """Why a sync over `members` federation members at `sites` (one per member, in member order; a falsy name: none
    named) cannot reduce in two levels; None: it can. It needs one named site per member, members that shard
    `alike`, a `linear` rule (a weighted mean: each site's weighted values are summed first), no residual restart
    (a member holds its site's residual of its share only), every site holding as many members, and, unless
    `flat_ok` (the flat ring then runs instead), two levels: more than one site and more than one member per site.
    `term`: the word for a site, singular and plural, that the reason uses (e.g. a Flower node's "facility")."""
    one, many = term
    if len(sites) != members:
        return f"it names {len(sites)} {one}(s) for {members} member(s): one per member"
    if not all(sites):
        return f"a member names no {one}"
    if not alike:
        return "its members shard differently"
    if not linear:
        return "its outer rule is not linear (it needs every member's shards, not a weighted mean)"
    if restart_residual:
        return (f"a residual restart puts a member's own residual into its shards, and in two levels a member holds "
                f"its {one}'s residual of its share only")
    why = unequal_sites(sites, term)
    if why is None and not flat_ok and not SiteLayout(tuple(sites)).two_level:
        why = f"it has one {one}, or one member per {one}"
    return why


def unequal_sites(sites: Sequence[Hashable], term: tuple[str, str] = ("site", "sites")) -> str | None:
    """Why `sites` (one per member) hold different numbers of members, naming each one's count; None: as many."""
    sizes = {name: list(sites).count(name) for name in dict.fromkeys(sites)}
    if sizes and len(set(sizes.values())) == 1:
        return None
    return (f"its {term[1]} hold different numbers of members ({', '.join(f'{k}={v}' for k, v in sizes.items())}), "
            f"and a two-level reduction needs as many federation members at each")


@dataclass(frozen=True)
class SiteLayout:
    """Which site each federation member is at (member index -> site: a name, or a cluster file's group index), and
    the groups it makes: G sites of L members each."""

    sites: tuple[Hashable, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "sites", tuple(self.sites))
        why = unequal_sites(self.sites)
        if why is not None:
            raise ConfigError(f"sync sites {','.join(map(str, self.sites))}: {why}")

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

        L, j, n = self.layout.L, dist.get_rank(self.site), flat.numel()
        part = -(-n // L)  # the share of each site member, the last padded with zeros
        whole = workspace.get("site_whole", part * L, flat.dtype, flat.device)
        share = workspace.get("site_share", part, flat.dtype, flat.device)
        whole[:n].copy_(flat)
        whole[n:].zero_()
        self.scatter(whole, share, workspace)
        lo, hi = min(j * part, n), min((j + 1) * part, n)
        sent = 2 * (L - 1) * part * flat.element_size()  # the site's reduce-scatter and all-gather (ring bytes)
        if hi > lo:  # the same on every member of `across` (equal sites): all of them reduce, or none
            sent += sum_across(share[:hi - lo], residual[lo:hi] if residual is not None else None)
        self.gather(whole, share)
        flat.copy_(whole[:n])
        return sent

    def topk(self, wire: Any, flat: torch.Tensor, global_k: torch.Tensor, scale: float, workspace: Workspace,
             residual: torch.Tensor | None) -> int:
        """A top-k wire's reduction (or its dense flush's) in two levels (`flwr_sharded.parallel.sparse_sites`);
        returns the bytes this rank sent."""
        from flwr_sharded.parallel.sparse_sites import reduce_two_level

        return reduce_two_level(wire, flat, global_k, scale, self, workspace, residual)

    def scatter(self, whole: torch.Tensor, share: torch.Tensor, workspace: Workspace) -> None:
        """SUM `whole` (L equal chunks, one per site member) over the site: this rank's chunk of the sum into `share`
        (on gloo around a ring of point-to-point sends: gloo's own reduce-scatter sends as much as an all-reduce)."""
        import torch.distributed as dist

        from flwr_sharded.parallel.collectives import bounded
        from flwr_sharded.parallel.ring import ring_reduce_scatter
        from flwr_sharded.parallel.torch_compat import reduce_scatter_single

        if dist.get_backend(self.site) == "gloo":
            ring_reduce_scatter(whole, share, self.site, workspace)
        else:
            bounded(reduce_scatter_single, share, whole, group=self.site)

    def gather(self, whole: torch.Tensor, share: torch.Tensor) -> None:
        """Every site member's `share` into `whole`, in site order."""
        from flwr_sharded.parallel.collectives import bounded
        from flwr_sharded.parallel.torch_compat import all_gather_single

        bounded(all_gather_single, whole, share, group=self.site)


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
