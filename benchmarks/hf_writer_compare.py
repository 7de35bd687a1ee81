"""Saving a sharded model as one Hugging Face safetensors checkpoint: the hand-written writer against torch DCP's.

    PYTHONPATH=. .venv/bin/python benchmarks/hf_writer_compare.py --out /tmp/hf_writer_compare

An untied Llama (2 blocks, `--vocab` x `--hidden` embedding and head: 0.57 GiB in fp32 at the defaults), FSDP2 over
`--world` CPU gloo ranks (fsdp, S = world), is saved twice: by `hf_writer.save_sharded_pretrained` (every rank
writes its own rows in place) and by `dcp.save` with `HuggingFaceStorageWriter(save_distributed=True,
enable_consolidation=True)` (every rank writes its shards to `sharded/`, then the coordinator merges them into the
consolidated files). Per rank: the peak RSS over the save above the RSS before it (`VmHWM`, reset), and the seconds;
then the bytes on disk, the files, whether both checkpoints hold the same tensors and the 1-minute load average at
the start and end. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from flwr_sharded_perf.provenance import provenance  # noqa: E402


def _save(rank: int, world: int, how: str, out: str, vocab: int, hidden: int) -> dict:
    import gc

    import torch.distributed as dist
    from transformers import LlamaConfig

    from flwr_sharded.config import ParallelConfig
    from flwr_sharded.parallel.sharding import apply_fsdp, mixed_precision_policy
    from flwr_sharded.parallel.topology import init_topology
    from flwr_sharded import host_memory
    from flwr_sharded.host_memory import PeakRSS, current_rss
    from flwr_sharded.training.model_init import init_local_shards, materialize, record_init
    from flwr_sharded.training.models import build_meta_model, transformer_blocks

    topo = init_topology(ParallelConfig(method="fsdp", shards=world))
    model = build_meta_model(LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=2,
                                         num_attention_heads=8, num_key_value_heads=4, intermediate_size=2 * hidden,
                                         tie_word_embeddings=False))
    plan = record_init(model)
    apply_fsdp(model, transformer_blocks(model), topo.fsdp_mesh, mp_policy=mixed_precision_policy("fp32", "cpu"))
    materialize(model, "cpu")
    init_local_shards(model, 0, plan)
    gc.collect()
    host_memory.trim()
    dist.barrier()
    memory = PeakRSS(current_rss())
    start = time.perf_counter()
    if how == "hand":
        from flwr_sharded.training.hf_writer import save_sharded_pretrained

        save_sharded_pretrained(model, Path(out) / how, group=topo.group_pg)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        dcp.save(model.state_dict(), storage_writer=HuggingFaceStorageWriter(
            str(Path(out) / how), save_distributed=True, enable_consolidation=True))
    dist.barrier()
    return {"rank": rank, "writer": how, "extra_mib": memory.extra_bytes() / 2**20,
            "seconds": time.perf_counter() - start,
            "local_shards_mib": sum(p.to_local().numel() * p.element_size() for p in model.parameters()) / 2**20}


def _tensors(directory: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="scratch directory (replaced)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()
    import torch

    from tests.multiproc import run_ranks

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    load_start = os.getloadavg()[0]
    rows = [row for how in ("hand", "dcp")
            for row in run_ranks(_save, args.world, how, str(out), args.vocab, args.hidden, timeout=600)]
    hand, dcp = _tensors(out / "hand"), _tensors(out / "dcp")
    print(json.dumps({
        "provenance": provenance(), "rows": rows, "load_avg": [load_start, os.getloadavg()[0]],
        "model_mib": sum(t.numel() * t.element_size() for t in hand.values()) / 2**20,
        "largest_tensor_mib": max(t.numel() * t.element_size() for t in hand.values()) / 2**20,
        "same_tensors": sorted(hand) == sorted(dcp) and all(torch.equal(hand[k], dcp[k]) for k in hand),
        "disk_mib": {how: sum(f.stat().st_size for f in (out / how).rglob("*") if f.is_file()) / 2**20
                     for how in ("hand", "dcp")},
        "files": {how: sorted(str(f.relative_to(out / how)) for f in (out / how).rglob("*") if f.is_file())
                  for how in ("hand", "dcp")},
    }, indent=1))


if __name__ == "__main__":
    main()
