"""Test-only: this process plays a member that lies about its own verdict (nothing in the package can do this).

Put this directory first on the PYTHONPATH of a group's (or a static world's) ranks and set
FLWR_SHARDED_TEST_LIE="VALUE@ATTEMPTS[@RANKS]", e.g. "1e30@2", "nan@1,2,3" or "1e30@2@2" (several joined by ";",
e.g. "1e30@2;nan@3,4"): before each listed sync attempt (1 = the first fragment sync this rank attempts), the rank overwrites that fragment's shards with VALUE
(a number, or "x100": its own values times 100) and reports itself healthy whatever they hold, so admission admits
it. RANKS (global ranks, comma-separated) limits the lie to those ranks of a static world. Everything else is the
package's own code: the honest members, and the liar's own part of the vote and of the offender search.
"""

from __future__ import annotations

import os


def _install(specs: str) -> None:
    import torch

    from flwr_sharded.parallel import sync
    from flwr_sharded.parallel.sync import local_shard
    from flwr_sharded.training import outer_loop

    lies: dict[int, str] = {}  # attempt -> value
    for spec in specs.split(";"):
        value, _, rest = spec.partition("@")
        attempts_text, _, ranks = rest.partition("@")
        if not ranks or os.environ.get("RANK", "0") in ranks.split(","):
            lies.update({int(a): value for a in attempts_text.split(",")})
    if not lies:
        return
    honest, lying = sync.healthy, [False]

    def healthy(*args):  # noqa: ANN002 - the patched function's own arguments
        return True if lying[0] else honest(*args)

    sync.healthy = healthy

    @torch.no_grad()
    def poison(loop: outer_loop.OuterLoop, i: int, value: str) -> None:
        for param in loop.sync.fragments[i].params:
            shard = local_shard(param)
            shard.mul_(100.0) if value == "x100" else shard.fill_(float(value))

    merge, start_flight = outer_loop.OuterLoop.merge, outer_loop.OuterLoop.start_flight
    started = [0]

    def lying_merge(self, i, federation, **kwargs):  # noqa: ANN001
        if self.schedule.delay == 0 and self.attempts + 1 in lies:
            poison(self, i, lies[self.attempts + 1])
            lying[0] = True
        try:
            return merge(self, i, federation, **kwargs)
        finally:
            lying[0] = False

    def lying_start(self, i):  # noqa: ANN001 - an overlapped sync's snapshot and verdict are taken at its start
        started[0] += 1
        lie = started[0] in lies
        if lie:
            poison(self, i, lies[started[0]])
            lying[0] = True
        try:
            return start_flight(self, i)
        finally:
            lying[0] = False

    outer_loop.OuterLoop.merge, outer_loop.OuterLoop.start_flight = lying_merge, lying_start


if os.environ.get("FLWR_SHARDED_TEST_LIE") and "LOCAL_RANK" in os.environ:
    _install(os.environ["FLWR_SHARDED_TEST_LIE"])
