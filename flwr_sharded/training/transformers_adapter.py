"""Every reach into transformers beyond its public API, in one file: the checkpoint conversion mapping (key renames,
fused tensors) that `from_pretrained` and `save_pretrained` apply, a model's own weight init, and the class attributes
of `PreTrainedModel` the package reads. The rest of the package imports transformers' internals only through this
module (`tests/test_layers.py` checks it), so a release that renames one breaks this file alone, and loudly: every
internal is looked up when it is used (monkeypatching transformers still works), and one that is missing raises
`TransformersAPIError`, naming the installed release and the API, never a silent fallback. `check_available` looks
them all up at once (`tests/training/test_transformers_adapter.py`).

Tested against transformers 5.6.0 (the floor, pyproject.toml's `transformers>=5.6`: `make test-floors`), 5.17.0 (the
lent GPU image's: `make gpu-rehearsal`) and 5.25.0 (the release `make setup` installs). Between them
`rename_source_key`'s fourth parameter was renamed (`prefix`, then `base_model_prefix`): it is passed by position.

A model family's conversion quirk is added here or in `hf_conversion` alone:
- a renaming or converter transformers' mapping lacks: `register_family_conversion(model_type, [WeightRenaming(...)
  or WeightConverter(...)])` once, before the model is built; transformers' own lookup then applies it, so
  `from_pretrained`, `save_pretrained`, the sharded reader's plan and the writer's published layout all agree;
- a conversion operation the sharded reader does not read yet: its reading in `hf_conversion.OPERATIONS`, and here,
  in `OPERATION_FIELDS`, the attributes of transformers' operation object it needs;
- a checkpoint tensor `from_pretrained` drops silently: its pattern in `IGNORED_KEYS`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

TESTED_RELEASES = ("5.6.0", "5.17.0", "5.25.0")
"""The transformers releases this module is tested against (module docstring)."""

INIT_FUNCTIONS = ("normal_", "uniform_", "trunc_normal_", "constant_", "ones_", "zeros_", "copy_", "eye_", "dirac_",
                  "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
                  "lecun_normal_", "default_flax_embed_init_")
"""The functions of `transformers.initialization` a model's `_init_weights` calls (`replaced_init_functions`)."""

MODEL_ATTRIBUTES = ("_init_weights", "initialize_weights", "_no_split_modules", "_keys_to_ignore_on_load_unexpected",
                    "base_model_prefix")
"""The attributes of `PreTrainedModel` read here (and nowhere else in the package)."""

INTERNALS = (("conversion_mapping", "get_model_conversion_mapping"),
             ("conversion_mapping", "get_checkpoint_conversion_mapping"),
             ("conversion_mapping", "register_checkpoint_conversion_mapping"),
             ("core_model_loading", "WeightConverter"), ("core_model_loading", "WeightRenaming"),
             ("core_model_loading", "rename_source_key"), ("core_model_loading", "dot_natural_key"),
             ("core_model_loading", "revert_weight_conversion"), ("modeling_utils", "PreTrainedModel"),
             *(("initialization", name) for name in INIT_FUNCTIONS))
"""Every (module, name) of transformers this module uses."""

OPERATION_FIELDS = {"MergeModulelist": ("dim",), "Concatenate": ("dim",), "Transpose": ("dim0", "dim1", "check_dims")}
"""The conversion operations the sharded reader reads (`hf_conversion.OPERATIONS`) and the attributes of each."""

IGNORED_KEYS = (r"rotary_emb\.inv_freq$",)
"""Checkpoint tensors `from_pretrained` drops silently for every family (old rotary buffers)."""

HF_INITIALIZED = "_is_hf_initialized"
"""The flag on a tensor that transformers' init functions skip it for (`transformers.initialization`)."""


class TransformersAPIError(Exception):
    """An internal of transformers this package needs is missing from the installed release."""


def _version() -> str:
    import transformers

    return transformers.__version__


def _missing(api: str, reason: str) -> TransformersAPIError:
    return TransformersAPIError(f"transformers {_version()} lacks {api} ({reason}), which flwr_sharded needs; it is "
                                f"tested against transformers {', '.join(TESTED_RELEASES)} "
                                f"(flwr_sharded/training/transformers_adapter.py)")


def internal(module: str, name: str) -> Any:
    """`transformers.<module>.<name>`, looked up now; `TransformersAPIError` when the release lacks it."""
    try:
        found = importlib.import_module(f"transformers.{module}")
    except ImportError as exc:
        raise _missing(f"transformers.{module}", f"cannot import it: {exc}") from exc
    if not hasattr(found, name):
        raise _missing(f"transformers.{module}.{name}", "no such name")
    return getattr(found, name)


def model_attribute(model: nn.Module, name: str) -> Any:
    """`PreTrainedModel.<name>` of `model` (None where the class sets none); `TransformersAPIError` when
    `PreTrainedModel` no longer declares it."""
    if not hasattr(internal("modeling_utils", "PreTrainedModel"), name):
        raise _missing(f"PreTrainedModel.{name}", "no such attribute")
    return getattr(model, name, None)


def check_available() -> None:
    """Look up every internal this module wraps (`INTERNALS`, `MODEL_ATTRIBUTES`, the conversion operations and the
    `_is_hf_initialized` flag); `TransformersAPIError` for the first one missing."""
    for module, name in INTERNALS:
        internal(module, name)
    pretrained = internal("modeling_utils", "PreTrainedModel")
    for name in MODEL_ATTRIBUTES:
        if not hasattr(pretrained, name):
            raise _missing(f"PreTrainedModel.{name}", "no such attribute")
    for kind, fields in OPERATION_FIELDS.items():
        operation = internal("core_model_loading", kind)()
        absent = [f for f in fields if not hasattr(operation, f)]
        if absent:
            raise _missing(f"transformers.core_model_loading.{kind}.{absent[0]}", "no such attribute")
    if HF_INITIALIZED not in inspect.getsource(importlib.import_module("transformers.initialization")):
        raise _missing(f"the {HF_INITIALIZED} flag of transformers.initialization", "its functions no longer read it")


# --------------------------------------------------------------------------------------- the conversion mapping

@dataclass(frozen=True)
class Operation:
    """One operation of a converter, as the sharded reader reads it: transformers' class name and the attributes
    `OPERATION_FIELDS` names for it (`fields`, by name; none for an operation the reader does not read)."""

    kind: str
    fields: dict[str, Any]


@dataclass(frozen=True)
class Converter:
    """A `core_model_loading.WeightConverter`: the checkpoint key patterns it fuses into its target patterns, and
    its operations in order."""

    source_patterns: tuple[str, ...]
    target_patterns: tuple[str, ...]
    operations: tuple[Operation, ...]


def _operation(op: Any) -> Operation:
    kind = type(op).__name__
    fields = {}
    for field in OPERATION_FIELDS.get(kind, ()):
        if not hasattr(op, field):
            raise _missing(f"transformers.core_model_loading.{kind}.{field}", "no such attribute")
        fields[field] = getattr(op, field)
    return Operation(kind, fields)


class LoadMapping:
    """transformers' conversion mapping of a model as `from_pretrained` applies it to checkpoint keys (wraps
    `conversion_mapping.get_model_conversion_mapping(model, add_legacy=True)`, `core_model_loading.WeightRenaming`
    and `WeightConverter`, and `rename_source_key`)."""

    def __init__(self, model: nn.Module) -> None:
        transforms = internal("conversion_mapping", "get_model_conversion_mapping")(model, add_legacy=True)
        renaming, converter = (internal("core_model_loading", n) for n in ("WeightRenaming", "WeightConverter"))
        self._renamings = [t for t in transforms if isinstance(t, renaming)]
        self._converters = [t for t in transforms if isinstance(t, converter)]
        self._prefix = model_attribute(model, "base_model_prefix")
        self.converters = {pattern: Converter(tuple(c.source_patterns), tuple(c.target_patterns),
                                              tuple(_operation(op) for op in c.operations))
                           for c in self._converters for pattern in c.source_patterns}
        """Source pattern -> the converter it belongs to."""

    def rename(self, key: str, present: dict[str, Any]) -> tuple[str, str | None]:
        """(model name, the source pattern of the converter that takes it, or None) of checkpoint `key`; `present`:
        the model's tensor names (the base model prefix is added or dropped to match them)."""
        rename = internal("core_model_loading", "rename_source_key")
        return rename(key, self._renamings, self._converters, self._prefix, present)  # 4th: prefix, base_model_prefix


def checkpoint_key_order(key: str) -> Any:
    """The sort key `from_pretrained` reads checkpoint keys in (`core_model_loading.dot_natural_key`: numbers by
    value)."""
    return internal("core_model_loading", "dot_natural_key")(key)


def published_state(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (the model's state, e.g. on meta) named and converted as `save_pretrained` writes them (wraps
    `core_model_loading.revert_weight_conversion`: the mapping without legacy renamings, reversed)."""
    return internal("core_model_loading", "revert_weight_conversion")(model, tensors)


def register_family_conversion(model_type: str, transforms: list[Any]) -> None:
    """Add `transforms` (`WeightRenaming`/`WeightConverter`s) before the conversion mapping transformers has for
    `model_type`, for every later lookup: `from_pretrained`, `save_pretrained` and this package's (wraps
    `conversion_mapping.get_checkpoint_conversion_mapping` and `register_checkpoint_conversion_mapping`)."""
    existing = internal("conversion_mapping", "get_checkpoint_conversion_mapping")(model_type) or []
    internal("conversion_mapping", "register_checkpoint_conversion_mapping")(model_type, [*transforms, *existing],
                                                                             overwrite=True)


def ignored_key_patterns(model: nn.Module) -> list[str]:
    """The patterns of checkpoint keys `from_pretrained` drops silently: `IGNORED_KEYS` and the model's own
    (`PreTrainedModel._keys_to_ignore_on_load_unexpected`)."""
    return [*IGNORED_KEYS, *(model_attribute(model, "_keys_to_ignore_on_load_unexpected") or [])]


def block_class_names(model: nn.Module) -> set[str]:
    """The class names of the model's repeated blocks (`PreTrainedModel._no_split_modules`)."""
    return set(model_attribute(model, "_no_split_modules") or [])


# ------------------------------------------------------------------------------------------ the model's own init

@contextmanager
def replaced_init_functions(replacements: dict[str, Callable[..., torch.Tensor]]) -> Iterator[None]:
    """The functions of `transformers.initialization` named in `replacements` (of `INIT_FUNCTIONS`) replaced while
    the block runs (torch.nn.init's too while a model initialises: `guard_torch_init_functions` installs them)."""
    saved = {name: internal("initialization", name) for name in replacements}
    module = importlib.import_module("transformers.initialization")
    try:
        for name, func in replacements.items():
            setattr(module, name, func)
        yield
    finally:
        for name, func in saved.items():
            setattr(module, name, func)


def run_initialize_weights(model: nn.Module, around: Callable[[nn.Module, Callable[[], None]], None]) -> None:
    """`model.initialize_weights()` (`PreTrainedModel.initialize_weights`), each call of a sub-model's own
    `_init_weights(module)` made through `around(module, call)`; the `_is_hf_initialized` flags it leaves on modules
    are cleared afterwards."""
    pretrained = internal("modeling_utils", "PreTrainedModel")
    model_attribute(model, "_init_weights")
    subs = [m for m in model.modules() if isinstance(m, pretrained)]

    def tracking(sub: nn.Module) -> Callable[[nn.Module], None]:
        own = type(sub)._init_weights.__get__(sub)

        def init_weights(module: nn.Module) -> None:
            around(module, lambda: own(module))
        return init_weights

    try:
        for sub in subs:
            sub._init_weights = tracking(sub)
        model_attribute(model, "initialize_weights")()
    finally:
        for sub in subs:
            sub.__dict__.pop("_init_weights", None)
        for module in model.modules():
            module.__dict__.pop(HF_INITIALIZED, None)


def init_module_buffers(model: nn.Module, module: nn.Module) -> None:
    """The model's own `_init_weights` (`PreTrainedModel._init_weights`) on `module`, its parameters marked
    initialised (`_is_hf_initialized`) so that transformers' init functions leave them untouched."""
    init_weights = model_attribute(model, "_init_weights")
    if init_weights is None:
        return
    own = [p for p in module._parameters.values() if p is not None]
    for param in own:
        setattr(param, HF_INITIALIZED, True)
    try:
        init_weights(module)
    finally:
        for param in own:
            delattr(param, HF_INITIALIZED)
