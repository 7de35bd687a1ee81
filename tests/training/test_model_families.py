"""Hugging Face families beyond Llama, dense and mixture-of-experts: each builds on the meta device, starts as its own
`_init_weights` would start it (recorded, then applied row by row: the same full values for any shard count), and is
priced by the planner at the parameter count of the built model."""

from __future__ import annotations

import math

import pytest
import torch

COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, max_position_embeddings=64)
FAMILIES = {
    "llama": ("LlamaConfig", dict(pad_token_id=3)),
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
    "mistral": ("MistralConfig", {}),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=8, pad_token_id=0)),
    "phi3": ("Phi3Config", dict(pad_token_id=None, tie_word_embeddings=True)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                         mlp_only_layers=[1])),
}
MOE = ("mixtral", "qwen3-moe")


def family_config(family: str):
    import transformers

    cls, extra = FAMILIES[family]
    return getattr(transformers, cls)(**COMMON, **extra)


def _seeded(config, seed: int = 5):
    """`config`'s model initialised by the recorded plan, unsharded (one process), and the plan."""
    from flwr_sharded.training.model_init import init_local_shards, materialize, record_init
    from flwr_sharded.training.models import build_meta_model

    model = build_meta_model(config)
    plan = record_init(model)
    materialize(model, "cpu")
    model.tie_weights()  # `to_empty` outside FSDP unties; the sharded build keeps one parameter
    init_local_shards(model, seed, plan)
    return model, plan


@pytest.mark.parametrize("family", FAMILIES)
def test_seeded_init_is_the_models_own(family):
    """Per parameter: exact where the model's own init is constant (zeros, ones, padding rows), else mean and std
    within 5 standard errors (plus 2 % on the std) of `from_config`'s."""
    from transformers import AutoModelForCausalLM

    config = family_config(family)
    ours, plan = _seeded(config)
    torch.manual_seed(0)
    theirs = dict(AutoModelForCausalLM.from_config(config).named_parameters())
    assert dict(ours.named_parameters()).keys() == theirs.keys()
    for name, mine in ours.named_parameters():
        mine, ref = mine.detach(), theirs[name].detach()
        assert mine.shape == ref.shape, name
        for value in (0.0, 1.0):  # what the model sets exactly, ours sets exactly
            assert torch.equal(mine[ref == value], ref[ref == value]), (name, value)
        if float(ref.std()) == 0:
            assert torch.equal(mine, ref), name
            continue
        n, std = ref.numel(), float(ref.std())
        assert abs(float(mine.mean()) - float(ref.mean())) < 5 * std * math.sqrt(2 / n), name  # two samples' means
        assert abs(float(mine.std()) / std - 1) < 5 / math.sqrt(2 * n) + 0.02, name
    if family == "gemma3":  # 1-centred RMSNorm: stored offsets start at 0
        assert all(ops[-1].kind == "constant" and ops[-1].args == (0.0,) for n, ops in plan.items() if "norm" in n)
    if family in MOE:
        assert any(p.dim() == 3 for p in ours.parameters())  # fused experts, initialised like any parameter


@pytest.mark.parametrize("family", FAMILIES)
def test_full_values_are_the_same_for_any_shard_count(family):
    """Each shard of FSDP2's dim-0 chunks filled on its own gives the values of the unsharded parameter."""
    from flwr_sharded.training.model_init import init_rows
    from flwr_sharded.training.models import build_meta_model, owned_parameters

    config = family_config(family)
    whole, plan = _seeded(config, seed=11)
    full = {name: param.detach() for name, param, _ in owned_parameters(whole)}
    for name, param, _ in owned_parameters(build_meta_model(config)):
        for shards in (2, 3, 4):
            pieces, offset = [], 0
            for chunk in torch.empty(param.shape).chunk(shards):
                piece = torch.full_like(chunk, float("nan"))
                init_rows(piece, plan[name], name=name, shape=param.shape, offset=offset, seed=11)
                pieces.append(piece)
                offset += chunk.shape[0]
            assert torch.equal(torch.cat(pieces), full[name]), (name, shards)


def test_another_seed_draws_other_values_and_the_same_constants():
    config = family_config("mixtral")
    a, b = dict(_seeded(config, 1)[0].named_parameters()), dict(_seeded(config, 2)[0].named_parameters())
    for name, value in a.items():
        assert torch.equal(value, b[name]) == ("norm" in name), name


def test_llama_draws_as_before():
    """A Llama's recorded ops are the former table's: one normal of initializer_range per matrix (its first draw,
    seeded by its name), ones for norms, the padding row zero."""
    from flwr_sharded.training.model_init import InitOp

    config = family_config("llama")
    _, plan = _seeded(config)
    std = config.initializer_range
    assert plan["model.embed_tokens.weight"] == (InitOp("normal", (0.0, std)), InitOp("constant", (0.0,), (3, 4)))
    assert plan["model.norm.weight"] == (InitOp("constant", (1.0,)),)
    assert plan["model.layers.0.self_attn.q_proj.weight"] == (InitOp("normal", (0.0, std)),)


def test_every_recorded_op_applies_row_by_row(monkeypatch):
    """uniform, truncated normal, a constant, a copy of known values and a row range, as a model's init may use
    them: applied per shard they give the values the op defines, the same for any shard count."""
    from transformers import initialization as init
    from transformers.models.llama import modeling_llama

    from flwr_sharded.training.model_init import init_rows
    from flwr_sharded.training.models import build_meta_model

    own = modeling_llama.LlamaPreTrainedModel._init_weights
    known = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)

    def init_weights(self, module):
        own(self, module)
        if isinstance(module, modeling_llama.LlamaMLP):
            init.uniform_(module.gate_proj.weight, -0.5, 0.25)
            init.trunc_normal_(module.up_proj.weight, std=1.0, a=-0.1, b=0.2)
            init.copy_(module.down_proj.weight, known.T)
            init.constant_(module.down_proj.weight[3:5], 7.0)

    monkeypatch.setattr(modeling_llama.LlamaPreTrainedModel, "_init_weights", init_weights)
    config = family_config("llama")
    ours, plan = _seeded(config)
    mlp = ours.model.layers[1].mlp
    gate, up, down = mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach(), mlp.down_proj.weight.detach()
    assert -0.5 <= float(gate.min()) < -0.4 and 0.15 < float(gate.max()) <= 0.25
    assert -0.1 <= float(up.min()) and float(up.max()) <= 0.2 and float(up.std()) > 0.05
    assert torch.equal(down[3:5], torch.full((2, 64), 7.0)) and torch.equal(down[5:], known.T[5:])
    for name, param in build_meta_model(config).named_parameters():
        if ".mlp." in name:
            pieces = [torch.empty(chunk.shape) for chunk in torch.empty(param.shape).chunk(4)]
            for i, piece in enumerate(pieces):
                init_rows(piece, plan[name], name=name, shape=param.shape, offset=sum(len(p) for p in pieces[:i]),
                          seed=5)
            assert torch.equal(torch.cat(pieces), dict(ours.named_parameters())[name].detach()), name


def _broken_init(monkeypatch, how: str):
    from transformers import initialization as init
    from transformers.models.llama import modeling_llama

    own = modeling_llama.LlamaPreTrainedModel._init_weights

    def init_weights(self, module):
        own(self, module)
        if isinstance(module, modeling_llama.LlamaAttention):
            if how == "xavier":
                init.xavier_uniform_(module.q_proj.weight)
            elif how == "tensor":
                module.k_proj.weight.uniform_()
            elif how == "columns":
                init.zeros_(module.v_proj.weight[:, :2])
        if isinstance(module, modeling_llama.LlamaRMSNorm) and how == "unset":
            module.weight._is_hf_initialized = True  # whatever the model leaves alone

    monkeypatch.setattr(modeling_llama.LlamaPreTrainedModel, "_init_weights", init_weights)


@pytest.mark.parametrize("how,message", [
    ("xavier", "model.layers.0.self_attn.q_proj.weight is xavier_uniform_, which cannot be applied row by row"),
    ("tensor", "writes model.layers.0.self_attn.k_proj.weight with Tensor.uniform_"),
    ("columns", "writes part of model.layers.0.self_attn.v_proj.weight that is not whole rows"),
])
def test_an_init_that_cannot_be_sharded_is_refused_by_name(monkeypatch, how, message):
    from flwr_sharded.errors import ConfigError
    from flwr_sharded.training.model_init import record_init
    from flwr_sharded.training.models import build_meta_model

    _broken_init(monkeypatch, how)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        record_init(build_meta_model(family_config("llama")), "tiny-llama")


def test_a_parameter_the_model_leaves_unset_is_refused(monkeypatch):
    from transformers import initialization as init
    from transformers.models.llama import modeling_llama

    from flwr_sharded.errors import ConfigError
    from flwr_sharded.training.model_init import record_init
    from flwr_sharded.training.models import build_meta_model

    own = modeling_llama.LlamaPreTrainedModel._init_weights
    ones = init.ones_

    def skip_norms(self, module):
        if "RMSNorm" not in type(module).__name__:
            own(self, module)

    monkeypatch.setattr(modeling_llama.LlamaPreTrainedModel, "_init_weights", skip_norms)
    with pytest.raises(ConfigError, match=r"leaves 5 parameter\(s\) unset, e.g. \['model.layers.0.input_layernorm"):
        record_init(build_meta_model(family_config("llama")), "tiny-llama")
    assert init.ones_ is ones  # the recorders are gone


def test_the_check_before_any_process_group(tmp_path, monkeypatch):
    """`check_seeded_init` (preflight) refuses a model directory whose init cannot be sharded, in one ConfigError."""
    from flwr_sharded.errors import ConfigError
    from flwr_sharded.training.model_init import check_seeded_init

    family_config("llama").save_pretrained(tmp_path)
    check_seeded_init(str(tmp_path), vocab_size=96, max_seq_len=32)
    _broken_init(monkeypatch, "xavier")
    with pytest.raises(ConfigError, match=f"--model {tmp_path}: its init of model.layers.0"):
        check_seeded_init(str(tmp_path), vocab_size=96, max_seq_len=32)


@pytest.mark.parametrize("family", MOE)
def test_experts_and_router_shard_and_sync_with_their_block(family):
    """The fused experts and the router are parameters of their decoder block (its FSDP2 unit) and of the block's
    sync fragment: nothing filters them out."""
    from flwr_sharded.parallel.schedule import fragment_parameters
    from flwr_sharded.training.models import build_meta_model, transformer_blocks

    model = build_meta_model(family_config(family))
    blocks = transformer_blocks(model)
    assert len(blocks) == 2
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    moe = [(n, p) for n, p in model.named_parameters() if "experts" in n or "gate.weight" in n or "router" in n]
    assert moe and all(id(p) in in_blocks for _, p in moe)
    synced = [n for fragment in fragment_parameters(model, blocks, 2) for n, _ in fragment]
    assert sorted(synced) == sorted(n for n, _ in model.named_parameters())


@pytest.mark.parametrize("family", MOE)
def test_a_mixtures_flops_count_the_routed_experts(family):
    from torch import nn

    from flwr_sharded.training.metrics import model_flops_per_token
    from flwr_sharded.training.models import build_meta_model

    model = build_meta_model(family_config(family))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    config = family_config(family)
    width = config.num_attention_heads * (getattr(config, "head_dim", None) or 32 // config.num_attention_heads)
    assert experts and model_flops_per_token(model, 16) == 6 * (linear + experts // 2) + 12 * 2 * width * 16


def test_attention_flops_count_the_query_width_not_the_hidden_size():
    """Qwen3 with head_dim 16 and 4 heads: attention's scores and values are 64 wide, not hidden_size 32."""
    from torch import nn

    from flwr_sharded.training.metrics import model_flops_per_token
    from flwr_sharded.training.models import build_meta_model

    model = build_meta_model(family_config("qwen3"))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert model_flops_per_token(model, 16) == 6 * linear + 12 * 2 * (4 * 16) * 16


@pytest.mark.parametrize("family", FAMILIES)
def test_the_planner_counts_the_built_model(family):
    """Total parameters equal the meta model's; active ones leave out the experts a token is not routed to."""
    from flwr_sharded.training.models import build_meta_model
    from flwr_sharded_perf.model_shape import shape_from_config

    config = family_config(family)
    model = build_meta_model(config)
    shape = shape_from_config(config.to_dict(), family)
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    assert shape.root_params == sum(p.numel() for n, p in model.named_parameters() if ".layers." not in n)
    assert shape.largest_param() == max(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    if family in MOE:
        assert experts and shape.active_params == shape.num_params - experts // 2  # 2 of 4 experts per token
        assert shape.compute_params < shape.num_params
    else:
        assert shape.active_params == shape.compute_params == shape.num_params


@pytest.mark.parametrize("name", ["qwen3-tiny", "moe-tiny"])
def test_non_llama_presets_build_and_are_priced_as_built(name):
    from flwr_sharded.presets import PRESETS
    from flwr_sharded.training.models import build_meta_model, model_config
    from flwr_sharded_perf.model_shape import model_from_name

    model = build_meta_model(model_config(name, vocab_size=96, max_seq_len=32))
    assert model.config.model_type == PRESETS[name].model_type
    total = sum(p.numel() for p in model.parameters())
    assert total == PRESETS[name].num_parameters(96) == model_from_name(name, 96).num_params


def test_a_big_moe_preset_is_priced_by_its_active_parameters():
    from flwr_sharded_perf.model_shape import model_from_name

    shape = model_from_name("qwen3-30b-a3b")
    assert 30.4e9 < shape.num_params < 30.6e9 and 3.2e9 < shape.active_params < 3.4e9


def _moe_on_ranks(rank: int, world: int):
    from flwr_sharded.config import ParallelConfig
    from flwr_sharded.parallel.sharding import mixed_precision_policy
    from flwr_sharded.parallel.topology import init_topology
    from flwr_sharded.training.model_init import build_sharded_model

    topo = init_topology(ParallelConfig(method="fsdp", shards=world))
    model = build_sharded_model("moe-tiny", vocab_size=96, max_seq_len=32, mesh=topo.fsdp_mesh, seed=7,
                                mp_policy=mixed_precision_policy("fp32", "cpu"))
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return full if rank == 0 else None


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_sharded_mixture_of_experts_starts_as_the_unsharded_one():
    """moe-tiny through `build_sharded_model` (FSDP2 on gloo, 2 and 4 shards: one expert per rank at 4) equals the
    recorded init applied to the whole model in one process."""
    from flwr_sharded.training.models import model_config
    from tests.multiproc import run_ranks

    whole = _seeded(model_config("moe-tiny", vocab_size=96, max_seq_len=32), seed=7)[0].state_dict()
    for world in (2, 4):
        full = run_ranks(_moe_on_ranks, world, timeout=240)[0]
        assert full.keys() == whole.keys()
        for key, value in whole.items():
            assert torch.equal(full[key], value), (world, key)


SGD = ["--optimizer", "sgd", "--lr", "0.5", "--weight-decay", "0", "--grad-clip", "0", "--warmup", "0",
       "--min-lr-ratio", "1", "--aggregate-every", "1", "--steps", "5", "--eval-every", "0", "--seq-len", "64",
       "--batch-size", "2", "--no-progress", "--eval-blocks", "8", "--log-every", "1", "--model", "moe-tiny"]


@pytest.mark.dist
@pytest.mark.timeout(400)
def test_a_mixture_of_experts_trains_fl_fsdp_and_its_experts_sync(data_dir, tmp_path):
    """Mixtral-style moe-tiny, FL+FSDP 2 groups x 2 shards on gloo: finite, decreasing loss; with SGD and a sync after
    every step its final model equals FSDP over 4 ranks (every parameter, router and experts among them, averaged
    like any shard). Tolerance 1e-5 (fp32; only the summation order differs)."""
    import json

    from transformers import AutoModelForCausalLM

    from tests.multiproc import train_ranks

    runs = {"fl": ["--method", "fl-fsdp", "--federations", "2", "--shards", "2"],
            "base": ["--method", "fsdp", "--shards", "4"]}
    for name, layout in runs.items():
        result = train_ranks(4, [*layout, *SGD, "--data-dir", str(data_dir), "--run-dir", str(tmp_path / name)],
                          timeout=300)
        assert result.returncode == 0, result.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "fl" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r.get("kind") == "train"]
    assert len(losses) == 5 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    fl, base = (AutoModelForCausalLM.from_pretrained(tmp_path / n / "model").state_dict() for n in runs)
    assert any(v.dim() == 3 for v in fl.values())
    for key, value in base.items():
        assert torch.allclose(fl[key], value, atol=1e-5), key


def test_the_planner_refuses_a_shape_it_cannot_price(tmp_path):
    import json

    from flwr_sharded.errors import ConfigError
    from flwr_sharded_perf.model_shape import model_from_name

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "deepseek_v3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 64, "vocab_size": 100, "kv_lora_rank": 16}))
    with pytest.raises(ConfigError, match="cannot price deepseek_v3's kv_lora_rank .*; give --params and --layers"):
        model_from_name(str(tmp_path))


TRAINED = [(family, ["--method", "fl-fsdp", "--federations", "2", "--shards", "2"])
           for family in ("qwen3", "mistral", "gemma3", "phi3", "qwen3-moe")] + \
          [("mixtral", ["--method", "hsdp", "--replicas", "2", "--shards", "2"]),
           ("mixtral", ["--method", "fl-hsdp", "--federations", "2", "--replicas", "2", "--shards", "1"])]


@pytest.mark.dist
@pytest.mark.slow  # seven 4-rank trainings (~2-3 min); Llama (`tiny`) and moe-tiny FL+FSDP run in `make test`
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,layout", TRAINED, ids=[f"{f}-{a[1]}" for f, a in TRAINED])
def test_each_family_trains_exports_and_reloads(family, layout, data_dir, tmp_path):
    """A seeded tiny model of each family (a config directory, the corpus tokenizer) trains 3 steps on 4 gloo ranks
    (FL+FSDP 2 x 2; Mixtral on the other two methods with replicas) with a finite loss; its model/ reloads with
    `from_pretrained` as the family's class, with the written values."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.multiproc import train_ranks

    config = family_config(family)
    config.vocab_size = 8192  # the corpus tokenizer's
    config.save_pretrained(tmp_path / "src")
    result = train_ranks(4, [*layout, "--model", str(tmp_path / "src"), "--tokenizer", str(data_dir / "tokenizer"),
                          "--data-dir", str(data_dir), "--seq-len", "32", "--batch-size", "2", "--steps", "3",
                          "--aggregate-every", "1", "--eval-every", "0", "--eval-blocks", "4", "--log-every", "1",
                          "--no-progress", "--run-dir", str(tmp_path / "run")], timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [math.isfinite(r["loss"]) for r in records if r.get("kind") == "train"] == [True] * 3
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model")
    assert type(model).__name__ == type(AutoModelForCausalLM.from_config(config)).__name__
    model.save_pretrained(tmp_path / "again")  # the family's own layout, from the values it read
    written, again = ({k: v for f in (tmp_path / d).glob("*.safetensors") for k, v in load_file(f).items()}
                      for d in ("run/model", "again"))
    assert written.keys() == again.keys()
    for key, value in written.items():
        assert torch.equal(again[key], value), key
