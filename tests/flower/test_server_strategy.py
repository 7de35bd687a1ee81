"""ServerShardFedAvg against the in-process fake Grid: manifests, chunked pulls and applies, bad chunks.

Each fake group holds a model cut into its own pieces (S = 2 or S = 1); it announces them in its train reply, serves
the rows the server pulls, and records the chunks of the mean it is sent. No processes, no torch in the groups.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np
import pytest
from flwr.app import Message, RecordDict

from flwr_sharded.flower import handoff
from flwr_sharded.flower import protocol as P
from flwr_sharded.flower.server_strategy import ServerShardFedAvg
from tests.flower.test_strategy import FakeGrid, config, fast, hello_ok, reply, spec, task_identity, train_ok

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
    """A facility of one group: its model, the chunks of the mean it received, and an optional corruption."""

    def __init__(self, node: int, partition: int, values: dict[str, np.ndarray], tokens: int, shards: int,
                 corrupt: Callable[[int, dict[str, np.ndarray]], None] | None = None,
                 manifest: Callable[[RecordDict], None] | None = None) -> None:
        self.node, self.partition, self.values, self.tokens, self.shards = node, partition, values, tokens, shards
        self.arrays, self.meta = cut(values, shards)
        self.corrupt, self.edit_manifest = corrupt, manifest
        self.pulls = 0
        self.received: list[tuple[dict[str, np.ndarray], dict[str, str]]] = []

    def __call__(self, m: Message) -> tuple[float, Any]:
        kind, cfg = m.metadata.message_type, config(m)
        if kind == P.MSG_HELLO:
            return 0.0, hello_ok(self.node, shards=self.shards, fingerprint=f"S{self.shards}",
                                 partition=self.partition)
        if kind == P.MSG_TRAIN:
            content = train_ok(tokens=self.tokens, checksums=[0.0] * self.shards, facility_tokens=self.tokens)
            shapes = {k: v.shape for k, v in self.arrays.items()}
            for name, record in handoff.manifest_records(shapes, self.meta, cfg["server-round"],
                                                         self.tokens).items():
                content[name] = record
            if self.edit_manifest:
                self.edit_manifest(content)
            return 0.0, content
        if kind == P.MSG_PULL:
            self.pulls += 1
            rows = {}
            for text in cfg["pieces"]:
                key, a, b = text.rsplit("|", 2)
                rows[handoff.row_key(key, int(a))] = self.arrays[key][int(a):int(b)].copy()
            if self.corrupt:
                self.corrupt(self.pulls, rows)
            meta = {k: self.meta[f"{k.rpartition('@')[0]}@0"] for k in rows}
            return 0.0, RecordDict(handoff.to_records(rows, meta, cfg["server-round"], self.tokens))
        if kind == P.MSG_APPLY:
            arrays, meta, _ = handoff.from_records(m.content)
            self.received.append((arrays, meta))
            last = cfg["chunk"] == cfg["chunks"] - 1
            return 0.0, reply(checksums=[0.0] * self.shards) if last else reply(chunk=cfg["chunk"])
        if kind == P.MSG_FINISH:
            return 0.0, reply(stopped=1)
        return 0.0, reply()

    def adopted(self) -> dict[str, np.ndarray]:
        """The mean this group was sent, whole: its own pieces assembled from every chunk."""
        out = {}
        for name, shape in SHAPES.items():
            parts = sorted((int(k.rpartition("@")[2]), v) for arrays, _ in self.received for k, v in arrays.items()
                           if k.rpartition("@")[0] == name)
            assert sum(len(v) for _, v in parts) == shape[0], (name, [o for o, _ in parts])
            out[name] = np.concatenate([v for _, v in parts])
        return out


def run(groups: list[FakeGroup], buffer_mb: float) -> tuple[ServerShardFedAvg, FakeGrid]:
    grid = FakeGrid({g.node: g for g in groups})
    strategy = ServerShardFedAvg(spec(rounds=1, syncs_per_round=1, aggregation="server", server_buffer_mb=buffer_mb,
                                      facilities="a,b", facility_shards="b=1", partition="iid-groups"), fast())
    strategy.start(grid)
    return strategy, grid


BUFFER = 96 / 2**20  # 96 bytes: 48 per group per step, so rows of w (24 bytes) are cut across chunks


def test_chunked_pulls_and_applies_give_every_group_the_weighted_mean_whatever_its_sharding():
    a, b = FakeGroup(1, 0, model(1), 100, shards=2), FakeGroup(2, 1, model(2), 300, shards=1)
    strategy, grid = run([a, b], BUFFER)
    record = strategy.history[0]
    assert (record["facility_replies"], record["facility_rejected"], record["dropped"]) == (2, 0, 0), record
    assert a.pulls > 4 and record["apply_chunks"] > 4  # the model moved in many chunks both ways
    assert all(sum(v.nbytes for v in arrays.values()) <= 48 for arrays, _ in a.received)
    for name in SHAPES:
        expected = (100 * a.values[name] + 300 * b.values[name]) / 400
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
def test_a_bad_chunk_stops_the_pull_of_that_group_and_keeps_its_earlier_rows(corrupt, reason, caplog):
    def in_third_pull(pull: int, rows: dict[str, np.ndarray]) -> None:
        if pull == 3:
            corrupt(rows)

    a, b = FakeGroup(1, 0, model(1), 100, shards=2), FakeGroup(2, 1, model(2), 300, shards=1, corrupt=in_third_pull)
    with caplog.at_level(logging.WARNING):
        strategy, grid = run([a, b], BUFFER)
    assert b.pulls == 3  # nothing more was asked of it
    record = strategy.history[0]
    assert (record["facility_replies"], record["facility_rejected"]) == (1, 1), record
    lines = [r.getMessage() for r in caplog.records if "rejected the shards of facility b" in r.getMessage()]
    assert len(lines) == 1 and "chunk 3/" in lines[0] and reason in lines[0], lines
    # b's chunks 1 and 2 (rows 0-3 of w, 2 rows of 24 bytes each) are in the mean, weighted; the rest is a's alone
    adopted = a.adopted()
    mixed = (100 * a.values["w"] + 300 * b.values["w"]) / 400
    np.testing.assert_allclose(adopted["w"][:4], mixed[:4], rtol=1e-6)
    np.testing.assert_allclose(adopted["w"][4:], a.values["w"][4:], rtol=1e-6)
    np.testing.assert_allclose(adopted["b"], a.values["b"], rtol=1e-6)


@pytest.mark.parametrize("edit, reason", [
    (lambda c: c[handoff.SHARD_META].__setitem__("w@0", "float32|11,6"), "global shape"),
    (lambda c: c[handoff.SHARD_SHAPES].__delitem__("b@0"), "name different pieces"),
    (lambda c: c[handoff.SHARD_INFO].__setitem__("round", 7), "not the current round"),
    (lambda c: c[handoff.SHARD_INFO].__setitem__("weight", -1.0), "weight must be"),
])
def test_a_bad_manifest_is_rejected_before_anything_is_pulled(edit, reason, caplog):
    a = FakeGroup(1, 0, model(1), 100, shards=2)
    b = FakeGroup(2, 1, model(2), 300, shards=1, manifest=edit)
    with caplog.at_level(logging.WARNING):
        strategy, grid = run([a, b], BUFFER)
    assert b.pulls == 0 and not [m for m in grid.sent(P.MSG_PULL) if m.metadata.dst_node_id == 2]
    assert any(reason in r.getMessage() and "manifest" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]
    for g in (a, b):  # the mean is a's model alone, sent to both
        for name in SHAPES:
            np.testing.assert_allclose(g.adopted()[name], a.values[name], rtol=1e-6)
