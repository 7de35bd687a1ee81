"""Sharded pretrained loading and sharded saving of Hugging Face safetensors checkpoints (local directories)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from flwr_sharded.errors import ConfigError
from tests.multiproc import run_ranks

SHAPE = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=48)


def _write_checkpoint(directory: Path, *, tied: bool, dtype: torch.dtype = torch.float32, seed: int = 0,
                      max_shard_size: str = "50GB", **overrides) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**SHAPE, **overrides}, tie_word_embeddings=tied))
    with torch.no_grad():  # norms away from 1, so a load that skipped them would show
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.to(dtype).save_pretrained(directory, max_shard_size=max_shard_size)
    return directory


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _load_and_save(rank: int, world: int, layout: dict, cases: list[dict]):
    """Per case: load sharded, compare with from_pretrained, save sharded into case['out'] (the test compares it)."""
    from transformers import AutoModelForCausalLM

    from flwr_sharded.config import ParallelConfig
    from flwr_sharded.parallel.sharding import mixed_precision_policy
    from flwr_sharded.parallel.topology import init_topology
    from flwr_sharded.training.model_init import build_sharded_model
    from flwr_sharded.training.hf_writer import save_sharded_pretrained

    topo = init_topology(ParallelConfig(**layout))
    diffs = []
    for case in cases:
        model = build_sharded_model(case["src"], vocab_size=8, max_seq_len=16, mesh=topo.fsdp_mesh, seed=0,
                                    mp_policy=mixed_precision_policy("fp32", "cpu"), pretrained=True)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        reference = AutoModelForCausalLM.from_pretrained(case["src"], dtype=torch.float32).state_dict()
        assert full.keys() == reference.keys()
        diffs.append(max(float((full[k] - reference[k]).abs().max()) for k in reference))
        if case.get("tied"):
            assert model.lm_head.weight is model.model.embed_tokens.weight
        save_sharded_pretrained(model, case["out"], group=topo.group_pg, dtype=case.get("save_dtype"),
                                max_file_bytes=case.get("max_file_bytes", 10 ** 12))
    return diffs


def _cases(tmp_path: Path, prefix: str, specs: list[dict]) -> list[dict]:
    cases = []
    for i, spec in enumerate(specs):
        src = _write_checkpoint(tmp_path / f"{prefix}-src{i}", **spec["write"])
        cases.append({"src": str(src), "out": str(tmp_path / f"{prefix}-out{i}"), **spec.get("case", {})})
    return cases


def _check_saved(cases: list[dict]) -> None:
    from transformers import AutoModelForCausalLM

    for case in cases:
        src, out = _tensors(Path(case["src"])), _tensors(Path(case["out"]))
        assert src.keys() == out.keys(), case
        for key, value in src.items():
            assert out[key].dtype == value.dtype and torch.equal(out[key], value), (case, key)
        a = AutoModelForCausalLM.from_pretrained(case["src"], dtype=torch.float32).state_dict()
        b = AutoModelForCausalLM.from_pretrained(case["out"], dtype=torch.float32).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert json.loads((Path(case["out"]) / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_sharded_load_equals_from_pretrained_and_save_is_bit_exact_uneven_shards(tmp_path):
    """S = 3 (uneven rows): tied and untied, fp32 and bf16 files, a multi-file checkpoint with its index."""
    cases = _cases(tmp_path, "s3", [
        {"write": {"tied": True}},
        {"write": {"tied": False}},
        {"write": {"tied": True, "dtype": torch.bfloat16}, "case": {"save_dtype": torch.bfloat16}},
        {"write": {"tied": False, "max_shard_size": "40KB"}, "case": {"max_file_bytes": 40_000}},
    ])
    assert (Path(cases[3]["src"]) / "model.safetensors.index.json").is_file()
    for case, spec_tied in zip(cases, (True, False, True, False)):
        case["tied"] = spec_tied
    diffs = run_ranks(_load_and_save, 3, {"method": "fsdp", "shards": 3}, cases, timeout=240)
    assert all(d == 0.0 for rank in diffs for d in rank), diffs
    assert "lm_head.weight" not in _tensors(Path(cases[0]["out"]))  # tied: saved once, as HF does
    index = json.loads((Path(cases[3]["out"]) / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (Path(cases[3]["out"]) / "model.safetensors").exists()
    _check_saved(cases)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_hsdp_load_and_save_writes_each_row_once(tmp_path):
    cases = _cases(tmp_path, "hsdp", [{"write": {"tied": False, "dtype": torch.bfloat16}},
                                       {"write": {"tied": True}}])
    diffs = run_ranks(_load_and_save, 4, {"method": "hsdp", "replicas": 2, "shards": 2}, cases, timeout=240)
    assert all(d == 0.0 for rank in diffs for d in rank), diffs
    saved = _tensors(Path(cases[0]["out"]))
    assert all(v.dtype == torch.float32 for v in saved.values())  # default: the parameters' dtype
    src = _tensors(Path(cases[0]["src"]))
    assert all(torch.equal(saved[k], v.float()) for k, v in src.items())
    _check_saved(cases[1:])


def test_a_mismatched_checkpoint_is_a_config_error_before_any_process_group(tmp_path, monkeypatch, capsys, data_dir):
    import torch.distributed as dist

    from flwr_sharded.train import main
    from flwr_sharded.training.hf_reader import check_pretrained

    good = _write_checkpoint(tmp_path / "good", tied=True)
    assert check_pretrained(str(good)) == good
    # the weights of a wider model under a config.json that says hidden_size 32
    bad = _write_checkpoint(tmp_path / "bad", tied=True, hidden_size=48, intermediate_size=64)
    config = json.loads((good / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = ["--method", "fsdp", "--shards", "2", "--data-dir", str(data_dir), "--seq-len", "32", "--pretrained"]
    assert main([*args, "--model", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "model.embed_tokens.weight: checkpoint [96, 48] != model [96, 32]" in err, err
    assert not dist.is_initialized()

    untied = _write_checkpoint(tmp_path / "untied", tied=False)
    (untied / "config.json").write_text(json.dumps(config))  # tied config, a checkpoint with lm_head.weight
    assert check_pretrained(str(untied)) == untied  # as from_pretrained: the tied head's own copy is ignored
    from safetensors.torch import save_file

    original = _tensors(untied)
    save_file({**original, "lm_head.weight": torch.zeros(97, 32)}, str(untied / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"--model: .*lm_head.weight: checkpoint \[97, 32\] != model \[96, 32\]"):
        check_pretrained(str(untied))
    save_file({**original, "extra.weight": torch.zeros(2)}, str(untied / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"--model: .*does not have, e.g. \['extra.weight'\]"):
        check_pretrained(str(untied))
    save_file({**original, "model.embed_tokens.weight": torch.zeros(96, 32, dtype=torch.int8)},
              str(untied / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"--model: .*holds \['I8'\] tensors"):
        check_pretrained(str(untied))
    tied_weights = _write_checkpoint(tmp_path / "tied-weights", tied=True)
    (tied_weights / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    with pytest.raises(ConfigError, match=r"--model: .*1 tensor\(s\) missing.*lm_head.weight"):
        check_pretrained(str(tied_weights))
    deeper = _write_checkpoint(tmp_path / "deeper", tied=True, num_hidden_layers=3)
    (deeper / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"--model: .*model.layers.2"):
        check_pretrained(str(deeper))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"--model: .*no model.safetensors"):
        check_pretrained(str(tmp_path / "empty"))
    os.remove(good / "model.safetensors")
    with pytest.raises(ConfigError, match="--model"):
        check_pretrained(str(good))


def test_a_hub_id_is_downloaded_with_snapshot_download(tmp_path, monkeypatch):
    import huggingface_hub

    from flwr_sharded.training.hf_reader import check_pretrained

    local = _write_checkpoint(tmp_path / "snapshot", tied=True)
    calls = []

    def fake(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(local)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert check_pretrained("org/model") == local
    assert calls == [("org/model", {"allow_patterns": ["*.json", "*.safetensors"]})]

    def offline(repo_id, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ConfigError, match="--model: cannot download 'org/model'"):
        check_pretrained("org/model")


def test_export_streams_one_tensor_at_a_time_into_split_bf16_files(tmp_path, monkeypatch, data_dir):
    """A DCP checkpoint (written here without a process group) exported with dtype bf16 and a small file limit."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from flwr_sharded.config import TrainConfig, config_to_dict
    from flwr_sharded.training import checkpoint_export
    from flwr_sharded.training.models import build_model

    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=96, max_seq_len=32)
    cfg = TrainConfig()
    cfg.model.name, cfg.data.data_dir, cfg.data.seq_len = "tiny", str(data_dir), 32
    step = tmp_path / "ckpt" / "step-00000001"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(step), no_dist=True)
    (step / "meta.json").write_text(json.dumps({"step": 1, "config": config_to_dict(cfg), "vocab_size": 96}))
    loads = []
    real_load = dcp.load

    def counting_load(state, **kwargs):
        loads.append(list(state["model"]))
        return real_load(state, **kwargs)

    monkeypatch.setattr(dcp, "load", counting_load)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = checkpoint_export.export_pretrained(step, tmp_path / "out", dtype=torch.bfloat16, max_file_bytes=20_000)
    assert all(len(keys) == 1 for keys in loads) and len(loads) == len(list(model.parameters()))
    assert len(set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())) > 2
    saved = _tensors(out)
    assert "lm_head.weight" not in saved and all(v.dtype == torch.bfloat16 for v in saved.values())
    expected = model.state_dict()
    assert all(torch.equal(saved[k], expected[k].bfloat16()) for k in saved)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).state_dict()
    assert all(torch.equal(loaded[k], expected[k].bfloat16()) for k in expected)
    assert (out / "tokenizer.json").is_file() and json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_rows_are_read_and_written_in_pieces_at_their_offsets(tmp_path, monkeypatch):
    """The chunked paths of `read_file_rows` and `write_rows` (one row per piece), bf16 conversion, a scalar."""
    from safetensors.torch import load_file, save_file

    from flwr_sharded.training import hf_reader, hf_writer

    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(10, 3, generator=gen), "b": torch.randn(7, generator=gen), "c": torch.tensor(2.5)}
    save_file(tensors, str(tmp_path / "src.safetensors"))
    monkeypatch.setattr(hf_reader, "CHUNK_BYTES", 1)
    monkeypatch.setattr(hf_writer, "CHUNK_BYTES", 1)
    rows = torch.empty(4, 3, dtype=torch.bfloat16)
    hf_reader.read_file_rows(tmp_path / "src.safetensors", "a", rows, 5)
    assert torch.equal(rows, tensors["a"][5:9].bfloat16())
    scalar = torch.empty(())
    hf_reader.read_file_rows(tmp_path / "src.safetensors", "c", scalar, 0)
    assert float(scalar) == 2.5

    layout = hf_writer.plan_layout([(k, tuple(v.shape)) for k, v in tensors.items()], torch.float32)
    hf_writer.create_files(tmp_path / "out", layout)
    hf_writer.write_rows(tmp_path / "out", layout, "a", 6, tensors["a"][6:])  # any order, any split
    hf_writer.write_rows(tmp_path / "out", layout, "a", 0, tensors["a"][:6])
    hf_writer.write_rows(tmp_path / "out", layout, "b", 0, tensors["b"])
    hf_writer.write_rows(tmp_path / "out", layout, "c", 0, tensors["c"])
    with pytest.raises(ValueError, match="do not fit"):
        hf_writer.write_rows(tmp_path / "out", layout, "a", 8, tensors["a"][:3])
    hf_writer.commit(tmp_path / "out", layout)
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert saved.keys() == tensors.keys() and all(torch.equal(saved[k], v) for k, v in tensors.items())
