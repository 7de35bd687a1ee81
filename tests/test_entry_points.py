"""Every entry point's command line: defaults shown in --help, tools' options declared by the trainer's fields, and
the group runtime's generated option table."""

from __future__ import annotations

import argparse
import re

import pytest

from flwr_sharded import schema
from flwr_sharded.errors import ConfigError

from tests import REPO



def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every entry point's parser by its command: train, the group runtime, and each `flwr-sharded` sub-command
    (nested ones too: `bench exec`, ...)."""
    from flwr_sharded import cli, train
    from flwr_sharded.flower.group import runtime

    out = {"flwr-sharded train": train.train_parser(), "python -m flwr_sharded.flower.group": runtime.runtime_parser()}
    todo = [("flwr-sharded", cli.command_parser())]
    while todo:
        prog, parser = todo.pop()
        out.setdefault(prog, parser)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += [(f"{prog} {name}", sub) for name, sub in action.choices.items() if name != "train"]
    return out


def _help_blocks(text: str) -> dict[str, str]:
    """Option string -> its help entry, whitespace removed (argparse wraps long values, at hyphens too)."""
    blocks: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        match = re.match(r"^  (--?[\w-]+)", line)
        if match:
            current = match.group(1)
            blocks[current] = [line]
        elif current and line.startswith("   "):
            blocks[current].append(line)
        else:
            current = None
    return {flag: re.sub(r"\s+", "", " ".join(lines)) for flag, lines in blocks.items()}


def test_every_entry_point_shows_each_default_in_its_help():
    checked = set()
    for prog, parser in _parsers().items():
        blocks = _help_blocks(parser.format_help())
        for action in parser._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS:
                continue
            default = action.option.default if hasattr(action, "option") else action.default
            if default is None or default is False or default == "" or default is argparse.SUPPRESS:
                continue
            flag = action.option_strings[0]
            assert flag in blocks, f"{prog} --help lacks {flag}"
            shown = re.sub(r"\s+", "", f"default:{default}")
            assert shown in blocks[flag], f"{prog} {flag}: its default {default!r} is not in its help"
            checked.add(f"{prog} {flag}")
    assert {"flwr-sharded train --lr", "python -m flwr_sharded.flower.group --idle-timeout",
            "flwr-sharded bench --sync-fragments", "flwr-sharded plan --tokens-per-gpu",
            "flwr-sharded bench sync --federations", "flwr-sharded prepare-data --vocab-size"} <= checked


def test_the_group_runtime_table_is_generated_from_its_options():
    from flwr_sharded.options_doc import with_group_table

    text = (REPO / "docs" / "flower.md").read_text()
    assert text == with_group_table(text), \
        "docs/flower.md's group runtime table drifted: run `flwr-sharded options --group-table docs/flower.md`"


def test_group_options_are_checked_and_have_no_test_switches():
    from flwr_sharded.flower.group import options

    args = options.parse(["--authkey-file", "k", "--shards", "2"])
    assert (args.shards, args.replicas, args.idle_timeout) == (2, 1, 600.0)
    with pytest.raises(SystemExit):  # faults are injected from the tests (tests/faults), not by flags
        options.parse(["--authkey-file", "k", "--debug-fail-sync", "3"])
    with pytest.raises(ConfigError, match="--idle-timeout must be >= 0"):
        options.parse(["--authkey-file", "k", "--idle-timeout", "-1"])
    with pytest.raises(SystemExit):
        options.parse([])  # --authkey-file is required


def test_tools_declare_the_trainers_options_once():
    from flwr_sharded.config import ParallelConfig, TrainConfig
    from flwr_sharded_perf.bench.options import BenchOptions
    from flwr_sharded_perf.memory_model import StepOptions

    trainer, bench = schema.by_name(TrainConfig), schema.by_name(BenchOptions)
    for name in ("sync-fragments", "sync-delay", "sync-alpha", "sync-carry", "sync-dtype", "aggregate-every"):
        assert (bench[name].doc, bench[name].bounds, bench[name].choices) == \
            (trainer[name].doc, trainer[name].bounds, trainer[name].choices)
    assert bench["sync-fragments"].default == 2 and bench["collective-timeout"].doc == trainer["timeout"].doc
    cpu = StepOptions(device="cpu")
    assert (cpu.precision, cpu.bucket_mb, cpu.sync_fragments) == ("fp32", ParallelConfig().bucket_mb, 1)
    with pytest.raises(ConfigError, match="sync_delay must be an integer >= 0"):
        StepOptions(sync_delay=-1)
