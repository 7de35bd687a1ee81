"""Which tokenizer a run uses, and a vocabulary that does not fit the model refused before anything starts."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from flwr_sharded.config import DataConfig, TrainConfig
from flwr_sharded.errors import ConfigError
from flwr_sharded.train import main
from flwr_sharded.training.corpus import train_tokenizer
from flwr_sharded.training.data import check_data, load_tokenizer
from flwr_sharded.training.preflight import preflight
from flwr_sharded.training.sources import check_vocab, tokenizer_name
from tests.multiproc import train_ranks

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) for _ in range(n)]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(_documents(100, seed=3), vocab_size=300)


def _model_dir(path: Path, vocab_size: int, tokenizer=None) -> Path:
    """A local model directory: a tiny LlamaConfig (config.json) and, if given, its tokenizer."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64).save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def test_a_local_model_brings_its_own_tokenizer(tmp_path: Path, tokenizer, data_dir: Path) -> None:
    model = str(_model_dir(tmp_path / "model", 300, tokenizer))
    bare = tmp_path / "bare"  # a data directory without the embedded tokenizer
    bare.mkdir()
    cfg = DataConfig(dataset="org/name", data_dir=str(bare))
    check_data(cfg, model)
    own = load_tokenizer(cfg, model)
    assert tokenizer_name(cfg, model) == model and own.get_vocab() == tokenizer.get_vocab()
    with pytest.raises(ConfigError, match="no tokenizer"):
        check_data(cfg, "tiny")  # a preset keeps the tokenizer of data-dir
    assert len(load_tokenizer(DataConfig(data_dir=str(data_dir)), "tiny")) == 8192
    explicit = DataConfig(data_dir=str(bare), tokenizer=str(data_dir / "tokenizer"))
    assert len(load_tokenizer(explicit, model)) == 8192  # --tokenizer wins
    with pytest.raises(ConfigError, match=r"--model .*cannot load its tokenizer.*set --tokenizer"):
        load_tokenizer(cfg, str(_model_dir(tmp_path / "no-tokenizer", 300)))


def test_a_tokenizer_larger_than_the_embedding_is_refused_before_any_process_group(
        tmp_path: Path, tokenizer, data_dir: Path, monkeypatch, capsys) -> None:
    import torch.distributed as dist

    model = str(_model_dir(tmp_path / "model", 100, tokenizer))  # 300 tokens, 100 embedding rows
    monkeypatch.setenv("WORLD_SIZE", "4")
    run_dir = tmp_path / "run"
    assert main(["--method", "fsdp", "--shards", "4", "--model", model, "--data-dir", str(data_dir),
                 "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    for word in ("--tokenizer (the model's own) has 300 tokens", f"--model {model}", "embeds only 100",
                 "config.json"):
        assert word in err, err
    assert not run_dir.exists() and not dist.is_initialized()

    cfg = TrainConfig()
    cfg.model.name, cfg.data.data_dir = model, str(data_dir)
    cfg.data.tokenizer = str(data_dir / "tokenizer")  # 8192 tokens
    with pytest.raises(ConfigError, match=r"--tokenizer \(.*tokenizer\) has 8192 tokens .* embeds only 100"):
        preflight(cfg, 1)
    cfg.model.name = str(_model_dir(tmp_path / "large", 8192))
    preflight(cfg, 1)


def test_a_preset_with_a_fixed_vocabulary_is_checked_too(tmp_path: Path, data_dir: Path) -> None:
    """llama-1b embeds 128256 rows whatever the tokenizer: a token id beyond them is refused."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    sparse = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 200_000}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=sparse, eos_token="</s>").save_pretrained(tmp_path / "sparse")
    cfg = TrainConfig()
    cfg.model.name, cfg.data.data_dir, cfg.data.tokenizer = "llama-1b", str(data_dir), str(tmp_path / "sparse")
    with pytest.raises(ConfigError, match=r"has 2 tokens \(largest id 200000\) but --model llama-1b embeds only "
                                          r"128256 \(vocab_size fixed by the preset\)"):
        check_vocab(cfg)
    cfg.data.tokenizer = None
    check_vocab(cfg)  # the embedded 8192 fit
    cfg.model.name = "tiny"
    check_vocab(cfg)  # sized from the tokenizer


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_training_a_local_model_uses_and_saves_its_tokenizer(tmp_path: Path, tokenizer) -> None:
    """One gloo rank, two steps of a local model directory on a local corpus: its own tokenizer is used."""
    model = _model_dir(tmp_path / "model", 300, tokenizer)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in _documents(200)))
    data = tmp_path / "data"  # holds no tokenizer: the model's is the only one
    data.mkdir()
    result = train_ranks(1, ["--method", "fsdp", "--model", str(model), "--dataset", str(corpus),
                             "--data-dir", str(data),
                          "--seq-len", "32", "--batch-size", "2", "--steps", "2", "--eval-blocks", "2",
                          "--no-progress", "--run-dir", str(tmp_path / "run"), "--tokenize-workers", "1"],
                      timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(tmp_path / "run" / "model")
    assert saved.get_vocab() == tokenizer.get_vocab()


def test_the_corpus_is_tokenized_with_the_models_tokenizer_and_cached_per_tokenizer(tmp_path: Path, tokenizer,
                                                                                      data_dir: Path) -> None:
    """A model directory's tokenizer tokenizes the corpus; another tokenizer of the same data is another cache."""
    from flwr_sharded.training.data import load_blocks

    model = str(_model_dir(tmp_path / "model", 300, tokenizer))
    corpus = tmp_path / "corpus.jsonl"
    docs = _documents(60)
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    cfg = DataConfig(dataset=str(corpus), data_dir=str(tmp_path / "data"), seq_len=8, tokenize_workers=1)
    (tmp_path / "data").mkdir()
    own = load_tokenizer(cfg, model)
    blocks = load_blocks(cfg, own)
    ids = [t for d in docs[:-1] for t in tokenizer(d, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]]
    assert blocks.train.flatten().tolist() == ids[:blocks.train.numel()] and blocks.vocab_size == 300
    other = load_tokenizer(DataConfig(data_dir=str(data_dir)), "tiny")  # the embedded 8192-token BPE
    again = load_blocks(cfg, other)
    assert len(list((tmp_path / "data" / "cache").glob("*.pt"))) == 2 and again.vocab_size == 8192
    assert not torch.equal(again.train[:1], blocks.train[:1])


def test_a_model_tokenizer_without_eos_is_refused_before_any_process_group(tmp_path: Path, data_dir: Path) -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    model = _model_dir(tmp_path / "model", 100)
    PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(model)
    cfg = TrainConfig()
    cfg.model.name, cfg.data.data_dir = str(model), str(data_dir)
    with pytest.raises(ConfigError, match="--tokenizer: .* has no eos token"):
        preflight(cfg, 1)
