"""What a run config may make a group do on its node, as the SuperNode's node config allows. Torch-free.

Three run settings would let a run's submitter execute code or write files on a facility's node; a group accepts them
only where its node config allows (checked at hello, before it imports a rule or touches a path):

    allow-custom-rules = true             `outer = "package.module:Class"`: imports that module in every rank
    allowed-checkpoint-root = "/path"     `checkpoint-dir` (written, pruned, read back by `resume`) inside it
    allowed-save-root = "/path"           the final model's directory (the ServerApp's `run-dir`/model) inside it

Paths are resolved (symlinks, `..`, relative) first. An unset key allows nothing, except in a group the ClientApp
launches itself (local simulation, no `group-address`: the submitter's code on the submitter's side anyway), which
allows all three unless the node config sets any of them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from flwr_sharded.errors import ConfigError
from flwr_sharded.parallel.rules import RULES

ALLOW_RULES = "allow-custom-rules"
CHECKPOINT_ROOT = "allowed-checkpoint-root"
SAVE_ROOT = "allowed-save-root"
KEYS = (ALLOW_RULES, CHECKPOINT_ROOT, SAVE_ROOT)


def resolved_path(path: str) -> Path:
    """`path` as the file system will see it: user-expanded, relative to the working directory, symlinks and `..`
    resolved (also for the parts that do not exist yet)."""
    return Path(os.path.realpath(os.path.join(os.getcwd(), os.path.expanduser(path))))


def is_under(path: str, root: str) -> bool:
    """Whether `path` resolves to `root` or below it."""
    p, r = resolved_path(path), resolved_path(root)
    return p == r or r in p.parents


@dataclass(frozen=True)
class NodePolicy:
    """The node config's permissions for run configs; the default allows nothing."""

    custom_rules: bool = False
    """`outer = "package.module:Class"` may be imported."""
    checkpoint_root: str = ""
    """Checkpoint directories must lie under this absolute path; '': none allowed."""
    save_root: str = ""
    """The final model's directory must lie under this absolute path; '': none allowed."""

    @classmethod
    def open(cls) -> NodePolicy:
        return cls(custom_rules=True, checkpoint_root="/", save_root="/")

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any], *, launched: bool) -> NodePolicy:
        """The policy of a node config; `launched`: the ClientApp launches the group itself (no group-address),
        which allows everything unless the node config sets a policy key."""
        if launched and not any(key in node_config for key in KEYS):
            return cls.open()
        return cls.from_args(node_config, source="node config")

    @classmethod
    def from_args(cls, values: Any, source: str = "the hello's policy") -> NodePolicy:
        """From node-config keys (missing ones allow nothing; no mapping at all: nothing allowed)."""
        if not isinstance(values, Mapping):
            return cls()
        rules = values.get(ALLOW_RULES, False)
        if isinstance(rules, str) and rules.lower() in ("true", "false"):
            rules = rules.lower() == "true"
        if not isinstance(rules, bool):
            raise ConfigError(f"{source} {ALLOW_RULES} must be true or false, got {rules!r}")
        roots = []
        for key in (CHECKPOINT_ROOT, SAVE_ROOT):
            root = values.get(key, "")
            if not isinstance(root, str) or (root and not os.path.isabs(os.path.expanduser(root))):
                raise ConfigError(f"{source} {key} must be an absolute directory (or \"\" for none), got {root!r}")
            roots.append(os.path.expanduser(root))
        return cls(custom_rules=rules, checkpoint_root=roots[0], save_root=roots[1])

    def to_args(self) -> dict[str, Any]:
        """As node-config keys (what the ClientApp sends in the hello)."""
        return {ALLOW_RULES: self.custom_rules, CHECKPOINT_ROOT: self.checkpoint_root, SAVE_ROOT: self.save_root}

    # ----- checks ---------------------------------------------------------------------------------------------
    def check_run(self, run: Any, save_dir: str = "") -> None:
        """ConfigError naming the run-config key if the run (a `FlowerRun`) asks for what this policy does not
        allow; `save_dir`: where the ServerApp will ask this group to write the final model ('' for nowhere)."""
        outer = run.train.parallel.outer
        if ":" in outer and not self.custom_rules:
            raise ConfigError(f"run config 'outer' {outer!r} would import and run that module on this group, which "
                              f"its node config does not allow (the SuperNode's --node-config needs "
                              f"{ALLOW_RULES}=true); the built-in rules ({', '.join(RULES)}) need no permission")
        if run.train.checkpoint.dir:
            refused = self._refusal(run.train.checkpoint.dir, self.checkpoint_root, CHECKPOINT_ROOT,
                                    "run config 'checkpoint-dir'")
            if refused:
                raise ConfigError(refused)
        refused = self.save_dir_refusal(save_dir) if save_dir else ""
        if refused:
            raise ConfigError(refused)

    def save_dir_refusal(self, path: str) -> str:
        """'' if the final model may be written to `path`, else why not."""
        return self._refusal(path, self.save_root, SAVE_ROOT, "the final model's directory (the ServerApp's "
                             "run-dir/model, unset run-dir: under the SuperLink's working directory; "
                             "save-model=false saves none)")

    @staticmethod
    def _refusal(path: str, root: str, key: str, what: str) -> str:
        if not root:
            return (f"{what} {path!r}: this node's config allows no such directory (set {key}=\"/some/dir\" in the "
                    f"SuperNode's --node-config to allow directories under it)")
        if not is_under(path, root):
            return f"{what} {str(resolved_path(path))!r} is outside this node's {key} {root!r}"
        return ""
