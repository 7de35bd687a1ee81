"""The option reference generated from the schema (`flwr-sharded options`): docs/options.md (the static engine's
flags and YAML keys, the Flower app's run-config keys, and why a training option is not one) and the group runtime's
table in docs/flower.md (`--group-table`, between its markers); tests compare the committed files with them."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from flwr_sharded import schema

HEADER = """# Options

Generated from the configuration dataclasses (`flwr_sharded/config.py`, `flwr_sharded/flower/run_config.py`) by
`flwr-sharded options --write docs/options.md`: edit the docstrings there, not this file.

Every option has one flat name: the flag of `flwr-sharded train` / `python -m flwr_sharded.train` (`--name`; booleans
also `--no-name`), the key of the Flower app's run config (`flwr run apps/llama_fl_hsdp --run-config 'name=value'`;
an empty string leaves an optional option unset), and, in YAML files, the dotted key in the second column.
Numbers must be finite; bounds and choices are checked before anything starts.
"""


def _default(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"`{value}`"


def _row(o: schema.Option, *cells: str, flag: bool = False) -> str:
    cells = (f"`{'--' if flag else ''}{o.name}`", *cells, " ".join(o.doc.split()))
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def render() -> str:
    from flwr_sharded.config import TrainConfig
    from flwr_sharded.flower.run_config import ROUND_KEYS, FlowerRun

    lines = [HEADER, "## Training (`flwr-sharded train`, YAML)", "",
             "| option | YAML key | type | default | meaning |", "|---|---|---|---|---|"]
    lines += [_row(o, f"`{o.key}`", o.type_name(), _default(o.default)) for o in schema.options(TrainConfig)]
    lines += ["", "## Flower run config (`apps/llama_fl_hsdp`)", "",
              "Defaults of a Flower run are sized for a CPU laptop. A strategy may override "
              f"{', '.join(f'`{k}`' for k in ROUND_KEYS)} for one round (its train config); the run's own values "
              "travel once, in the hello.", "",
              "| key | type | default | meaning |", "|---|---|---|---|"]
    run_options = schema.options(FlowerRun())
    lines += [_row(o, o.type_name(), _default(o.default)) for o in run_options if o.flat]
    lines += ["", "Training options that are not run-config keys, and why:", "", "| option | why |", "|---|---|"]
    lines += [f"| `{o.name}` | {o.not_flat} |" for o in run_options if not o.flat]
    return "\n".join(lines) + "\n"


GROUP_BEGIN = ("<!-- generated from flwr_sharded/flower/group/options.py by "
               "`flwr-sharded options --group-table docs/flower.md`: edit the docstrings there -->")
GROUP_END = "<!-- end of the generated group runtime options -->"


def render_group_table() -> str:
    """The group runtime's options (`GroupOptions`, hidden test switches left out) as a Markdown table."""
    from flwr_sharded.flower.group.options import GroupOptions

    lines = ["| option | default | meaning |", "|---|---|---|"]
    lines += [_row(o, "required" if o.required else _default(o.default), flag=True)
              for o in schema.options(GroupOptions)]
    return "\n".join(lines) + "\n"


def with_group_table(text: str) -> str:
    """`text` (docs/flower.md) with the generated group runtime table between its markers."""
    if GROUP_BEGIN not in text or GROUP_END not in text:
        raise ValueError("the group runtime table's markers are missing")
    head, rest = text.split(GROUP_BEGIN, 1)
    _, tail = rest.split(GROUP_END, 1)
    return f"{head}{GROUP_BEGIN}\n{render_group_table()}{GROUP_END}{tail}"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("options", help="print (or write) the option reference, from the schema",
                                   formatter_class=schema.HelpFormatter)
    parser.add_argument("--write", metavar="FILE", help="write it to FILE (docs/options.md)")
    parser.add_argument("--group-table", metavar="FILE",
                        help="rewrite the group runtime's option table in FILE (docs/flower.md) between its markers")
    parser.set_defaults(func=_run_options)


def _run_options(args: argparse.Namespace) -> int:
    if args.group_table:
        path = Path(args.group_table)
        path.write_text(with_group_table(path.read_text()))
        print(f"wrote the group runtime options into {path}")
    text = render()
    if args.write:
        Path(args.write).write_text(text)
        print(f"wrote {args.write}")
    elif not args.group_table:
        print(text, end="")
    return 0
