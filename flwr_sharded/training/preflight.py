"""Every check of a training run that can happen before a process group, a model or a file is touched."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from flwr_sharded.config import TrainConfig
from flwr_sharded.errors import ConfigError
from flwr_sharded.parallel.wire import WIRES, check_wire_dtype
from flwr_sharded.run_dir import check_run_dir
from flwr_sharded.validation import check_fragments, validate


def preflight(cfg: TrainConfig, world_size: int) -> None:
    """Every check that can run before a process group, a model or a file is touched."""
    validate(cfg, world_size)
    out = cfg.output
    if out.run_dir:
        out.run_dir = str(check_run_dir(out.run_dir, resume=cfg.checkpoint.resume))
    for wanted, package, flag in ((out.tensorboard, "tensorboard", "--tensorboard"),
                                  (out.wandb_project, "wandb", "--wandb-project")):
        if wanted and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{flag} needs the {package} package: pip install 'flwr_sharded[{package}]'")
    check_devices(cfg)
    check_model_and_data(cfg)
    if cfg.checkpoint.resume:
        from flwr_sharded.training.checkpoint_resume import check_resumable
        from flwr_sharded.training.checkpoint_files import read_meta

        checkpoint = check_resumable(cfg, cfg.checkpoint.dir)
        previous = read_meta(checkpoint)["config"].get("output", {}).get("run_dir")
        if not out.run_dir and previous and Path(previous).is_dir():
            out.run_dir = previous  # the resumed run goes on in its directory


def check_model_and_data(cfg: TrainConfig) -> None:
    """The model and the data a run names, checked against this machine's files and caches without allocating the
    model: its name (a hub id must be cached when offline), a pretrained checkpoint's headers or the model's own init
    (recorded on the meta device), the sync against its layers, the data directory, dataset and tokenizer, and the
    tokenizer against the model's vocabulary."""
    from flwr_sharded.training.data import check_data
    from flwr_sharded.training.models import check_hub_cache, check_model_name, is_preset
    from flwr_sharded.training.sources import check_vocab

    check_model_name(cfg.model.name)
    check_hub_cache(cfg.model.name)
    check_sync(cfg)
    if cfg.model.pretrained and not is_preset(cfg.model.name):
        from flwr_sharded.training.hf_reader import check_pretrained

        check_pretrained(cfg.model.name)  # config.json and safetensors headers only
    else:
        from flwr_sharded.training.model_init import check_seeded_init

        check_seeded_init(cfg.model.name, vocab_size=256, max_seq_len=cfg.data.seq_len)  # on meta: shapes only
    check_data(cfg.data, cfg.model.name)
    check_vocab(cfg)


def check_devices(cfg: TrainConfig) -> None:
    """On a GPU machine, NCCL needs one GPU per local rank (`LOCAL_WORLD_SIZE`, set by torchrun)."""
    import torch

    if not torch.cuda.is_available():
        return
    local, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count()
    if cfg.parallel.backend in ("auto", "nccl") and local > gpus:
        raise ConfigError(f"{local} ranks on this node but {gpus} GPU(s): NCCL needs one GPU per rank; launch at most "
                          f"{gpus} ranks per node, or use --backend gloo to let ranks share GPUs")


def check_sync(cfg: TrainConfig) -> None:
    """The shard sync against the model and the device: fragments are groups of whole transformer blocks, and a wire
    with a `requirement` (fp8) needs a device that runs it."""
    p = cfg.parallel
    if p.federated and p.sync_fragments > 1:
        from flwr_sharded.training.models import model_config

        config = model_config(cfg.model.name, vocab_size=256, max_seq_len=cfg.data.seq_len)  # layers only
        check_fragments(p, int(config.num_hidden_layers), cfg.model.name)
    if p.federated and WIRES[p.sync_dtype].requirement:
        import torch

        # the shards (and so the quantization) live on the GPU whenever there is one, whatever the backend
        check_wire_dtype(p.sync_dtype, "cuda" if torch.cuda.is_available() else "cpu")
