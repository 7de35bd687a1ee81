"""Hub-style data offline: streaming, repository layouts, script-based datasets, tokenization in several processes.

Every dataset here is a few KB on local disk, laid out as the Hub lays it out; `datasets` is kept offline.
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest
import torch

from flwr_sharded.config import DataConfig, TrainConfig, load_config
from flwr_sharded.validation import validate
from flwr_sharded.errors import ConfigError
from flwr_sharded.train import main
from flwr_sharded.training import data, sources
from flwr_sharded.training.corpus import train_tokenizer
from flwr_sharded.training.data import check_data, load_blocks

from tests import REPO

WORDS = "il re la regina corona spada notte giorno amore morte onore signore dama parla".split()


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def _documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"Doc {i}. " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60))) for i in range(n)]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(_documents(200, seed=1), vocab_size=300)


def _data_dir(root: Path, tokenizer, name: str = "data") -> Path:
    path = root / name
    tokenizer.save_pretrained(path / "tokenizer")
    return path


def _tokens(tokenizer, docs: list[str]) -> torch.Tensor:
    return torch.tensor([t for d in docs for t in tokenizer(d, add_special_tokens=False)["input_ids"] +
                         [tokenizer.eos_token_id]])


def _jsonl(path: Path, docs: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": d, "url": f"u{i}"}) + "\n" for i, d in enumerate(docs)))
    return path


def _parquet(path: Path, docs: list[str]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": docs}), path)
    return path


# ------------------------------------------------------------------------------------------------------- streaming

def test_streaming_stops_at_max_train_blocks_and_equals_the_map_style_blocks(tmp_path: Path, tokenizer,
                                                                            monkeypatch) -> None:
    """Train and validation splits: the stream's blocks are the first N of the full (map-style) blocks; a second
    train file that is not JSON is never opened, since the stream stops once N blocks are full."""
    monkeypatch.setattr(data, "TOKENIZE_BATCH", 10)  # documents read ahead of the packer: one batch
    docs = _documents(120)
    corpus = tmp_path / "corpus"
    _jsonl(corpus / "train-00000.jsonl", docs[:100])
    _jsonl(corpus / "validation-00000.jsonl", docs[100:])
    data_dir = _data_dir(tmp_path, tokenizer)
    full = load_blocks(DataConfig(dataset=str(corpus), data_dir=str(data_dir), seq_len=16), tokenizer)
    assert len(full.train) > 20 and len(full.validation) > 4

    (corpus / "train-00001.jsonl").write_text("this is { not json\n")
    cfg = DataConfig(dataset=str(corpus), data_dir=str(data_dir), seq_len=16, streaming=True, max_train_blocks=20,
                     eval_blocks=4)
    streamed = load_blocks(cfg, tokenizer)
    assert torch.equal(streamed.train, full.train[:20])
    assert torch.equal(streamed.train_doc_ids, full.train_doc_ids[:20])
    assert torch.equal(streamed.validation, full.validation[:4])  # streaming packs only eval-blocks of them
    saved = torch.load(next((data_dir / "cache").glob(f"{data._cache_key(cfg, tokenizer)}.pt")), weights_only=True)
    assert saved["validation_source"] == "the 'validation' split"


def test_streaming_without_validation_split_holds_out_the_first_documents(tmp_path: Path, tokenizer) -> None:
    docs = _documents(80)
    path = _parquet(tmp_path / "corpus.parquet", docs)
    cfg = DataConfig(dataset=str(path), data_dir=str(_data_dir(tmp_path, tokenizer)), seq_len=16, streaming=True,
                     max_train_blocks=10, eval_blocks=3)
    blocks = load_blocks(cfg, tokenizer)
    lengths = [len(tokenizer(d, add_special_tokens=False)["input_ids"]) + 1 for d in docs]
    held = next(k for k in range(1, len(docs)) if sum(lengths[:k]) >= 3 * 16)  # whole documents until 3 blocks
    assert torch.equal(blocks.validation.flatten(), _tokens(tokenizer, docs[:held])[: 3 * 16])
    assert torch.equal(blocks.train.flatten(), _tokens(tokenizer, docs[held:])[: 10 * 16])
    assert blocks.train_doc_ids[0] == 0 and blocks.train.shape == (10, 16)


def test_streaming_needs_max_train_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    with pytest.raises(ConfigError, match="--streaming .* --max-train-blocks"):
        validate(TrainConfig(data=DataConfig(streaming=True)))
    validate(TrainConfig(data=DataConfig(streaming=True, max_train_blocks=8)))
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["--method", "fsdp", "--streaming", "--run-dir", str(tmp_path / "run")]) == 2
    assert "--max-train-blocks" in capsys.readouterr().err and not (tmp_path / "run").exists()


# --------------------------------------------------------------------------------------------- repository layouts

def test_repository_copy_and_parquet_conversion_layouts(tmp_path: Path, tokenizer) -> None:
    """A copy of a hub repository (data/train-*.parquet, data/validation-*.parquet) loads through `datasets` as the
    Hub's does; in the Parquet conversion's layout (<config>/partial-<split>/*.parquet) `dataset-config` picks the
    configuration's directory."""
    docs = _documents(60)
    data_dir = _data_dir(tmp_path, tokenizer)
    repo = tmp_path / "repo"
    _parquet(repo / "data" / "train-00000-of-00001.parquet", docs[:50])
    _parquet(repo / "data" / "validation-00000-of-00001.parquet", docs[50:])
    (repo / "README.md").write_text("# a dataset\n")
    check_data(DataConfig(dataset=str(repo), data_dir=str(data_dir)))
    blocks = load_blocks(DataConfig(dataset=str(repo), data_dir=str(data_dir), seq_len=16), tokenizer)
    assert torch.equal(blocks.train.flatten(), _tokens(tokenizer, docs[:50])[: blocks.train.numel()])
    assert torch.equal(blocks.validation.flatten(), _tokens(tokenizer, docs[50:])[: blocks.validation.numel()])

    converted = tmp_path / "converted"
    for config, offset in (("tiny", 0), ("small", 30)):
        _parquet(converted / config / "partial-train" / "0000.parquet", docs[offset:offset + 25])
        _parquet(converted / config / "partial-validation" / "0000.parquet", docs[offset + 25:offset + 30])
    tiny = load_blocks(DataConfig(dataset=str(converted), dataset_config="tiny", data_dir=str(data_dir), seq_len=16),
                       tokenizer)
    assert torch.equal(tiny.train.flatten(), _tokens(tokenizer, docs[:25])[: tiny.train.numel()])
    hub = DataConfig(dataset="gsarti/clean_mc4_it", dataset_config="tiny", dataset_revision=sources.PARQUET_REVISION)
    assert sources.load_arguments(hub, None) == {"path": "gsarti/clean_mc4_it", "data_dir": "tiny",
                                                 "revision": sources.PARQUET_REVISION}
    assert sources.load_arguments(DataConfig(dataset="org/name", dataset_config="it"), None)["name"] == "it"
    with pytest.raises(ConfigError, match="--dataset-revision .* hub datasets"):
        check_data(DataConfig(dataset=str(repo), data_dir=str(data_dir), dataset_revision="main"))


def test_gzipped_json_shards_named_as_clean_mc4_it(tmp_path: Path, tokenizer) -> None:
    """A local copy of clean_mc4_it's shards: c4-it.tfrecord-*.json.gz, and c4-it-validation.tfrecord-* the
    validation split."""
    docs = _documents(40)
    shards = tmp_path / "clean_mc4_it"
    shards.mkdir()
    for name, part in (("c4-it.tfrecord-00000-of-01024", docs[:30]), ("c4-it-validation.tfrecord-00000-of-00008",
                                                                       docs[30:])):
        with gzip.open(shards / f"{name}.json.gz", "wt") as fh:
            fh.writelines(json.dumps({"text": d}) + "\n" for d in part)
    blocks = load_blocks(DataConfig(dataset=str(shards), data_dir=str(_data_dir(tmp_path, tokenizer)), seq_len=16),
                         tokenizer)
    assert torch.equal(blocks.train.flatten(), _tokens(tokenizer, docs[:30])[: blocks.train.numel()])
    assert torch.equal(blocks.validation.flatten(), _tokens(tokenizer, docs[30:])[: blocks.validation.numel()])


# ------------------------------------------------------------------------------------------- script-based datasets

SCRIPT_WORDS = ["--dataset", "loading script", "datasets >= 4", "--dataset-revision refs/convert/parquet",
                "--dataset path/to/files"]


def test_a_script_based_dataset_is_a_clear_error(tmp_path: Path, tokenizer, monkeypatch, capsys) -> None:
    """Laid out like gsarti/clean_mc4_it (a loading script, its data elsewhere): refused by the offline check, and
    the RuntimeError of the installed `datasets` itself becomes the same ConfigError."""
    data_dir = _data_dir(tmp_path, tokenizer)
    repo = tmp_path / "clean_mc4_it"
    repo.mkdir()
    (repo / "clean_mc4_it.py").write_text("import datasets\n\nclass CleanMc4It(datasets.GeneratorBasedBuilder):\n"
                                          "    pass\n")
    (repo / "README.md").write_text("# Clean Italian mC4\n")
    cfg = DataConfig(dataset=str(repo), data_dir=str(data_dir))
    with pytest.raises(ConfigError) as caught:
        check_data(cfg)
    assert all(word in str(caught.value) for word in SCRIPT_WORDS), caught.value

    monkeypatch.setattr(sources, "local_layout", lambda path, dataset: None)  # straight to datasets.load_dataset
    with pytest.raises(ConfigError, match="clean_mc4_it.py") as caught:
        sources.open_splits(cfg)
    assert all(word in str(caught.value) for word in SCRIPT_WORDS), caught.value
    monkeypatch.undo()

    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(["--method", "fsdp", "--shards", "4", "--dataset", str(repo), "--data-dir", str(data_dir),
                 "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert all(word in err for word in SCRIPT_WORDS) and "Traceback" not in err, err


def test_paper_configs_name_a_dataset_that_passes_the_offline_checks(data_dir: Path) -> None:
    for path in sorted((REPO / "configs" / "paper").glob("*.yaml")):
        cfg = load_config(path)
        validate(cfg, cfg.parallel.world_size)
        cfg.data.data_dir = str(data_dir)
        check_data(cfg.data, cfg.model.name)
        assert cfg.data.dataset != "gsarti/clean_mc4_it" or cfg.data.dataset_revision, path


# ------------------------------------------------------------------------------------------ tokenizing in processes

def test_tokenizing_in_several_processes_gives_the_same_blocks(tmp_path: Path, tokenizer, monkeypatch) -> None:
    docs = _documents(300) + [""] * 3  # empty documents are skipped alike
    path = _jsonl(tmp_path / "corpus.jsonl", docs)
    got = {}
    for workers in (1, 2):
        cfg = DataConfig(dataset=str(path), data_dir=str(_data_dir(tmp_path, tokenizer, f"d{workers}")), seq_len=16,
                         tokenize_workers=workers)
        got[workers] = load_blocks(cfg, tokenizer)
    for key in ("train", "validation", "train_doc_ids"):
        assert torch.equal(getattr(got[1], key), getattr(got[2], key)), key
    assert torch.equal(got[1].train.flatten(), _tokens(tokenizer, docs[:-4])[: got[1].train.numel()])

    import datasets

    split = datasets.Dataset.from_dict({"text": docs})
    everything = data.pack_dataset(split, "text", tokenizer, 16, None, workers=1)
    monkeypatch.setattr(data, "TOKENIZE_BATCH", 7)  # several chunks before max_blocks are full
    limited = data.pack_dataset(split, "text", tokenizer, 16, 30, workers=2)
    assert torch.equal(limited[0], everything[0][:30]) and torch.equal(limited[1], everything[1][:30])
    monkeypatch.setattr(data, "CHUNK_DOCUMENTS", 50)  # and chunks without max_blocks
    chunked = data.pack_dataset(split, "text", tokenizer, 16, None, workers=2)
    assert torch.equal(chunked[0], everything[0]) and torch.equal(chunked[1], everything[1])


def test_only_one_rank_tokenizes(tmp_path: Path, tokenizer, monkeypatch) -> None:
    """The cache is built under a file lock: a second caller waits, then reads the file the first one wrote."""
    import threading

    path = _jsonl(tmp_path / "corpus.jsonl", _documents(120))
    cfg = DataConfig(dataset=str(path), data_dir=str(_data_dir(tmp_path, tokenizer)), seq_len=16,
                     tokenize_workers=1)
    builds, real = [], data._build_cache

    def counted(*args):
        builds.append(threading.get_ident())
        real(*args)

    monkeypatch.setattr(data, "_build_cache", counted)
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(load_blocks(cfg, tokenizer))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 3 and len(builds) == 1
    assert all(torch.equal(r.train, results[0].train) for r in results)
