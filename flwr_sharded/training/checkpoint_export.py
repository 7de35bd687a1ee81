"""A checkpoint's model exported as a Hugging Face model (`flwr-sharded export`), from one process."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from flwr_sharded.errors import ConfigError
from flwr_sharded.training import checkpoint_files
from flwr_sharded.training.checkpoint_files import read_meta
from flwr_sharded.training.checkpoint_series import LATEST, latest_checkpoint


def export_pretrained(checkpoint: str | Path, out: str | Path, *, dtype: torch.dtype | None = None,
                      max_file_bytes: int | None = None) -> Path:
    """Write a checkpoint's model as a Hugging Face model (safetensors, config, tokenizer) from one process, no
    process group: each tensor is read alone from the DCP files, converted to `dtype` (default: as stored), written
    at its offset in the pre-sized safetensors file(s) and freed. Peak memory: about the largest tensor (usually the
    embedding), whatever the model's size or the ranks that wrote the checkpoint."""
    from flwr_sharded.config import config_from_dict
    from flwr_sharded.training import hf_writer
    from flwr_sharded.training.data import load_tokenizer
    from flwr_sharded.training.hf_conversion import published_layout
    from flwr_sharded.training.models import build_meta_model, model_config, saved_tensors

    checkpoint = Path(checkpoint)
    if not (checkpoint / "meta.json").is_file():
        found = latest_checkpoint(checkpoint)
        if found is None:
            raise ConfigError(f"--checkpoint: {checkpoint} is neither a checkpoint nor a series with a '{LATEST}'")
        checkpoint = found
    meta = read_meta(checkpoint)
    cfg = config_from_dict(meta["config"])
    model = build_meta_model(model_config(cfg.model.name, vocab_size=meta["vocab_size"],
                                          max_seq_len=cfg.data.seq_len))  # names and shapes only
    stored = checkpoint_files.SafeReader(str(checkpoint)).read_metadata().state_dict_metadata
    tensors = [name for name, _ in saved_tensors(model)]
    missing = [name for name in tensors if f"model.{name}" not in stored]
    if missing:
        raise ConfigError(f"--checkpoint: {checkpoint} lacks the model's {missing[:3]}")
    dtype = dtype or stored[f"model.{tensors[0]}"].properties.dtype
    shapes, plan = published_layout(model)  # the names and expert layout save_pretrained writes
    layout = hf_writer.plan_layout(shapes, dtype, max_file_bytes=max_file_bytes or hf_writer.MAX_FILE_BYTES)
    hf_writer.create_files(out, layout)
    for name in tensors:
        info = stored[f"model.{name}"]
        tensor = torch.empty(tuple(info.size), dtype=info.properties.dtype)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # single-process by design
            dcp.load({"model": {name: tensor}}, storage_reader=checkpoint_files.SafeReader(str(checkpoint)),
                     no_dist=True)
        hf_writer.write_local(out, layout, plan[name], tensor, 0)
        del tensor
    hf_writer.commit(out, layout)
    hf_writer.write_config(out, model, dtype, load_tokenizer(cfg.data, cfg.model.name))
    return Path(out)
