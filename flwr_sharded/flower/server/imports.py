"""Which `package.module:Class` values of a run config the ServerApp may import, checked before anything is imported.

Whoever submits a run chooses its run config, and importing a module runs its top-level code on the machine of the
ServerApp (the SuperLink's). So `strategy` and `outer` are imported there only from

- the Flower app's own package (the app `flwr run` shipped, e.g. `llama_fl_hsdp.strategies.fedprox`: its code
  comes from the submitter anyway) and flwr_sharded itself, or
- modules the operator of that machine allows: `FLWR_SHARDED_ALLOWED_IMPORTS` in the environment the SuperLink
  starts the ServerApp with, comma-separated module names each allowing itself and its submodules
  (`mylab.strategies,otherlab`), or `*` for any module.

The run config cannot widen this. The groups check `outer` against their own node config (`node_policy`).
"""

from __future__ import annotations

import os

from flwr_sharded import schema
from flwr_sharded.flower.run_config import RUN_CONFIG, FlowerRun

ALLOWED_IMPORTS_ENV = "FLWR_SHARDED_ALLOWED_IMPORTS"
"""The operator's allow-list on the ServerApp's machine (comma-separated module names, or `*`)."""
OWN_PACKAGE = "flwr_sharded"


def operator_allowed() -> tuple[str, ...]:
    """The module names `FLWR_SHARDED_ALLOWED_IMPORTS` allows (with their submodules)."""
    return tuple(name.strip() for name in os.environ.get(ALLOWED_IMPORTS_ENV, "").split(",") if name.strip())


def is_allowed(module: str, app_package: str = "") -> bool:
    """Whether the ServerApp may import `module`: the app's package, flwr_sharded, or the operator's list."""
    roots = (OWN_PACKAGE, app_package, *operator_allowed())
    return "*" in roots or any(root and (module == root or module.startswith(root + ".")) for root in roots)


def check_import(value: str, key: str, app_package: str = "") -> None:
    """ConfigError naming the run-config `key` unless `value` is `package.module:Class` and may be imported here."""
    label = RUN_CONFIG.label(schema.by_name(FlowerRun)[key])
    module, sep, attr = value.partition(":")
    if not sep or not attr.isidentifier() or not all(part.isidentifier() for part in module.split(".")):
        raise RUN_CONFIG.error(f"{label} {value!r} must be package.module:Class")
    if is_allowed(module, app_package):
        return
    app = f"the app's package ({app_package}, e.g. {app_package}.strategies), " if app_package else ""
    raise RUN_CONFIG.error(f"{label} {value!r}: the ServerApp imports modules of {app}{OWN_PACKAGE} and those its "
                           f"operator allows, and {module!r} is none of them; ship the module inside the app, or set "
                           f"{ALLOWED_IMPORTS_ENV}={module} (comma-separated module names) in the "
                           f"environment the SuperLink runs in")


def check_run_imports(run: FlowerRun, app_package: str = "") -> None:
    """Check every import the run config asks of the ServerApp (`strategy`, an `outer` rule given by path)."""
    if run.federation.strategy:
        check_import(run.federation.strategy, "strategy", app_package)
    if ":" in run.train.parallel.outer:
        check_import(run.train.parallel.outer, "outer", app_package)

