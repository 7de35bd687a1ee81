"""A module holds one concept, and a function does one thing: an alarm, far above what either needs, for a module
over 800 lines or a function over 120 in flwr_sharded/ (split at a concept's edge, not at a number)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "flwr_sharded"
MAX_FUNCTION_LINES, MAX_MODULE_LINES = 120, 800


def _oversized() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            found.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    return found


def test_no_function_over_120_lines_and_no_module_over_800():
    assert not _oversized(), "one concept per module, one thing per function: " + "; ".join(_oversized())
