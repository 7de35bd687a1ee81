"""ServerShardFedAvg against the in-process fake Grid: manifests, the chunked stream of pulls and applies, bad chunks.

Each fake group holds a model cut into its own pieces (S = 2 or S = 1); it announces them in its train reply, serves
the rows the server pulls, and keeps the chunks of the mean it is sent (a pass's chunk 0 discards those of an
earlier pass, as the ClientApp does). No processes, no torch in the groups.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np
import pytest
from flwr.app import Message, RecordDict

from flwr_sharded.flower import shard_files
from flwr_sharded.flower import messages as P
from flwr_sharded.flower.run_config import FlowerRun
from flwr_sharded.flower.server import stream
from flwr_sharded.flower.server.server_path_strategy import ServerShardFedAvg
from tests.flower.test_strategy import FakeGrid, config, fast, hello_ok, make, reply, spec, task_identity, train_ok

__all__ = ["task_identity"]  # the autouse fixture, imported to be active here

SHAPES = {"w": (10, 6), "b": (5,)}


def model(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}


def cut(values: dict[str, np.ndarray], shards: int) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """FSDP2's row chunks of every parameter over `shards` ranks, as hand-off pieces and their tags."""
    arrays, meta = {}, {}
    for name, value in values.items():
        step = -(-value.shape[0] // shards)
        for start in range(0, value.shape[0], step):
            arrays[f"{name}@{start}"] = value[start:start + step]
            meta[f"{name}@{start}"] = f"float32|{','.join(map(str, value.shape))}"
    return arrays, meta


class FakeGroup:
    """A facility of one group: its model, the chunks of the mean it received, and an optional corruption.

    `tokens`: the weight it reports; None: the tokens it trained on, as a real group counts them (the run's K x A
    steps of batch x grad-accum x seq-len tokens on each of its ranks, summed over its facility's members, which
    all share its S), read from the run in the hello."""

    def __init__(self, node: int, partition: int, values: dict[str, np.ndarray], tokens: float | None, shards: int,
                 corrupt: Callable[[int, dict[str, np.ndarray]], None] | None = None,
                 manifest: Callable[[RecordDict], None] | None = None, fail_in_round: int = 0) -> None:
        self.node, self.partition, self.values, self.tokens, self.shards = node, partition, values, tokens, shards
        self.weight = 0.0
        self.per_rank_round = 0
        self.arrays, self.meta = cut(values, shards)
        self.corrupt, self.edit_manifest, self.fail_in_round = corrupt, manifest, fail_in_round
        self.pulls = 0
        self.passes = 0
        self.applies = 0
        self.received: list[tuple[dict[str, np.ndarray], dict[str, str]]] = []

    def __call__(self, m: Message) -> tuple[float, Any]:
        kind, cfg = m.metadata.message_type, config(m)
        if kind == P.MSG_HELLO:
            run = FlowerRun.from_json(cfg["run"])
            self.per_rank_round = (run.federation.syncs_per_round * run.train.parallel.aggregate_every
                                   * run.train.batch_size * run.train.grad_accum * run.train.data.seq_len)
            return 0.0, hello_ok(self.node, shards=self.shards, fingerprint=f"S{self.shards}",
                                 partition=self.partition)
        if kind == P.MSG_TRAIN and cfg["server-round"] == self.fail_in_round:
            return 0.0, reply(False, "lost the connection to the group")
        if kind == P.MSG_TRAIN:
            members = len(cfg["members"])
            self.weight = float(self.per_rank_round * self.shards * members if self.tokens is None else self.tokens)
            content = train_ok(tokens=self.per_rank_round * self.shards, checksums=[0.0] * self.shards,
                               facility_tokens=self.weight)
            if not cfg["export"]:
                return 0.0, content
            shapes = {k: v.shape for k, v in self.arrays.items()}
            for name, record in shard_files.manifest_records(shapes, self.meta, cfg["server-round"],
                                                         self.weight).items():
                content[name] = record
            if self.edit_manifest:
                self.edit_manifest(content)
            return 0.0, content
        if kind == P.MSG_PULL and shard_files.SHARDS in m.content:  # an apply chunk riding with the pull
            self.apply(m, cfg)
        if kind == P.MSG_PULL:
            self.pulls += 1
            rows = {}
            for text in cfg["pieces"]:
                key, a, b = text.rsplit("|", 2)
                rows[shard_files.row_key(key, int(a))] = self.arrays[key][int(a):int(b)].copy()
            if self.corrupt:
                self.corrupt(self.pulls, rows)
            meta = {k: self.meta[f"{k.rpartition('@')[0]}@0"] for k in rows}
            return 0.0, RecordDict(shard_files.shard_records(rows, meta, cfg["server-round"], self.weight))
        if kind == P.MSG_APPLY:
            self.apply(m, cfg)
            last = cfg["chunk"] == cfg["chunks"] - 1
            return 0.0, reply(checksums=[0.0] * self.shards) if last else reply(chunk=cfg["chunk"])
        if kind == P.MSG_FINISH:
            return 0.0, reply(stopped=1)
        return 0.0, reply()

    def apply(self, m: Message, cfg: dict) -> None:
        arrays, meta, _ = shard_files.from_records(m.content)
        if cfg["chunk"] == 0:
            self.received.clear()
            self.passes += 1
        self.received.append((arrays, meta))
        self.applies += 1

    def adopted(self) -> dict[str, np.ndarray]:
        """The mean this group was sent, whole: its own pieces assembled from every chunk."""
        out = {}
        for name, shape in SHAPES.items():
            parts = sorted((int(k.rpartition("@")[2]), v) for arrays, _ in self.received for k, v in arrays.items()
                           if k.rpartition("@")[0] == name)
            assert sum(len(v) for _, v in parts) == shape[0], (name, [o for o, _ in parts])
            out[name] = np.concatenate([v for _, v in parts])
        return out


def weighted(groups: list[FakeGroup], name: str) -> np.ndarray:
    """The groups' token-weighted mean of a parameter (their weights of the last round)."""
    return sum(g.weight * g.values[name] for g in groups) / sum(g.weight for g in groups)


def run(groups: list[FakeGroup], buffer_mb: float) -> tuple[ServerShardFedAvg, FakeGrid]:
    grid = FakeGrid({g.node: g for g in groups})
    strategy = make(spec(rounds=1, syncs_per_round=1, aggregation="server", server_buffer_mb=buffer_mb,
                         facilities="a,b", facility_shards="b=1", partition="iid-groups"), fast(), ServerShardFedAvg)
    strategy.start(grid)
    return strategy, grid


BUFFER = 24 / 2**20  # chunks of at most 24 bytes: a row of w, or 6 of b


def test_chunked_pulls_and_applies_give_every_group_the_weighted_mean_whatever_its_sharding():
    a, b = FakeGroup(1, 0, model(1), None, shards=2), FakeGroup(2, 1, model(2), None, shards=1)
    strategy, grid = run([a, b], BUFFER)
    record = strategy.history[0]
    assert (record["facility_replies"], record["facility_rejected"], record["dropped"]) == (2, 0, 0), record
    chunks = record["apply_chunks"]
    assert chunks > 4 and a.pulls == b.pulls == a.applies == b.applies == chunks  # many chunks, both ways
    for g in (a, b):  # each leader's apply rides with a later pull: one message per chunk, plus the pipeline's ends
        sent = [m for m in grid.pushed if m.metadata.dst_node_id == g.node
                and m.metadata.message_type in (P.MSG_PULL, P.MSG_APPLY)]
        assert len(sent) == chunks + stream.PULL_AHEAD + 1
    assert all(sum(v.nbytes for v in arrays.values()) <= 24 for arrays, _ in a.received)
    for name in SHAPES:
        expected = weighted([a, b], name)
        for g in (a, b):
            np.testing.assert_allclose(g.adopted()[name], expected, rtol=1e-6, atol=1e-7)


def _nan(rows: dict[str, np.ndarray]) -> None:
    next(iter(rows.values()))[0] = np.nan


def _drop_a_piece(rows: dict[str, np.ndarray]) -> None:
    rows[next(iter(rows))] = rows[next(iter(rows))][:1]
    rows.pop(next(iter(rows)))


def _wrong_rows(rows: dict[str, np.ndarray]) -> None:
    key = next(iter(rows))
    rows[key] = rows[key][:-1]


@pytest.mark.parametrize("corrupt, reason", [(_nan, "NaN"), (_drop_a_piece, "other pieces or rows"),
                                             (_wrong_rows, "other pieces or rows")])
def test_a_bad_chunk_leaves_that_facility_out_of_every_row(corrupt, reason, caplog):
    def in_third_pull(pull: int, rows: dict[str, np.ndarray]) -> None:
        if pull == 3:
            corrupt(rows)

    a, b = FakeGroup(1, 0, model(1), None, shards=2), FakeGroup(2, 1, model(2), None, shards=1, corrupt=in_third_pull)
    with caplog.at_level(logging.WARNING):
        strategy, grid = run([a, b], BUFFER)
    assert b.pulls == 3 + stream.PULL_AHEAD  # the pulls queued before its bad chunk, then none
    record = strategy.history[0]
    assert (record["facility_replies"], record["facility_rejected"], record["stream_restarts"]) == (1, 1, 1), record
    lines = [r.getMessage() for r in caplog.records if "rejected the shards of facility b" in r.getMessage()]
    assert len(lines) == 1 and "chunk 3/" in lines[0] and reason in lines[0], lines
    # the first pass had sent b's rows of chunks 1 and 2; the second pass replaces them: every row is a's alone
    for g in (a, b):
        assert g.passes == 2
        for name in SHAPES:
            np.testing.assert_allclose(g.adopted()[name], a.values[name], rtol=1e-6)


def test_a_facility_that_stops_answering_is_left_out_and_the_others_adopt_their_mean():
    c = FakeGroup(3, 2, model(3), None, shards=2)
    answered = FakeGroup.__call__

    def silent_after_two_pulls(self: FakeGroup, m: Message) -> tuple[float, Any]:
        if m.metadata.message_type == P.MSG_PULL and self.pulls >= 2:
            self.pulls += 1
            return 0.0, None  # no reply: the node is there but its ClientApp never answers
        return answered(self, m)

    a, b = FakeGroup(1, 0, model(1), None, shards=2), FakeGroup(2, 1, model(2), None, shards=1)
    b.__class__ = type("Silent", (FakeGroup,), {"__call__": silent_after_two_pulls})
    grid = FakeGrid({g.node: g for g in (a, b, c)})
    strategy = make(spec(rounds=1, syncs_per_round=1, aggregation="server", server_buffer_mb=BUFFER,
                         facilities="a,b,c", facility_shards="b=1", partition="iid-groups"), fast(num_groups=3),
                    ServerShardFedAvg)
    strategy.start(grid)
    record = strategy.history[0]
    assert (record["facility_replies"], record["facility_rejected"], record["stream_restarts"]) == (2, 1, 1), record
    for g in (a, b, c):
        for name in SHAPES:
            np.testing.assert_allclose(g.adopted()[name], weighted([a, c], name),
                                       rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("edit, reason", [
    (lambda c: c[shard_files.SHARD_META].__setitem__("w@0", "float32|11,6"), "global shape"),
    (lambda c: c[shard_files.SHARD_SHAPES].__delitem__("b@0"), "name different pieces"),
    (lambda c: c[shard_files.SHARD_INFO].__setitem__("round", 7), "not the current round"),
    (lambda c: c[shard_files.SHARD_INFO].__setitem__("weight", -1.0), "weight must be"),
])
def test_a_bad_manifest_is_rejected_before_anything_is_pulled(edit, reason, caplog):
    a = FakeGroup(1, 0, model(1), None, shards=2)
    b = FakeGroup(2, 1, model(2), None, shards=1, manifest=edit)
    with caplog.at_level(logging.WARNING):
        strategy, grid = run([a, b], BUFFER)
    assert b.pulls == 0 and not [m for m in grid.sent(P.MSG_PULL) if m.metadata.dst_node_id == 2]
    assert any(reason in r.getMessage() and "manifest" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]
    for g in (a, b):  # the mean is a's model alone, sent to both
        for name in SHAPES:
            np.testing.assert_allclose(g.adopted()[name], a.values[name], rtol=1e-6)


def _rounds_with_a_failure(facilities: str, caplog) -> tuple[ServerShardFedAvg, FakeGrid, list[dict]]:
    groups = [FakeGroup(1, 0, model(1), None, 2), FakeGroup(2, 1, model(2), None, 2, fail_in_round=2),
              FakeGroup(3, 2, model(3), None, 2)]
    grid = FakeGrid({g.node: g for g in groups})
    strategy = make(spec(rounds=4, syncs_per_round=1, aggregation="server", facilities=facilities),
                    fast(num_groups=3), ServerShardFedAvg)
    with caplog.at_level(logging.INFO, logger="flwr"):
        strategy.start(grid)
    return strategy, grid, [h for h in strategy.history if h["kind"] == "round"]


def test_a_dropped_group_rejoins_its_facility_with_a_catch_up(caplog):
    """Facilities a = {1, 2}, b = {3}; node 2 fails in round 2, rejoins in round 3 behind node 1, and only
    facility a's round 3 starts with a catch-up (from node 1, its first member)."""
    strategy, grid, rounds = _rounds_with_a_failure("a,a,b", caplog)
    assert [r["dropped"] for r in rounds] == [0, 1, 0, 0]
    assert [r["rejoined"] for r in rounds] == [[], [], ["2"], []]
    assert [r["facility_replies"] for r in rounds] == [2, 2, 2, 2]
    trains = {(config(m)["server-round"], m.metadata.dst_node_id): config(m) for m in grid.sent(P.MSG_TRAIN)}
    assert trains[(3, 1)]["catch-up"] and trains[(3, 2)]["catch-up"] and not trains[(3, 3)]["catch-up"]
    assert trains[(3, 2)]["members"] == ["1", "2"] and trains[(3, 2)]["member-index"] == 1
    assert not any(c["catch-up"] for (r, _), c in trains.items() if r != 3)


def test_a_dropped_group_alone_in_its_facility_stays_out(caplog):
    strategy, grid, rounds = _rounds_with_a_failure("a,b,c", caplog)
    assert [r["groups"] for r in rounds] == [3, 2, 2, 2]
    assert not any(r["rejoined"] for r in rounds)
    assert len([m for m in grid.sent(P.MSG_HELLO) if m.metadata.dst_node_id == 2]) == 1  # no second hello
    assert "stay out: no member of their facility is left to catch up from" in caplog.text


def test_the_model_is_the_one_most_facilities_announce_so_a_bad_first_manifest_is_rejected(caplog):
    """Three facilities; the first announces a wrong global shape: it is rejected, and the other two, which agree,
    are averaged (with the first as the model, both would have been rejected)."""
    def wrong_shape(content: RecordDict) -> None:
        content[shard_files.SHARD_META]["w@0"] = "float32|11,6"
        content[shard_files.SHARD_SHAPES]["w@0"] = "11,6"

    a = FakeGroup(1, 0, model(1), None, shards=1, manifest=wrong_shape)
    b, c = FakeGroup(2, 1, model(2), None, shards=1), FakeGroup(3, 2, model(3), None, shards=1)
    grid = FakeGrid({g.node: g for g in (a, b, c)})
    strategy = make(spec(rounds=1, syncs_per_round=1, aggregation="server", shards=1, server_buffer_mb=BUFFER),
                    fast(num_groups=3), ServerShardFedAvg)
    with caplog.at_level(logging.WARNING):
        strategy.start(grid)
    record = strategy.history[0]
    assert (record["facility_replies"], record["facility_rejected"]) == (2, 1), record
    assert a.pulls == 0 and "global shape (11, 6)" in caplog.text
    for g in (a, b, c):
        for name in SHAPES:
            np.testing.assert_allclose(g.adopted()[name], weighted([b, c], name),
                                       rtol=1e-6, atol=1e-7)


# ----- bounded damage: a bad facility among three, and the robust rules ---------------------------------------------
def run_facilities(groups: list[FakeGroup], **options: Any) -> ServerShardFedAvg:
    names = ",".join("abcdefgh"[:len(groups)])
    strategy = make(spec(rounds=1, syncs_per_round=1, aggregation="server", server_buffer_mb=BUFFER,
                         facilities=names, facility_shards="b=1", partition="iid-groups", **options),
                    fast(num_groups=len(groups)), ServerShardFedAvg)
    strategy.start(FakeGrid({g.node: g for g in groups}))
    return strategy


def _huge_in_third_pull(pull: int, rows: dict[str, np.ndarray]) -> None:
    if pull == 3:
        next(iter(rows.values()))[0] = 1e30


def _nan_in_third_pull(pull: int, rows: dict[str, np.ndarray]) -> None:
    if pull == 3:
        _nan(rows)


@pytest.mark.parametrize("corrupt, manifest, reason", [
    (_nan_in_third_pull, None, "NaN or Inf"),
    (None, lambda c: c[shard_files.SHARD_INFO].__setitem__("weight", 1e12), "out of bounds"),
    (None, lambda c: c[shard_files.SHARD_INFO].__setitem__("weight", 1e300), "out of bounds"),
    (None, lambda c: c[shard_files.SHARD_INFO].__setitem__("weight", float("inf")), "finite number > 0"),
    (_huge_in_third_pull, None, "largest |value| 1e+30 is more than 100 x"),
], ids=["nan", "weight-1e12", "weight-1e300", "weight-inf", "values-1e30"])
def test_a_bad_facility_is_excluded_with_one_line_and_the_others_mean_adopted(corrupt, manifest, reason, caplog):
    """Facilities a (S = 2), b (S = 1) and c (S = 2); c sends NaN, an inflated weight or values far above the
    others'. c is left out with one log line naming it, the round and why; nothing crashes; every group adopts the
    weighted mean of a and b; the round's record names c and the reason."""
    a, b = FakeGroup(1, 0, model(1), None, shards=2), FakeGroup(2, 1, model(2), None, shards=1)
    c = FakeGroup(3, 2, model(3), None, shards=2, corrupt=corrupt, manifest=manifest)
    with caplog.at_level(logging.WARNING):
        strategy = run_facilities([a, b, c])
    record = strategy.history[0]
    assert (record["facility_replies"], record["facility_rejected"]) == (2, 1), record
    (source, why), = record["facility_rejections"].items()
    assert source == "facility c (node 3)" and reason in why, record["facility_rejections"]
    lines = [r.getMessage() for r in caplog.records if "facility c" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("round 1: server path: rejected the shards of facility c"), lines
    assert reason in lines[0]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    for g in (a, b, c):
        for name in SHAPES:
            np.testing.assert_allclose(g.adopted()[name], weighted([a, b], name), rtol=1e-6, atol=1e-7)


def _offset(seed: int, by: float) -> dict[str, np.ndarray]:
    return {n: v + by for n, v in model(seed).items()}


@pytest.mark.parametrize("rule, trim", [("median", 1), ("trimmed-mean", 1), ("trimmed-mean", 2)])
def test_robust_server_rules_give_every_group_the_coordinate_rule_of_the_facilities(rule, trim):
    """Five facilities, one of them 50 away from the others (within the magnitude bound): every group adopts the
    coordinate-wise median / trimmed mean of the five models (numpy's), chunk by chunk."""
    groups = [FakeGroup(i + 1, i, _offset(i + 1, 50.0 if i == 4 else 0.0), None, shards=1 if i == 1 else 2)
              for i in range(5)]
    strategy = run_facilities(groups, server_rule=rule, server_trim=trim)
    record = strategy.history[0]
    assert (record["facility_replies"], record["facility_rejected"]) == (5, 0), record
    for name in SHAPES:
        stacked = np.stack([g.values[name] for g in groups])
        central = np.median(stacked, axis=0) if rule == "median" else np.sort(stacked, axis=0)[trim:5 - trim].mean(0)
        for g in groups:
            np.testing.assert_allclose(g.adopted()[name], central, rtol=1e-6, atol=1e-6)
        assert np.abs(central).max() < 10  # the outlier facility did not move it


def test_a_trimmed_mean_short_of_facilities_skips_the_server_mean_with_one_error(caplog):
    """trimmed-mean with trim 1 over three facilities, one of which sends NaN: two are left, too few; the round
    ends without a server mean (one ERROR line saying why) and nobody adopts anything."""
    groups = [FakeGroup(1, 0, model(1), None, shards=2), FakeGroup(2, 1, model(2), None, shards=1),
              FakeGroup(3, 2, model(3), None, shards=2, corrupt=_nan_in_third_pull)]
    with caplog.at_level(logging.WARNING):
        strategy = run_facilities(groups, server_rule="trimmed-mean")
    record = strategy.history[0]
    assert (record["facility_replies"], record["facility_rejected"]) == (0, 1), record
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and "server-rule" in r.getMessage()]
    assert len(errors) == 1 and "needs 3 facilities, 2 sent valid shards" in errors[0], errors
    assert all(len(g.received) < record["apply_chunks"] for g in groups)  # no pass reached its last chunk
