"""Layers that point one way: no import cycle between the packages' modules or subpackages, `parallel/` free of
`config` and `training`, the training package free of the tools (`flwr_sharded_perf`, which only its command line
dispatches to), the planner free of torch.

Imports are read with `ast` (module-level and inside functions, relative ones resolved, `if TYPE_CHECKING:` blocks
skipped). An import names the module it reads from: `from pkg import name` is an edge to `pkg.name` when that is a
module, else to `pkg` (its `__init__`, with whatever that re-exports). Importing `pkg.sub` is not counted as an edge
to `pkg`'s `__init__`: Python runs it, but the package's `__init__`s only document and re-export.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import REPO

PACKAGE = "flwr_sharded"
PACKAGE_DIR = REPO / PACKAGE
TOOLS = "flwr_sharded_perf"
FORBIDDEN_IN_PARALLEL = ("flwr_sharded.config", "flwr_sharded.training")


def module_files() -> dict[str, Path]:
    """Every module of the package and of its tools by dotted name (a package's name for its `__init__.py`)."""
    modules = {}
    tools = REPO / TOOLS
    for path in sorted([*PACKAGE_DIR.rglob("*.py"), *(tools.rglob("*.py") if tools.is_dir() else [])]):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements anywhere in `tree`, except under `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return found


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is one of the package's modules."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def imported_modules(module: str, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `module` imports (at any depth of its code)."""
    is_package = modules[module].name == "__init__.py"
    tree = ast.parse(modules[module].read_text(), filename=str(modules[module]))
    targets: set[str] = set()
    for node in _imports(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            if node.level:
                base = module.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                     for alias in node.names]
        targets.update(t for t in (_known(n, modules) for n in names if n.startswith(PACKAGE)) if t)
    targets.discard(module)
    return targets


def module_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {module: imported_modules(module, modules) for module in modules}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    for start in sorted(graph):
        if start in state:
            continue
        path = [start]
        state[start] = 1
        pending = [iter(sorted(graph[start]))]
        while pending:
            nxt = next(pending[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                pending.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                pending.append(iter(sorted(graph.get(nxt, ()))))
    return None


def unit_graphs(graph: dict[str, set[str]]) -> dict[str, dict[str, set[str]]]:
    """For each package, the graph between its direct children (a child stands for everything under it)."""
    packages = {m for m in graph if any(other.startswith(m + ".") for other in graph)}
    units: dict[str, dict[str, set[str]]] = {p: {} for p in packages}
    for source, targets in graph.items():
        for target in targets:
            for package in packages:
                prefix = package + "."
                if not (source.startswith(prefix) and target.startswith(prefix)):
                    continue
                a = prefix + source[len(prefix):].split(".")[0]
                b = prefix + target[len(prefix):].split(".")[0]
                units[package].setdefault(a, set())
                if a != b:
                    units[package][a].add(b)
    return units


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return module_graph()


def test_no_import_cycle_between_modules(graph):
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle between modules: " + " -> ".join(cycle)


def test_no_import_cycle_between_subpackages(graph):
    for package, units in sorted(unit_graphs(graph).items()):
        cycle = find_cycle(units)
        assert cycle is None, f"import cycle between the parts of {package}: " + " -> ".join(cycle)


def test_parallel_imports_neither_config_nor_training(graph):
    offending = sorted(f"{source} imports {target}" for source, targets in graph.items()
                       if (source + ".").startswith(PACKAGE + ".parallel.") for target in targets
                       if any(target == f or target.startswith(f + ".") for f in FORBIDDEN_IN_PARALLEL))
    assert not offending, "\n".join(offending)


def test_only_the_command_line_reaches_the_tools(graph):
    offending = sorted(f"{source} imports {target}" for source, targets in graph.items()
                       if (source + ".").startswith(PACKAGE + ".") and source != f"{PACKAGE}.cli"
                       for target in targets if target == TOOLS or target.startswith(TOOLS + "."))
    assert not offending, "\n".join(offending)


def test_finds_a_cycle_and_names_it():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    units = unit_graphs({"p.x.m": {"p.y.n"}, "p.y.n": {"p.x.k"}, "p.x.k": set(), "p.x": set(), "p.y": set(),
                         "p": set()})
    assert find_cycle(units["p"]) == ["p.x", "p.y", "p.x"]


def test_resolves_relative_function_level_and_skips_type_checking(tmp_path, monkeypatch):
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "base.py").write_text("")
    (pkg / "other.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .leaf import x\n")
    (pkg / "sub" / "leaf.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from flwr_sharded import other\n"
        "def f():\n    from .. import base\n    import flwr_sharded.sub\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE_DIR", pkg)
    graph = module_graph()
    assert graph[f"{PACKAGE}.sub.leaf"] == {f"{PACKAGE}.base", f"{PACKAGE}.sub"}
    assert graph[f"{PACKAGE}.sub"] == {f"{PACKAGE}.sub.leaf"}


PLANNER_PROBE = """
import json, sys
import flwr_sharded_perf.planner
from flwr_sharded.cli import main
code = main(["plan", "--cluster", sys.argv[1], "--model", "llama3.1-8b"])
print(json.dumps([code, sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))]))
"""


@pytest.mark.dist
def test_planner_runs_without_torch():
    """`flwr-sharded plan` (the planner's command) on the Leonardo example, in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", PLANNER_PROBE, str(REPO / "examples/clusters/leonardo.yaml")],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    code, loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert code == 0 and "Recommended:" in proc.stdout, proc.stdout + proc.stderr
    assert loaded == [], f"the planner loaded torch: {loaded[:5]}"


ADAPTER = f"{PACKAGE}.training.transformers_adapter"


def transformers_private_names() -> set[str]:
    """The private members transformers adds to a model (`PreTrainedModel`'s beyond `nn.Module`'s) and the flag its
    init functions read on tensors."""
    from torch import nn
    from transformers import PreTrainedModel

    from flwr_sharded.training.transformers_adapter import HF_INITIALIZED

    return {name for name in dir(PreTrainedModel) if name.startswith("_") and not name.startswith("__")
            and not hasattr(nn.Module, name)} | {HF_INITIALIZED}


def transformers_internals_used(path: Path, private: set[str]) -> list[str]:
    """What a module takes from transformers beyond its public top-level names: an import of or from a submodule
    (`transformers.initialization`, `transformers.core_model_loading`, ...) or of an underscore name, and any use
    (attribute or string) of one of `private`."""
    found = []
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in _imports(tree):
        modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        names = [] if isinstance(node, ast.Import) else [a.name for a in node.names]
        if any(m.startswith("transformers.") for m in modules) or (modules == ["transformers"] and any(
                n.startswith("_") or importlib.util.find_spec(f"transformers.{n}") for n in names)):
            found.append(f"line {node.lineno}: imports {', '.join(modules)} {', '.join(names)}".strip())
    for node in ast.walk(tree):
        name = node.attr if isinstance(node, ast.Attribute) else node.value if isinstance(node, ast.Constant) else None
        if isinstance(name, str) and name in private:
            found.append(f"line {node.lineno}: {name}")
    return found


def test_only_the_adapter_reaches_into_transformers_internals():
    """Every private or version-dependent internal of transformers is used through
    `training/transformers_adapter.py` alone, so that a release that renames one breaks that file only."""
    private = transformers_private_names()
    assert {"_init_weights", "_no_split_modules", "_is_hf_initialized"} <= private
    offending = [f"{module} {use}" for module, path in module_files().items() if module != ADAPTER
                 for use in transformers_internals_used(path, private)]
    assert not offending, "\n".join(offending)
    assert transformers_internals_used(module_files()[ADAPTER], private)  # the check sees what the adapter does
