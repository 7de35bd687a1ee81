"""The conversion plan: each tensor of a model as the tensors of a Hugging Face checkpoint it is made of, under the
names and conversions `from_pretrained` applies (transformers' conversion mapping, through `transformers_adapter`:
key renames, per-expert tensors fused into 3-D ones), planned from names and shapes alone (`conversion_plan`); and
back, the tensors `save_pretrained` writes (`published_layout`: the mapping reversed). No file is read or written
here: `hf_reader` reads rows through a plan, `hf_writer` writes them.

A plan's unit is a `StoredPart`: one checkpoint tensor, whole, at an index of its model tensor (or transposed), so
any range of model rows is read from, or written to, the checkpoint rows it meets (`StoredPart.in_rows`). Each
converter's operations are read in order by `OPERATIONS` (stacking, concatenating: row-wise; a 2-D transpose: column
by column); any other is refused, naming it. A family's quirk: see `transformers_adapter`'s docstring.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from flwr_sharded.errors import ConfigError
from flwr_sharded.training.models import build_meta_model, canonical_name, saved_tensors
from flwr_sharded.training.transformers_adapter import (Converter, LoadMapping, Operation, checkpoint_key_order,
                                                        ignored_key_patterns, published_state)


@dataclass(frozen=True)
class StoredPart:
    """One checkpoint tensor inside a model tensor: `model_tensor[index]` is `stored`, whole (`index`: an int for each
    dimension the tensor is stacked along, a slice for each of the others, one entry per model dimension), or its
    transpose (`transposed`: a 2-D tensor alone, the model's row r its column r)."""

    stored: str
    index: tuple[int | slice, ...]
    transposed: bool = False

    def in_rows(self, shape: tuple[int, ...], lo: int, hi: int) -> tuple[tuple[int | slice, ...], int, int] | None:
        """Where this part (its checkpoint tensor of `shape`) meets rows `[lo, hi)` of its model tensor: (index into
        those rows, the part's first and last + 1 row), or None. Scalars: rows `[0, 1)`."""
        if not self.index:
            return ((), 0, 1) if lo == 0 else None
        first = self.index[0]
        if isinstance(first, int):
            if not lo <= first < hi:
                return None
            return (first - lo, *self.index[1:]), 0, shape[0] if shape else 1
        a, b = max(lo, first.start), min(hi, first.stop)
        if a >= b:
            return None
        return (slice(a - lo, b - lo), *self.index[1:]), a - first.start, b - first.start


Plan = dict[str, list[StoredPart]]
"""Model tensor name -> the checkpoint tensors it is made of (one, or several a conversion fuses)."""

ROW_WISE_OPS = ("MergeModulelist", "Concatenate")
"""The conversions of transformers' mapping that are read row by row: stacking per-expert tensors (a model row of a
3-D expert tensor is one expert) and concatenating along any dimension (each model row is a row of one source, or
the concatenation of the same row of each)."""
COLUMN_OPS = ("Transpose",)
"""The conversion that is not row-wise but is read (and written) with bounded memory: a 2-D tensor's transpose, whose
model rows are checkpoint columns, read in pieces of checkpoint rows, each cut to the rank's columns."""


def expected_tensors(model: nn.Module) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...] | None]]:
    """(name -> full shape of every tensor a checkpoint must hold, name -> shape (None: any) of those it may hold: a
    tied weight under its second name, ignored as `from_pretrained` does, and the non-persistent buffers)."""
    need = {name: tuple(t.shape) for name, t in saved_tensors(model)}
    may: dict[str, tuple[int, ...] | None] = {canonical_name(n): tuple(p.shape) for n, p in
                                              model.named_parameters(remove_duplicate=False)
                                              if canonical_name(n) not in need}
    for module_name, module in model.named_modules():
        for name in module._non_persistent_buffers_set:
            may[canonical_name(f"{module_name}.{name}" if module_name else name)] = None
    return need, may


def ignored(model: nn.Module, name: str) -> bool:
    """A checkpoint tensor that `from_pretrained` drops silently (old rotary buffers, the model's own patterns)."""
    return any(re.search(p, name) for p in ignored_key_patterns(model))


def _full(shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in shape)


def _shift(entry: int | slice, offset: int) -> int | slice:
    return entry + offset if isinstance(entry, int) else slice(entry.start + offset, entry.stop + offset)


Group = list[tuple[tuple[int, ...], list[StoredPart]]]
"""The tensors of one source pattern as a converter has made them so far: (shape, parts) each."""


@dataclass
class Fusion:
    """One model tensor (`target`, model shape `expected`) being made by `converter` from the checkpoint keys
    `sources` (by source pattern, in checkpoint order), operation by operation: `groups`, by pattern."""

    target: str
    converter: Converter
    sources: dict[str, list[str]]
    expected: tuple[int, ...] | None
    groups: dict[str, Group]


def _stack(fusion: Fusion, op: Operation) -> None:
    """MergeModulelist: each pattern's tensors stacked along `dim` (experts: numbered 0, 1, ...)."""
    dim = op.fields["dim"]
    for pattern, group in fusion.groups.items():
        _check_numbered(fusion.target, pattern, fusion.sources.get(pattern, []))
        if len({shape for shape, _ in group}) != 1:
            raise ConfigError(f"--model: {fusion.target} stacks tensors of different shapes "
                              f"({sorted({shape for shape, _ in group})})")
        shape = group[0][0]
        pieces = [StoredPart(p.stored, p.index[:dim] + (i,) + p.index[dim:])
                  for i, (_, ps) in enumerate(group) for p in ps]
        fusion.groups[pattern] = [(shape[:dim] + (len(group),) + shape[dim:], pieces)]


def _concatenate(fusion: Fusion, op: Operation) -> None:
    """Concatenate: the source patterns' tensors, in their order, one after the other along `dim`."""
    dim = op.fields["dim"]
    group = [part for pattern in fusion.converter.source_patterns for part in fusion.groups.get(pattern, [])]
    if len({shape[:dim] + shape[dim + 1:] for shape, _ in group}) != 1:
        raise ConfigError(f"--model: {fusion.target} concatenates tensors of incompatible shapes "
                          f"({[list(shape) for shape, _ in group]})")
    offset, pieces = 0, []
    for shape, ps in group:
        pieces += [StoredPart(p.stored, p.index[:dim] + (_shift(p.index[dim], offset),) + p.index[dim + 1:])
                   for p in ps]
        offset += shape[dim]
    first = group[0][0]
    fusion.groups = {fusion.converter.target_patterns[0]: [(first[:dim] + (offset,) + first[dim + 1:], pieces)]}


def _transpose(fusion: Fusion, op: Operation) -> None:
    """Transpose of one whole 2-D checkpoint tensor (with `check_dims`, as transformers: only one that does not fit
    the model's shape); any other transpose is refused."""
    if not _transposable(fusion.groups, op):
        raise _not_read(fusion, op)
    [(pattern, [(shape, [piece])])] = fusion.groups.items()
    if not (op.fields["check_dims"] and shape == fusion.expected):
        fusion.groups = {pattern: [(shape[::-1], [StoredPart(piece.stored, _full(shape[::-1]), transposed=True)])]}


OPERATIONS: dict[str, Callable[[Fusion, Operation], None]] = {
    "MergeModulelist": _stack, "Concatenate": _concatenate, "Transpose": _transpose}
"""How the plan reads each operation of transformers' converters it can read (`ROW_WISE_OPS`, `COLUMN_OPS`); the
attributes each needs come from `transformers_adapter.OPERATION_FIELDS`."""


def _not_read(fusion: Fusion, op: Operation) -> ConfigError:
    return ConfigError(f"--model: {fusion.target} is converted from {sorted(fusion.sources)} by transformers' "
                       f"{op.kind}, which the sharded loader does not read (it reads {', '.join(ROW_WISE_OPS)} row by "
                       f"row and a 2-D tensor's {', '.join(COLUMN_OPS)} column by column)")


def _assemble(converter: Converter, target: str, sources: dict[str, list[str]], shapes: dict[str, tuple[int, ...]],
              expected: tuple[int, ...] | None) -> tuple[tuple[int, ...], list[StoredPart]]:
    """(shape, pieces) of `target` (model shape `expected`) as transformers' `converter` builds it from the checkpoint
    keys `sources` (by source pattern, in checkpoint order); ConfigError for an operation `OPERATIONS` lacks."""
    groups = {pattern: [(shapes[k], [StoredPart(k, _full(shapes[k]))]) for k in keys]
              for pattern, keys in sources.items()}
    fusion = Fusion(target, converter, sources, expected, groups)
    for op in converter.operations:
        if op.kind not in OPERATIONS:
            raise _not_read(fusion, op)
        OPERATIONS[op.kind](fusion, op)
    result = [part for group in fusion.groups.values() for part in group]
    if len(result) != 1:
        raise ConfigError(f"--model: {target}: its conversion leaves {len(result)} tensors, not one")
    return result[0]


def _check_numbered(target: str, pattern: str, keys: list[str]) -> None:
    """Tensors stacked by the number in their pattern's `*` (experts: the key's last numeric segment, after the
    layer's) must be numbered 0, 1, ... in order, as stacking them in key order assumes."""
    numbers = [[int(part) for part in key.split(".") if part.isdigit()] for key in keys]
    if "*" not in pattern or not all(numbers):
        return
    found = [n[-1] for n in numbers]
    if found != list(range(len(keys))):
        raise ConfigError(f"--model: {target} stacks the checkpoint's {pattern} numbered {found}, not 0 to "
                          f"{len(keys) - 1}")


def _transposable(groups: dict[str, Group], op: Operation) -> bool:
    """Whether a Transpose applies to one whole 2-D checkpoint tensor (the one transpose read column by column)."""
    group = [part for parts_of in groups.values() for part in parts_of]
    if len(group) != 1 or len(group[0][1]) != 1 or {op.fields["dim0"] % 2, op.fields["dim1"] % 2} != {0, 1}:
        return False
    shape, [piece] = group[0]
    return len(shape) == 2 and not piece.transposed and piece.index == _full(shape)


def conversion_plan(model: nn.Module, stored: dict[str, tuple[int, ...]], where: str = "") -> tuple[Plan, list[str]]:
    """(plan, unexpected): each model tensor's checkpoint tensors, named and converted as `from_pretrained` does
    (transformers' conversion mapping: key renames, per-expert tensors fused; `model`: an unwrapped model, e.g. on
    meta), and the checkpoint tensors no model tensor takes. ConfigError for a shape that does not fit or a conversion
    that is not row-wise. `where` names the checkpoint in errors."""
    need, may = expected_tensors(model)
    targets: dict[str, tuple[int, ...] | None] = {**may, **need}
    present = {k: v if v is not None else () for k, v in targets.items()}  # what transformers' lookup needs
    mapping = LoadMapping(model)
    plan: Plan = {}
    fused: dict[str, tuple[Converter, dict[str, list[str]]]] = {}
    unexpected = []
    for key in sorted(stored, key=checkpoint_key_order):
        name, pattern = mapping.rename(key, present)
        if name not in targets and key in targets:  # as from_pretrained: a name that needs no renaming
            name, pattern = key, None
        if name not in targets:
            if not (ignored(model, key) or ignored(model, name)):
                unexpected.append(key)
        elif name in plan:
            raise ConfigError(f"--model: the checkpoint{where} holds {name} twice ({plan[name][0].stored}, {key})")
        elif pattern is None:
            plan[name] = [StoredPart(key, _full(stored[key]))]
        else:
            fused.setdefault(name, (mapping.converters[pattern], {}))[1].setdefault(pattern, []).append(key)
    wrong = []
    for name, (converter, sources) in fused.items():
        if name in plan:
            raise ConfigError(f"--model: the checkpoint{where} holds {name} both whole and as {sorted(sources)}")
        shape, pieces = _assemble(converter, name, sources, stored, targets[name])
        plan[name] = pieces
        if targets[name] is not None and shape != targets[name]:
            wrong.append(f"{name}: checkpoint {list(shape)} (from {len(pieces)} tensors) != model "
                         f"{list(targets[name])}")
    wrong = [f"{n}: checkpoint {list(stored[p[0].stored])} != model {list(targets[n])}" for n, p in plan.items()
             if n not in fused and targets[n] is not None and stored[p[0].stored] != targets[n]] + wrong
    if wrong:
        raise ConfigError(f"{mismatch_message(model, where)}: {len(wrong)} shape mismatch(es), e.g. "
                          f"{'; '.join(wrong[:3])}")
    return plan, unexpected


def mismatch_message(model: nn.Module, where: str) -> str:
    """The start of an error for a checkpoint (`where`) that does not fit `model`'s architecture."""
    return f"--model: the checkpoint{where} does not match its {type(model).__name__} " \
           f"({getattr(model.config, 'model_type', '?')}) architecture"


def reference_model(model: nn.Module) -> nn.Module:
    """`model`'s architecture on the meta device, unwrapped (FSDP renames the classes transformers' mapping is keyed
    by): what the conversion plans are made from."""
    return build_meta_model(model.config)


def published_layout(model: nn.Module) -> tuple[list[tuple[str, tuple[int, ...]]], Plan]:
    """(names and shapes, plan): the tensors `save_pretrained` writes for `model`, in the family's published layout
    (transformers' conversion mapping reversed, as `save_pretrained` does: e.g. GPT-NeoX's `embed_out.weight`,
    Mixtral's per-expert `block_sparse_moe.experts.{i}.w1.weight`), found on meta tensors, and the plan that reads
    them back (`conversion_plan`): which rows of which model tensor each is."""
    reference = reference_model(model)
    tensors = saved_tensors(reference)
    try:
        reverted = published_state(reference, {n: torch.empty(t.shape, device="meta") for n, t in tensors})
    except (ValueError, RuntimeError, NotImplementedError) as exc:  # an operation without a reverse, or not on meta
        raise ConfigError(f"--model: cannot plan {type(reference).__name__}'s published layout (transformers' reverse "
                          f"conversion): {exc}") from exc
    shapes = [(name, tuple(t.shape)) for name, t in reverted.items()]
    plan, unexpected = conversion_plan(reference, dict(shapes), " save_pretrained writes")
    missing = sorted({name for name, _ in tensors} - set(plan))
    if missing or unexpected:
        raise ConfigError(f"--model: {type(reference).__name__}'s published layout does not read back: "
                          f"{missing[:3]} missing, {unexpected[:3]} unexpected")
    return shapes, plan
