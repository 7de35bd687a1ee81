"""Sharded start-up: the model built on the meta device and sharded with FSDP2, then only each rank's rows allocated
and filled, from a pretrained checkpoint or by a seeded init. The seeded init is the model's own: its
`_init_weights` runs once on the meta model with `transformers.initialization`'s functions replaced by recorders
(`record_init`), which note per parameter what it does (normal, uniform, truncated normal, constant, a copy) and to
which rows; each rank then applies those ops to its own rows, every random op drawn in fixed blocks of
`INIT_BLOCK_ROWS` rows of the full parameter (a 3-D parameter's rows: all its dimensions but the last flattened),
each block seeded by (seed, name, block): the same full parameters for any F, R, S and device. Buffers come from the
model's own `_init_weights` too. Each of those reaches into transformers goes through `transformers_adapter`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.overrides import TorchFunctionMode

from flwr_sharded.errors import ConfigError
from flwr_sharded.parallel.shard_transport import row_offset
from flwr_sharded.parallel.sharding import apply_activation_checkpointing, apply_fsdp
from flwr_sharded.parallel.alignment import local_shard
from flwr_sharded.training.hf_reader import load_local_shards, resolve_pretrained
from flwr_sharded.training.models import build_meta_model, is_preset, model_config, owned_parameters, transformer_blocks
from flwr_sharded.training.partition import seeded_generator
from flwr_sharded.training.transformers_adapter import (INIT_FUNCTIONS, init_module_buffers, replaced_init_functions,
                                                        run_initialize_weights)

INIT_BLOCK_ROWS = 64
"""Rows of a parameter's full shape drawn from one generator: a fixed grid, whatever the sharding."""

RANDOM_OPS = ("normal", "uniform", "trunc_normal")
"""The recorded ops that draw: each from its own block generators (the constants and copies draw nothing)."""


@dataclass(frozen=True)
class InitOp:
    """One op of a model's `_init_weights` on one parameter: `kind` with `args`, on rows [rows[0], rows[1]) of the
    parameter's row view (`row_view`), or all of it (None). `value`: a copy's source, as those rows."""

    kind: str
    """'normal' (mean, std), 'uniform' (a, b), 'trunc_normal' (mean, std, a, b), 'constant' (value,) or 'copy' ()."""
    args: tuple[float, ...] = ()
    rows: tuple[int, int] | None = None
    value: torch.Tensor | None = None


InitPlan = dict[str, tuple[InitOp, ...]]
"""Each parameter's recorded ops in order, by canonical name (`models.owned_parameters`)."""


def build_sharded_model(name: str, *, vocab_size: int, max_seq_len: int, mesh: DeviceMesh, seed: int,
                        mp_policy: MixedPrecisionPolicy, device: torch.device | str = "cpu", pretrained: bool = False,
                        reshard_after_forward: bool = True, activation_checkpointing: bool = False) -> nn.Module:
    """Build, shard and initialise by `seed` (or load, if `pretrained` and not a preset) the causal LM `name` (as
    `--model`) on the FSDP `mesh`, ("shard",) or ("rep", "shard"); collective-free. `vocab_size`: the tokenizer's,
    for presets that fix none."""
    directory = resolve_pretrained(name) if pretrained and not is_preset(name) else None
    model = build_meta_model(model_config(str(directory or name), vocab_size=vocab_size, max_seq_len=max_seq_len))
    plan = record_init(model, name) if directory is None else {}  # recorded before sharding
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    apply_fsdp(model, transformer_blocks(model), mesh, mp_policy=mp_policy,
               reshard_after_forward=reshard_after_forward)
    materialize(model, device)
    if directory is not None:
        load_local_shards(model, directory)
    else:
        init_local_shards(model, seed, plan)
    return model


def check_seeded_init(name: str, *, vocab_size: int, max_seq_len: int) -> None:
    """Before any process group: the model `name` builds on the meta device and its own init can be applied row by
    row (a ConfigError naming the parameter and op otherwise)."""
    record_init(build_meta_model(model_config(name, vocab_size=vocab_size, max_seq_len=max_seq_len)), name)


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device | str) -> None:
    """Allocate this rank's local shards (and buffers) on `device` and recompute every buffer; the parameters are left
    for `init_local_shards` or a checkpoint to fill."""
    model.to_empty(device=device)
    reset_buffers(model)


@torch.no_grad()
def reset_buffers(model: nn.Module) -> None:
    """Recompute the buffers of a materialised model with its `_init_weights` (parameters untouched)."""
    for module in model.modules():
        buffers = [b for b in module._buffers.values() if b is not None]
        if not buffers:
            continue
        for buffer in buffers:
            if buffer.is_floating_point():
                buffer.fill_(float("nan"))  # whatever `_init_weights` does not set is caught below
        init_module_buffers(model, module)
        unset = [n for n, b in module._buffers.items() if b is not None and b.is_floating_point() and b.isnan().any()]
        if unset:
            raise NotImplementedError(f"cannot recompute buffers {unset} of {type(module).__name__} after "
                                      f"meta-device initialisation (its _init_weights does not set them)")


def row_view(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter (or its local shard) as rows: a 1-D one as it is, else every dimension but the last flattened
    (dim-0 shards stay whole row ranges)."""
    return tensor if tensor.dim() <= 1 else tensor.reshape(-1, tensor.shape[-1])


def rows_per_dim0(shape: torch.Size) -> int:
    """Rows of `row_view` per index of dim 0."""
    return math.prod(shape[1:-1]) if len(shape) > 1 else 1


# --- recording a model's own init ----------------------------------------------------------------------------------

_RECORDED = {  # transformers.initialization function -> (kind, its args as recorded from the call's arguments)
    "normal_": ("normal", lambda mean=0.0, std=1.0, generator=None: (mean, std)),
    "uniform_": ("uniform", lambda a=0.0, b=1.0, generator=None: (a, b)),
    "trunc_normal_": ("trunc_normal", lambda mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None: (mean, std, a, b)),
    "constant_": ("constant", lambda val: (val,)),
    "ones_": ("constant", lambda: (1.0,)),
    "zeros_": ("constant", lambda: (0.0,)),
    "copy_": ("copy", lambda other: (other,)),
}
_UNSUPPORTED = tuple(name for name in INIT_FUNCTIONS if name not in _RECORDED)
"""Whole-tensor inits (they depend on the full shape, or draw the tensor as one: `eye_`, `xavier_uniform_`, ...),
and any other function of `transformers.initialization`: refused by name."""


class _Recorder:
    """The ops of a model's `_init_weights` on its parameters, recorded on the meta device (module docstring)."""

    def __init__(self, model: nn.Module, label: str) -> None:
        self.label = label
        self.names: dict[int, str] = {}
        self.params: dict[str, nn.Parameter] = {}
        self.aliases: set[tuple[int, str]] = set()  # (module, attribute) of a tied parameter's other occurrences
        for module_name, module in model.named_modules():
            for attr, param in module._parameters.items():
                if param is None:
                    continue
                full = f"{module_name}.{attr}" if module_name else attr
                self.names.setdefault(id(param), full)
                self.params.setdefault(full, param)
                if self.names[id(param)] != full:
                    self.aliases.add((id(module), attr))
        self.ops: dict[str, list[InitOp]] = {name: [] for name in self.names.values()}
        self.module: nn.Module | None = None
        self.depth = 0  # inside a recorded function: the torch calls it makes are its own

    def target(self, tensor: torch.Tensor) -> tuple[str, tuple[int, int] | None] | None:
        """(parameter name, rows) a tensor stands for (a parameter, or whole rows of one); None for a buffer or a
        tied parameter's other occurrence (its init is the first occurrence's, as after Hugging Face's tying)."""
        module = self.module
        if module is not None and any(p is tensor and (id(module), a) in self.aliases
                                      for a, p in module._parameters.items()):
            return None
        name = self.names.get(id(tensor))
        if name is not None:
            return name, None
        base = getattr(tensor, "_base", None)
        name = self.names.get(id(base)) if base is not None else None
        if name is None:
            return None
        row = math.prod(row_view(base).shape[1:])
        first, extra = divmod(tensor.storage_offset() - base.storage_offset(), row)
        if extra or tensor.numel() % row or not tensor.is_contiguous():
            raise ConfigError(f"--model {self.label}: its init writes part of {name} that is not whole rows "
                              f"(shape {tuple(tensor.shape)} of {tuple(base.shape)}); seeded init cannot shard it")
        return name, (first, first + tensor.numel() // row)

    def record(self, func_name: str, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        found = self.target(tensor)
        if found is None:
            return tensor
        name, rows = found
        if func_name in _UNSUPPORTED:
            raise ConfigError(f"--model {self.label}: its init of {name} is {func_name}, which cannot be applied "
                              f"row by row; seeded init cannot shard it (use --pretrained with a checkpoint)")
        kind, parse = _RECORDED[func_name]
        values, value = parse(*args, **kwargs), None
        if kind == "copy":
            if isinstance(values[0], torch.Tensor) and values[0].is_meta:
                raise ConfigError(f"--model {self.label}: its init copies a meta tensor into {name}; seeded init "
                                  f"cannot know its values")
            shape = row_view(self.params[name]).shape
            count = rows[1] - rows[0] if rows else shape[0]
            source = torch.as_tensor(values[0]).detach().to("cpu", torch.float32).expand(tensor.shape)
            value, values = source.reshape(count, *shape[1:]).clone(), ()
        self.ops[name].append(InitOp(kind, tuple(float(v) for v in values), rows, value))
        return tensor

    @contextmanager
    def patched(self) -> Iterator[None]:
        """`transformers.initialization`'s functions replaced by this recorder (torch.nn.init's too, through
        `guard_torch_init_functions`, which installs them)."""
        def recorder(func_name: str) -> Callable[..., torch.Tensor]:
            def recorded(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
                self.depth += 1
                try:
                    return self.record(func_name, tensor, *args, **kwargs)
                finally:
                    self.depth -= 1
            return recorded

        with replaced_init_functions({name: recorder(name) for name in (*_RECORDED, *_UNSUPPORTED)}):
            yield


_NOT_WRITES = ("requires_grad_", "share_memory_", "retain_grad")


class _InPlaceWatch(TorchFunctionMode):
    """Refuses an in-place write to a parameter that bypasses the recorded functions (`module.weight.normal_()`)."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if (self.recorder.depth == 0 and name.endswith("_") and not name.startswith("_") and args
                and isinstance(args[0], torch.Tensor)):
            found = self.recorder.target(args[0])
            if found is not None and name not in _NOT_WRITES:
                raise ConfigError(f"--model {self.recorder.label}: its init writes {found[0]} with Tensor.{name}, "
                                  f"not through transformers.initialization; seeded init cannot record it")
        return func(*args, **kwargs)


@torch.no_grad()
def record_init(model: nn.Module, label: str = "") -> InitPlan:
    """What the model's own `initialize_weights` does to each parameter of `model` (on the meta device, before
    sharding), as row-wise ops; a ConfigError naming the parameter and op for what cannot be sharded, or for a
    parameter it leaves unset."""
    recorder = _Recorder(model, label or type(model).__name__)

    def around(module: nn.Module, init_weights: Callable[[], None]) -> None:
        recorder.module = module
        init_weights()
        recorder.module = None

    with recorder.patched(), _InPlaceWatch(recorder):
        run_initialize_weights(model, around)
    unset = [name for name, ops in recorder.ops.items() if not any(op.rows is None for op in ops)]
    if unset:
        raise ConfigError(f"--model {recorder.label}: its _init_weights leaves {len(unset)} parameter(s) unset, e.g. "
                          f"{unset[:3]}; seeded init cannot start them as the model would")
    # what the last whole-parameter op overwrites is dropped: a parameter's first draw is seeded by its name alone
    return {name: tuple(ops[max(i for i, op in enumerate(ops) if op.rows is None):])
            for name, ops in recorder.ops.items()}


# --- applying the recorded ops to a rank's rows ---------------------------------------------------------------------

@torch.no_grad()
def init_local_shards(model: nn.Module, seed: int, plan: InitPlan) -> None:
    """Initialise this rank's rows of every parameter by `plan` (`record_init` of the same model before sharding);
    the full values depend on `seed` alone (module docstring)."""
    for name, param, _ in owned_parameters(model):
        if name not in plan:
            raise KeyError(f"no recorded init for {name}: the plan is of another model")
        init_rows(local_shard(param), plan[name], name=name, shape=param.shape, offset=row_offset(param), seed=seed)


def init_rows(local: torch.Tensor, ops: tuple[InitOp, ...], *, name: str, shape: torch.Size, offset: int,
              seed: int) -> None:
    """Apply `ops` to `local`, the indices [offset, offset + len) of dim 0 of parameter `name` of full `shape`."""
    if local.numel() == 0:
        return
    if not local.is_contiguous():
        raise AssertionError(f"{name}: its local shard is not contiguous")
    per_index = rows_per_dim0(shape)
    rows, start, full_rows = row_view(local), offset * per_index, shape[0] * per_index
    draws = 0
    for op in ops:
        lo, hi = op.rows or (0, full_rows)
        lo, hi = max(lo, start), min(hi, start + rows.shape[0])
        if lo < hi and op.kind == "constant":
            rows[lo - start:hi - start].fill_(op.args[0])
        elif lo < hi and op.kind == "copy":
            first = op.rows[0] if op.rows else 0
            rows[lo - start:hi - start].copy_(op.value[lo - first:hi - first])
        elif lo < hi:
            fill_random_rows(rows[lo - start:hi - start], op, start=lo, full_rows=full_rows, seed=seed,
                             name=name if draws == 0 else f"{name}#{draws}")
        draws += op.kind in RANDOM_OPS


def fill_random_rows(local: torch.Tensor, op: InitOp, *, start: int, full_rows: int, seed: int, name: str) -> None:
    """Fill `local` (rows `[start, start + len)` of a `full_rows`-row parameter) with its blocks of `op`'s draw."""
    rows = local.shape[0]
    for block in range(start // INIT_BLOCK_ROWS, (start + rows - 1) // INIT_BLOCK_ROWS + 1):
        b0, b1 = block * INIT_BLOCK_ROWS, min((block + 1) * INIT_BLOCK_ROWS, full_rows)
        values = torch.empty((b1 - b0, *local.shape[1:]), dtype=torch.float32)
        generator = seeded_generator("init", seed, name, block)
        if op.kind == "normal":
            values.normal_(op.args[0], op.args[1], generator=generator)
        elif op.kind == "uniform":
            values.uniform_(op.args[0], op.args[1], generator=generator)
        else:
            nn.init.trunc_normal_(values, *op.args, generator=generator)
        lo, hi = max(b0, start), min(b1, start + rows)
        local[lo - start:hi - start].copy_(values[lo - b0:hi - b0])


def fill_normal_rows(local: torch.Tensor, *, start: int, full_rows: int, std: float, seed: int, name: str) -> None:
    """Fill `local` (rows `[start, start + len)` of a `full_rows`-row parameter) with its blocks of N(0, std)."""
    fill_random_rows(local, InitOp("normal", (0.0, std)), start=start, full_rows=full_rows, seed=seed, name=name)
