"""A module holds one concept, and a function does one thing: an alarm for a module over 450 lines or a function
over 80 in flwr_sharded/ or flwr_sharded_perf/ (split at a concept's edge, not at a number)."""

from __future__ import annotations

import ast

from tests import PACKAGES, REPO

MAX_FUNCTION_LINES, MAX_MODULE_LINES = 80, 450


def _oversized() -> list[str]:
    found = []
    for path in sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py")):
        name = path.relative_to(REPO).as_posix()
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            found.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    return found


def test_no_function_over_80_lines_and_no_module_over_450():
    assert not _oversized(), "one concept per module, one thing per function: " + "; ".join(_oversized())
