"""Peak memory of `ServerShardFedAvg` over a round (the chunked stream of pulls, means and applies), in a fresh process.

`python -m tests.flower.server_strategy_memory F MIB BUFFER_MIB [RULE]`: F fake groups (S = 2, in this process, on
the fake grid of `test_server_strategy`) hold a MIB-MiB fp32 model each (32 parameters); the strategy runs 2 rounds
with `server-buffer-mb` BUFFER_MIB and `server-rule` RULE (default mean). Prints one JSON line with the per-round
figures of `benchmarks.server_memory_flower.PeakMemoryServerShardFedAvg` (`server_peak_x`: peak RSS over the RSS
before round 1, in fp32 models). The
replies' bytes are made in this process, as a real server would receive them; the groups' models exist before the
baseline.
"""

from __future__ import annotations

import json
import sys

from flwr.supercore.task_identity import TaskIdentity

from benchmarks.server_memory_flower import PeakMemoryServerShardFedAvg
from tests.flower import test_server_strategy as fake
from tests.flower.test_strategy import FakeGrid, fast, make, spec


class _Grid(FakeGrid):
    def push_messages(self, messages):
        ids = super().push_messages(messages)
        self.pushed.clear()  # the fake keeps no history here
        return ids


class _Group(fake.FakeGroup):
    def __call__(self, m):
        out = super().__call__(m)
        self.received.clear()
        return out


def measure(F: int, mib: int, buffer_mb: float, rule: str = "mean") -> dict:
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    fake.SHAPES = {f"p{i}": (mib * 2**20 // (32 * 4 * 1024), 1024) for i in range(32)}
    groups = [_Group(i + 1, i, fake.model(i), None, shards=2) for i in range(F)]
    strategy = make(spec(rounds=2, syncs_per_round=1, aggregation="server", server_buffer_mb=buffer_mb,
                         server_rule=rule),
                    fast(num_groups=F, round_timeout=120), PeakMemoryServerShardFedAvg)
    strategy.start(_Grid({g.node: g for g in groups}))
    rounds = [r for r in strategy.history if r.get("kind") == "round"]
    return {"F": F, "model_mib": mib, "buffer_mib": buffer_mb, "rule": rule,
            "server_peak_x": [r["server_peak_x"] for r in rounds],
            "pull_chunks": rounds[-1]["pull_chunks"], "apply_chunks": rounds[-1]["apply_chunks"],
            "accepted": [r["facility_replies"] for r in rounds]}


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), *sys.argv[4:5])))
