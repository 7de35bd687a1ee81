"""Pretrained checkpoints of every family as published (transformers' own names and conversions): the layout
`save_pretrained` writes, a hand-written published layout, row ranges read like a rank's, clear refusals, and (dist)
the sharded load's first-batch loss and export against plain transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flwr_sharded.errors import ConfigError
from tests.multiproc import run_ranks
from tests.training.test_pretrained import _tensors

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = {
    "llama": {},
    "qwen3": {"head_dim": 8},
    "mistral": {},
    "gemma3_text": {"head_dim": 8, "sliding_window": 16},
    "phi3": {},
    "gpt_neox": {"num_key_value_heads": None},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "head_dim": 8},
}
"""Tiny configs (hidden 32, 2 layers) of the families tested, by transformers' model type."""
PUBLISHED_KEYS = {
    "gpt_neox": "embed_out.weight",
    "mixtral": "model.layers.0.block_sparse_moe.experts.3.w1.weight",
    "qwen3_moe": "model.layers.0.mlp.experts.3.gate_proj.weight",
}
"""A name of each converted family's published checkpoints (not a module name of transformers 5)."""


def _config(family: str, **overrides):
    from transformers import AutoConfig

    kwargs = {k: v for k, v in {**BASE, **FAMILIES[family], **overrides}.items() if v is not None}
    return AutoConfig.for_model(family, **kwargs)


def _model(family: str, seed: int = 0, **overrides):
    """A from_config model with every parameter redrawn (so a tensor the load skipped or misplaced shows)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(family, **overrides), dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.1)
    return model


def _saved(family: str, directory: Path) -> Path:
    _model(family).save_pretrained(directory)
    return directory


def _by_hand(family: str, model, directory: Path) -> Path:
    """The family's published layout written from the model's state, as its original checkpoints store it: GPT-NeoX's
    head as `embed_out`, Mixtral's experts as `block_sparse_moe.experts.{i}.w1/w2/w3`, Qwen3-MoE's as
    `mlp.experts.{i}.gate_proj/up_proj/down_proj`."""
    from safetensors.torch import save_file

    out: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        layer, _, leaf = name.partition(".mlp.experts.")
        if family == "gpt_neox" and name == "lm_head.weight":
            out["embed_out.weight"] = value
        elif leaf and family in ("mixtral", "qwen3_moe"):
            block = f"{layer}.block_sparse_moe" if family == "mixtral" else f"{layer}.mlp"
            gate, up, down = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
            for expert, rows in enumerate(value):
                if leaf == "gate_up_proj":
                    half = rows.shape[0] // 2
                    out[f"{block}.experts.{expert}.{gate}.weight"] = rows[:half]
                    out[f"{block}.experts.{expert}.{up}.weight"] = rows[half:]
                else:
                    out[f"{block}.experts.{expert}.{down}.weight"] = rows
        elif family == "mixtral" and ".mlp.gate." in name:
            out[name.replace(".mlp.", ".block_sparse_moe.")] = value
        else:
            out[name] = value
    directory.mkdir(parents=True)
    model.config.save_pretrained(directory)
    save_file({k: v.contiguous() for k, v in out.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    return directory


def _read_in_row_ranges(directory: Path, rows_per_rank: int) -> dict[str, torch.Tensor]:
    """Every model tensor read as ranks owning `rows_per_rank` rows each would read it, through the plan."""
    from flwr_sharded.training import hf_conversion, hf_reader
    from flwr_sharded.training.models import build_meta_model, saved_tensors

    from transformers import AutoConfig

    model = build_meta_model(AutoConfig.from_pretrained(directory))
    stored = hf_reader.stored_tensors(directory)
    plan, unexpected = hf_conversion.conversion_plan(model, {k: t.shape for k, t in stored.items()})
    assert not unexpected
    out = {}
    for name, meta in saved_tensors(model):
        full = torch.full(meta.shape, float("nan"))
        for start in range(0, max(1, full.shape[0] if full.dim() else 1), rows_per_rank):
            hf_reader._read_local(plan[name], stored, full[start:start + rows_per_rank] if full.dim() else full,
                                  start)
        out[name] = full
    return out


def _reference(directory: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).state_dict()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_save_pretrained_layout_is_read_row_by_row_and_is_the_export_layout(family, tmp_path):
    from flwr_sharded.training import hf_conversion, hf_reader
    from flwr_sharded.training.models import build_meta_model

    directory = _saved(family, tmp_path / family)
    written = _tensors(directory)
    if family in PUBLISHED_KEYS:
        assert PUBLISHED_KEYS[family] in written  # transformers 5 saves the published layout
    assert hf_reader.check_pretrained(str(directory)) == directory
    shapes, _ = hf_conversion.published_layout(build_meta_model(_config(family)))
    assert dict(shapes) == {k: tuple(v.shape) for k, v in written.items()}  # the export's names and shapes
    reference = _reference(directory)
    for rows in (1, 3):
        loaded = _read_in_row_ranges(directory, rows)
        assert all(torch.equal(loaded[k], reference[k]) for k in loaded), family


@pytest.mark.parametrize("family", list(PUBLISHED_KEYS))
def test_a_hand_written_published_checkpoint_is_what_transformers_reads_and_writes(family, tmp_path):
    from flwr_sharded.training import hf_reader

    model = _model(family, seed=1)
    directory = _by_hand(family, model, tmp_path / "published")
    reference = _reference(directory)  # transformers reads it: the fixture is the published format
    assert all(torch.equal(reference[k], v) for k, v in model.state_dict().items())
    model.save_pretrained(tmp_path / "saved")
    assert _tensors(directory).keys() == _tensors(tmp_path / "saved").keys()
    hf_reader.check_pretrained(str(directory))
    loaded = _read_in_row_ranges(directory, 1)
    assert all(torch.equal(loaded[k], reference[k]) for k in loaded)


def test_an_expert_is_read_in_pieces_of_at_most_chunk_bytes(tmp_path, monkeypatch):
    """However large one expert (one row of a fused 3-D tensor) is, a read holds at most `CHUNK_BYTES` of it."""
    import safetensors

    from flwr_sharded.training import hf_reader

    directory = _saved("mixtral", tmp_path / "mixtral")
    real_open, reads = safetensors.safe_open, []

    class Slice:
        def __init__(self, inner):
            self.inner = inner

        def __getitem__(self, index):
            value = self.inner[index]
            reads.append(value.numel() * value.element_size())
            return value

    class Handle:
        def __init__(self, *args, **kwargs):
            self.inner = real_open(*args, **kwargs)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def get_slice(self, name):
            return Slice(self.inner.get_slice(name))

    monkeypatch.setattr(safetensors, "safe_open", Handle)
    monkeypatch.setattr(hf_reader, "CHUNK_BYTES", 1024)  # an expert's w1 is 48 x 32 fp32: 6 KiB
    loaded = _read_in_row_ranges(directory, 1)
    assert reads and max(reads) <= 1024
    reference = _reference(directory)
    assert all(torch.equal(loaded[k], reference[k]) for k in loaded)


def test_experts_split_over_several_files_in_bf16_load(tmp_path):
    """A Qwen3-MoE saved by transformers in bf16 over several files (its index): each expert from its own file."""
    from flwr_sharded.training import hf_reader

    directory = tmp_path / "qwen3_moe"
    _model("qwen3_moe").to(torch.bfloat16).save_pretrained(directory, max_shard_size="8KB")
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    experts = {file for key, file in index.items() if ".experts." in key and "layers.0." in key}
    assert len(experts) > 1
    hf_reader.check_pretrained(str(directory))
    reference = _reference(directory)
    for rows in (1, 3):
        loaded = _read_in_row_ranges(directory, rows)
        assert all(torch.equal(loaded[k], reference[k]) for k in loaded)


def test_a_fused_checkpoint_loads_under_the_model_names(tmp_path):
    """A Mixtral stored with transformers 5's fused module names (no conversion) loads as from_pretrained does."""
    from safetensors.torch import save_file

    from flwr_sharded.training import hf_reader

    model = _model("mixtral", seed=2)
    (tmp_path / "fused").mkdir()
    model.config.save_pretrained(tmp_path / "fused")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "fused" / "model.safetensors"),
              metadata={"format": "pt"})
    hf_reader.check_pretrained(str(tmp_path / "fused"))
    loaded = _read_in_row_ranges(tmp_path / "fused", 1)
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


def test_a_converted_checkpoint_that_does_not_fit_is_refused_in_one_line_before_any_process_group(
        tmp_path, monkeypatch, capsys, data_dir):
    import torch.distributed as dist
    from safetensors.torch import save_file

    from flwr_sharded.train import main
    from flwr_sharded.training.hf_reader import check_pretrained

    directory = _saved("mixtral", tmp_path / "mixtral")
    good = _tensors(directory)

    def write(tensors):
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})

    write({k: v for k, v in good.items() if ".experts.3." not in k})  # an expert short
    monkeypatch.setenv("WORLD_SIZE", "2")
    capsys.readouterr()  # save_pretrained's progress bar
    args = ["--method", "fsdp", "--shards", "2", "--data-dir", str(data_dir), "--seq-len", "32", "--pretrained",
            "--tokenizer", str(data_dir / "tokenizer"), "--model", str(directory)]
    assert main(args) == 2
    err = capsys.readouterr().err
    line = "model.layers.0.mlp.experts.down_proj: checkpoint [3, 32, 48] (from 3 tensors) != model [4, 32, 48]"
    assert line in err and len(err.strip().splitlines()) == 1, err
    assert not dist.is_initialized()

    write({k.replace(".experts.3.", ".experts.4."): v for k, v in good.items()})  # four, but not 0 to 3
    with pytest.raises(ConfigError, match=r"model.layers.0.mlp.experts.gate_up_proj stacks the checkpoint's "
                                          r".experts.\*.w1.weight numbered \[0, 1, 2, 4\], not 0 to 3"):
        check_pretrained(str(directory))
    write({k: v for k, v in good.items() if "layers.1.block_sparse_moe.gate" not in k})
    with pytest.raises(ConfigError, match=r"1 tensor\(s\) missing, e.g. \['model.layers.1.mlp.gate.weight'\]"):
        check_pretrained(str(directory))
    write({**good, "model.layers.0.block_sparse_moe.experts.0.w4.weight": torch.zeros(2)})
    with pytest.raises(ConfigError, match=r"does not have, e.g. \['model.layers.0.block_sparse_moe.experts.0.w4"):
        check_pretrained(str(directory))
    write({**good, "model.layers.0.mlp.experts.gate_up_proj": torch.zeros(4, 96, 32)})  # fused and per expert
    with pytest.raises(ConfigError, match=r"holds model.layers.0.mlp.experts.gate_up_proj both whole and as"):
        check_pretrained(str(directory))


def test_a_transposed_tensor_is_read_and_written_column_by_column_and_other_conversions_are_named(tmp_path,
                                                                                                 monkeypatch):
    """A mapping that stores the head transposed (a model row is a checkpoint column): read in row ranges and written
    back by row ranges into the same file; a conversion that is neither row-wise nor a transpose is refused."""
    import transformers.conversion_mapping as mapping
    from safetensors.torch import load_file, save_file
    from transformers.core_model_loading import PermuteForRope, Transpose, WeightConverter

    from flwr_sharded.training import hf_conversion, hf_reader, hf_writer
    from flwr_sharded.training.models import build_meta_model

    directory = _saved("llama", tmp_path / "llama")
    tensors = _tensors(directory)
    head = tensors.pop("lm_head.weight")
    tensors["lm_head.kernel"] = head.T.contiguous()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    original = mapping.get_model_conversion_mapping
    op = Transpose()

    def with_head(model, *args, **kwargs):
        return [WeightConverter("lm_head.kernel", "lm_head.weight", operations=[op]), *original(model, *args, **kwargs)]

    monkeypatch.setattr(mapping, "get_model_conversion_mapping", with_head)
    monkeypatch.setattr(hf_reader, "CHUNK_BYTES", 64)  # several pieces of checkpoint rows
    monkeypatch.setattr(hf_writer, "CHUNK_BYTES", 64)
    hf_reader.check_pretrained(str(directory))
    for rows in (1, 5, 96):
        assert torch.equal(_read_in_row_ranges(directory, rows)["lm_head.weight"], head)

    model = build_meta_model(_config("llama"))
    shapes, plan = hf_conversion.published_layout(model)
    assert dict(shapes)["lm_head.kernel"] == (32, 96)  # save_pretrained's reverse conversion transposes it back
    layout = hf_writer.plan_layout(shapes, torch.float32)
    hf_writer.create_files(tmp_path / "out", layout)
    for name, _ in shapes:
        if name != "lm_head.kernel":
            hf_writer.write_rows(tmp_path / "out", layout, name, 0, tensors[name])
    for start in range(0, 96, 7):  # ranks of 7 rows, the last one short
        hf_writer.write_local(tmp_path / "out", layout, plan["lm_head.weight"], head[start:start + 7], start)
    hf_writer.commit(tmp_path / "out", layout)
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert written.keys() == tensors.keys() and all(torch.equal(written[k], v) for k, v in tensors.items())

    op = PermuteForRope()  # a conversion of every transformers 5 from the floor on
    with pytest.raises(ConfigError, match=r"lm_head.weight is converted from \['lm_head.kernel'\] by transformers' "
                                          r"PermuteForRope, which the sharded loader does not read"):
        hf_reader.check_pretrained(str(directory))


def test_a_family_quirk_registered_in_the_adapter_is_read_written_and_loaded_by_transformers_alike(tmp_path,
                                                                                                    monkeypatch):
    """A renaming transformers lacks (a Llama head stored as `lm_head.kernel`), added by the adapter's
    `register_family_conversion` alone: the plan reads it, the published layout writes it, `from_pretrained` loads
    it."""
    import copy

    import transformers.conversion_mapping as mapping
    from safetensors.torch import save_file
    from transformers.core_model_loading import WeightRenaming

    from flwr_sharded.training import hf_conversion, hf_reader
    from flwr_sharded.training.models import build_meta_model
    from flwr_sharded.training.transformers_adapter import register_family_conversion

    mapping.get_checkpoint_conversion_mapping("llama")  # builds transformers' table, restored after the test
    monkeypatch.setattr(mapping, "_checkpoint_conversion_mapping_cache",
                        copy.deepcopy(mapping._checkpoint_conversion_mapping_cache))
    if hasattr(mapping, "USER_REGISTERED_MAPPINGS"):  # not in transformers 5.6
        monkeypatch.setattr(mapping, "USER_REGISTERED_MAPPINGS", set(mapping.USER_REGISTERED_MAPPINGS))
    directory = _saved("llama", tmp_path / "llama")
    tensors = _tensors(directory)
    head = tensors.pop("lm_head.weight")
    tensors["lm_head.kernel"] = head
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"missing, e.g. \['lm_head.weight'\]"):
        hf_reader.check_pretrained(str(directory))
    register_family_conversion("llama", [WeightRenaming("lm_head.kernel", "lm_head.weight")])
    hf_reader.check_pretrained(str(directory))
    assert torch.equal(_read_in_row_ranges(directory, 5)["lm_head.weight"], head)
    assert torch.equal(_reference(directory)["lm_head.weight"], head)
    shapes, _ = hf_conversion.published_layout(build_meta_model(_config("llama")))
    assert "lm_head.kernel" in dict(shapes) and "lm_head.weight" not in dict(shapes)


# ------------------------------------------------------------------------------------------------ several ranks

def _load_loss_save(rank: int, world: int, src: str, out: str, batch: torch.Tensor) -> tuple[float, float]:
    """Load `src` sharded over `world` ranks; (first-batch loss, largest difference from from_pretrained); export."""
    from transformers import AutoModelForCausalLM

    from flwr_sharded.config import ParallelConfig
    from flwr_sharded.parallel.sharding import mixed_precision_policy
    from flwr_sharded.parallel.topology import init_topology
    from flwr_sharded.training.hf_writer import save_sharded_pretrained
    from flwr_sharded.training.model_init import build_sharded_model

    topo = init_topology(ParallelConfig(method="fsdp", shards=world))
    model = build_sharded_model(src, vocab_size=8, max_seq_len=16, mesh=topo.fsdp_mesh, seed=0,
                                mp_policy=mixed_precision_policy("fp32", "cpu"), pretrained=True)
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    reference = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).state_dict()
    assert full.keys() == reference.keys()
    diff = max(float((full[k] - reference[k]).abs().max()) for k in reference)
    with torch.no_grad():
        loss = float(model(input_ids=batch, labels=batch).loss)
    save_sharded_pretrained(model, out, group=topo.group_pg)
    return loss, diff


@pytest.mark.dist
@pytest.mark.timeout(200)
@pytest.mark.parametrize("family,ranks", [(f, 4) for f in ("llama", "mixtral")] + [  # a dense and an MoE family
    pytest.param(f, r, marks=pytest.mark.slow) for f in FAMILIES for r in (2, 4)  # the rest: `make test-slow`
    if (f, r) not in {("llama", 4), ("mixtral", 4)}])
def test_sharded_pretrained_loss_equals_transformers_and_export_round_trips(family, ranks, tmp_path):
    """The converted families' checkpoints are written by hand in their published layout, the others by
    save_pretrained; the export must equal what save_pretrained writes."""
    from transformers import AutoModelForCausalLM

    saved_dir = _saved(family, tmp_path / "saved")
    src = _by_hand(family, _model(family), tmp_path / "src") if family in PUBLISHED_KEYS else saved_dir
    batch = torch.randint(0, BASE["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    plain = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        expected = float(plain(input_ids=batch, labels=batch).loss)
    results = run_ranks(_load_loss_save, ranks, str(src), str(tmp_path / "out"), batch, timeout=180)
    for loss, diff in results:
        assert diff == 0.0 and abs(loss - expected) <= 1e-5, (family, loss, expected, diff)
    saved, written = _tensors(saved_dir), _tensors(tmp_path / "out")
    assert written.keys() == saved.keys()  # the family's own save_pretrained names (published layout)
    assert all(torch.equal(written[k], v) for k, v in saved.items())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).state_dict()
    assert all(torch.equal(reloaded[k], v) for k, v in plain.state_dict().items())
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == [type(plain).__name__]


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_published_moe_trains_fl_fsdp_with_its_own_tokenizer_and_exports_its_published_layout(tmp_path):
    """`--model DIR --pretrained` of a Mixtral in its published layout with its tokenizer: FL+FSDP 2 x 2, 4 steps; the
    run's model/ has the published names and its tokenizer, and from_pretrained reloads it."""
    import random

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flwr_sharded.training.corpus import train_tokenizer
    from tests.multiproc import train_ranks

    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 40))) for _ in range(300)]
    src = _by_hand("mixtral", _model("mixtral", vocab_size=300), tmp_path / "src")
    tokenizer = train_tokenizer(docs, vocab_size=300)
    tokenizer.save_pretrained(src)
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tmp_path / "data").mkdir()  # no tokenizer there: the model's is the only one
    result = train_ranks(4, ["--method", "fl-fsdp", "--federations", "2", "--shards", "2", "--model", str(src),
                          "--pretrained", "--dataset", str(tmp_path / "corpus.jsonl"), "--data-dir",
                          str(tmp_path / "data"), "--seq-len", "32", "--batch-size", "2", "--steps", "4",
                          "--aggregate-every", "2", "--eval-blocks", "2", "--no-progress", "--run-dir",
                          str(tmp_path / "run"), "--tokenize-workers", "1", "--checkpoint-dir",
                          str(tmp_path / "ckpt"), "--checkpoint-every", "4"], timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    out = tmp_path / "run" / "model"
    assert _tensors(out).keys() == _tensors(src).keys()
    assert AutoTokenizer.from_pretrained(out).get_vocab() == tokenizer.get_vocab()
    assert type(AutoModelForCausalLM.from_pretrained(out)).__name__ == "MixtralForCausalLM"
    # `flwr-sharded export` from the DCP checkpoint writes the same published layout and values
    from flwr_sharded.training.checkpoint_export import export_pretrained

    exported = _tensors(export_pretrained(tmp_path / "ckpt" / "group-0", tmp_path / "exported"))
    written = _tensors(out)
    assert exported.keys() == written.keys()
    assert all(torch.equal(exported[k], written[k]) for k in written)
