"""Planner: cluster YAML, layout enumeration, ranking on the example clusters, the paper's layouts, the CLI."""

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from flwr_sharded.errors import ConfigError
from flwr_sharded_perf import plan_cli, planner
from flwr_sharded_perf.cluster import (
    cluster_from_dict,
    load_cluster,
    parse_bandwidth,
    parse_flops,
    parse_latency,
    parse_memory,
)
from flwr_sharded_perf.memory_model import StepOptions
from flwr_sharded_perf.planner import PAPER_TABLE4, layouts, model_from_preset, paper_layouts, plan
from flwr_sharded.presets import PRESETS

CLUSTERS = Path(__file__).resolve().parents[2] / "examples" / "clusters"
GOOD = {"gpus_per_node": 4, "nodes": 4, "nodes_per_group": 2, "gpu_memory": "64GB", "flops_per_gpu": "100TFLOPS",
        "bandwidth": {"intra_node": "800Gbit", "inter_node": "200Gbit", "inter_group": "100Gbit"}}


@pytest.fixture(scope="module")
def llama8b():
    return model_from_preset("llama3.1-8b")


# ---------------------------------------------------------------------------------------------------------------------
# Cluster files


@pytest.mark.parametrize("text, bits", [("200Gbit", 200e9), ("100Mbit", 100e6), ("7.5Gbit", 7.5e9),
                                        ("7.5 Gbit/s", 7.5e9), ("100Mbps", 100e6), ("25GB/s", 200e9), (1e9, 1e9)])
def test_parse_bandwidth(text, bits):
    assert parse_bandwidth(text) == pytest.approx(bits)


def test_parse_other_quantities():
    assert parse_memory("64GB") == 64e9
    assert parse_memory("80GiB") == 80 * 2**30
    assert parse_latency("5us") == pytest.approx(5e-6)
    assert parse_latency("2ms") == pytest.approx(2e-3)
    assert parse_flops("156TFLOPS") == pytest.approx(156e12)
    assert parse_flops("156e12") == pytest.approx(156e12)  # YAML reads 156e12 as a string


def test_example_clusters_load():
    leo = load_cluster(CLUSTERS / "leonardo.yaml")
    assert (leo.gpus_per_node, leo.nodes, leo.gpus, leo.nodes_per_group) == (4, 128, 512, 32)
    assert leo.bandwidth["inter_node"] == 200e9 and leo.gpu_memory == 64e9 and leo.backend == "nccl"
    emu = load_cluster(CLUSTERS / "emulated.yaml")
    assert (emu.gpus_per_node, emu.nodes, emu.nodes_per_group) == (2, 4, 2)
    assert emu.bandwidth == {"intra_node": 7.5e9, "inter_node": 1e9, "inter_group": 1e8}
    assert emu.backend == "gloo"
    flat = load_cluster(CLUSTERS / "flat-fast.yaml")
    assert flat.nodes == 1 and flat.gpus == 8


@pytest.mark.parametrize("change, field", [
    ({"gpus_per_node": None}, "gpus_per_node"),
    ({"nodes": 0}, "nodes"),
    ({"gpu_memory": None}, "gpu_memory"),
    ({"gpu_memory": "lots"}, "gpu_memory"),
    ({"flops_per_gpu": -1}, "flops_per_gpu"),
    ({"bandwidth": {"intra_node": "800Gbit", "inter_node": "-5Gbit", "inter_group": "1Gbit"}}, "bandwidth.inter_node"),
    ({"bandwidth": {"intra_node": "800Gbit", "inter_node": "200Gfoo", "inter_group": "1Gbit"}},
     "bandwidth.inter_node"),
    ({"bandwidth": {"intra_node": "800Gbit", "inter_node": "200G", "inter_group": "1Gbit"}}, "bandwidth.inter_node"),
    ({"bandwidth": {"intra_node": "800Gbit", "inter_node": "200Gbit"}}, "bandwidth.inter_group"),
    ({"bandwidth": {"intra_node": "1Tbit", "inter_node": "1Gbit", "inter_group": "1Gbit", "wan": "1Mbit"}},
     "bandwidth.wan"),
    ({"latency": {"inter_node": "-1us"}}, "latency.inter_node"),
    ({"nodes_per_group": 8}, "nodes_per_group"),
    ({"backend": "mpi"}, "backend"),
    ({"gpus_per_nodes": 4}, "gpus_per_nodes"),
    ({"shared": ["intra_node"]}, "shared"),
])
def test_bad_cluster_names_the_field(tmp_path, change, field):
    data = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_cluster(path)


def test_unreadable_cluster(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_cluster(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_cluster(tmp_path / "list.yaml")


def test_single_node_needs_only_intra_node():
    c = cluster_from_dict({"gpus_per_node": 8, "nodes": 1, "gpu_memory": "80GB", "flops_per_gpu": 1e14,
                           "bandwidth": {"intra_node": "3.6Tbit"}})
    assert c.latency == {"intra_node": 0.0, "inter_node": 0.0, "inter_group": 0.0}


# ---------------------------------------------------------------------------------------------------------------------
# Enumeration and ranking


def test_layouts_use_all_gpus():
    found = layouts(16, 4, aggregate_every=(1, 8))
    assert all(F * R * S == 16 for _, F, R, S, _ in found)
    assert all(S in (1, 2, 4, 8, 16) for _, _, _, S, _ in found)
    assert ("fsdp", 1, 1, 16, 1) in found and ("hsdp", 1, 4, 4, 1) in found
    assert ("fl-fsdp", 4, 1, 4, 8) in found and ("fl-hsdp", 2, 2, 4, 1) in found
    assert all(A == 1 for m, *_, A in found if not m.startswith("fl-"))
    assert not [x for x in layouts(12, 4) if x[3] in (3, 6)]  # a sharding group must pack into or fill nodes


def test_model_from_preset_counts():
    shape = model_from_preset("llama3.1-8b")
    assert shape.num_params == PRESETS["llama3.1-8b"].num_parameters()
    assert 8.0e9 < shape.num_params < 8.1e9 and shape.num_layers == 32
    assert shape.root_params == 2 * 128256 * 4096 + 4096  # untied embeddings and head + final norm
    small = model_from_preset("small", vocab_size=8192)
    assert small.num_params == PRESETS["small"].num_parameters(8192)
    with pytest.raises(ConfigError, match="unknown preset"):
        model_from_preset("gpt-5")


def test_leonardo_recommends_fl(llama8b):
    leo = load_cluster(CLUSTERS / "leonardo.yaml")
    # The trainer's memory (16 bytes per parameter: fp32 weights, gradients, AdamW moments; fp32 logits) puts S = 4
    # at 55.7 GiB with 4096 tokens per GPU, over 90% of 64 GB (the old 8-byte estimate said 44.7 GiB). Activation
    # checkpointing brings it to 37.8 GiB, and back the recommendation of a federation of 4-GPU groups.
    ranked = plan(leo, llama8b, activation_checkpointing=True)
    assert ranked[0].federated
    assert ranked[0].S == 4  # the smallest sharding group that fits 64 GB, inside a node
    fsdp = next(c for c in ranked if c.method == "fsdp")
    assert fsdp.step_time > 2 * ranked[0].step_time
    plain = plan(leo, llama8b)
    assert min(c.S for c in plain) == 8  # sharding groups now span 2 nodes
    fastest = min(plain, key=lambda c: c.step_time)
    assert fastest.federated and fastest.S == 8 and plain[0] is fastest
    # the calibrated model (latency per ring step, shared NICs): FL saves more than the 10% margin over the best
    # synchronous layout, hsdp over 8 replicas of 64-GPU sharding groups
    synchronous = next(c for c in plain if not c.federated)
    assert (synchronous.method, synchronous.R, synchronous.S) == ("hsdp", 8, 64)
    assert fastest.step_time * 1.1 < synchronous.step_time


def test_emulated_recommends_fl():
    emu = load_cluster(CLUSTERS / "emulated.yaml")
    ranked = plan(emu, model_from_preset("small", vocab_size=8192), tokens_per_gpu_batch=512, bytes_per_param=4)
    assert ranked[0].federated
    assert ranked[0].tiers["federation"] == "inter_group"


def test_flat_fast_recommends_synchronous(llama8b):
    flat = load_cluster(CLUSTERS / "flat-fast.yaml")
    ranked = plan(flat, llama8b)
    assert ranked[0].method in ("fsdp", "hsdp")
    # FL is still a little faster per step, but by less than the 10% margin
    fastest = min(ranked, key=lambda c: c.step_time)
    assert fastest.federated and fastest.step_time * 1.1 > ranked[0].step_time
    assert plan(flat, llama8b, fl_margin=0.0)[0].federated


def test_memory_excludes_layouts(llama8b):
    leo = load_cluster(CLUSTERS / "leonardo.yaml")
    ranked = plan(leo, llama8b, aggregate_every=(8,))
    assert ranked and all(c.fits and c.memory.total <= 0.9 * 64e9 for c in ranked)
    # S = 1 (128 GB of states alone), S = 2 and, with the trainer's 16 bytes per parameter (was 8), S = 4 do not fit
    assert min(c.S for c in ranked) == 8
    assert min(c.S for c in plan(leo, llama8b, aggregate_every=(8,), activation_checkpointing=True)) == 4
    assert {c.S for c in ranked} < {S for *_, S, _ in layouts(512, 4)}
    tiny = cluster_from_dict({**GOOD, "gpu_memory": "1GB"})
    assert plan(tiny, llama8b) == []


def test_options(llama8b):
    leo = load_cluster(CLUSTERS / "leonardo.yaml")
    only = plan(leo, llama8b, methods=("hsdp",))
    assert {c.method for c in only} == {"hsdp"}
    with_latency = plan(leo, llama8b, methods=("fsdp",), latency=True)[0]
    assert with_latency.comm.latency > 0
    paper = plan(leo, llama8b, methods=("fsdp",), sizes="paper")[0]
    assert paper.comm.total == pytest.approx(3 * llama8b.num_params * 16 * 511 / 512 / 100e9)
    with pytest.raises(ConfigError, match="--methods"):
        plan(leo, llama8b, methods=("ddp",))
    with pytest.raises(ConfigError, match="--aggregate-every"):
        plan(leo, llama8b, aggregate_every=(0,))


def test_shared_uplinks_divide_bandwidth():
    emu = load_cluster(CLUSTERS / "emulated.yaml")
    shape = model_from_preset("tiny", vocab_size=8192)
    hsdp = planner.evaluate(emu, shape, "hsdp", R=2, S=4)
    # 4 replication pairs leave each group through one 100 Mbit/s uplink; the 1 Gbit/s node links carry 2 each
    assert hsdp.tiers == {"shard": "inter_node", "replica": "inter_group", "federation": None}
    assert hsdp.bandwidth == {"shard": 1e9, "replica": 25e6, "federation": None}
    flat = cluster_from_dict({"gpus_per_node": 2, "nodes": 4, "nodes_per_group": 2, "gpu_memory": "2GB",
                              "flops_per_gpu": "4GFLOPS",
                              "bandwidth": {"intra_node": "7.5Gbit", "inter_node": "1Gbit", "inter_group": "100Mbit"}})
    assert planner.evaluate(flat, shape, "hsdp", R=2, S=4).bandwidth["replica"] == 100e6


def test_sync_dtype_sets_the_fl_sync_bits(llama8b):
    leo = load_cluster(CLUSTERS / "leonardo.yaml")
    kw = dict(F=128, R=1, S=4, A=8, bytes_per_param=2.0)
    default = planner.evaluate(leo, llama8b, "fl-fsdp", **kw)
    fp32 = planner.evaluate(leo, llama8b, "fl-fsdp", sync_bytes_per_param=4.0, **kw)
    bf16 = planner.evaluate(leo, llama8b, "fl-fsdp", sync_bytes_per_param=2.0, **kw)
    assert bf16.comm == default.comm  # the default: the sync at --bytes-per-param
    assert fp32.comm.sync == pytest.approx(2 * bf16.comm.sync) and fp32.comm.shard == bf16.comm.shard
    fsdp = planner.evaluate(leo, llama8b, "fsdp", S=512, sync_bytes_per_param=4.0)
    assert fsdp.comm == planner.evaluate(leo, llama8b, "fsdp", S=512).comm  # no sync, nothing changes
    ranked = plan(leo, llama8b, methods=("fl-fsdp",), aggregate_every=(8,), sync_bytes_per_param=4.0)
    assert ranked[0].comm.sync > plan(leo, llama8b, methods=("fl-fsdp",), aggregate_every=(8,))[0].comm.sync


def test_effective_batch(llama8b):
    leo = load_cluster(CLUSTERS / "leonardo.yaml")
    # activation checkpointing: the S = 4 layouts fit 64 GB with it (test_leonardo_recommends_fl)
    by_layout = {(c.method, c.F, c.R, c.S): c for c in plan(leo, llama8b, aggregate_every=(8,),
                                                            activation_checkpointing=True)}
    assert by_layout[("fsdp", 1, 1, 512)].batch_tokens == 512 * 4096
    assert by_layout[("hsdp", 1, 128, 4)].batch_tokens == 512 * 4096
    assert by_layout[("fl-fsdp", 128, 1, 4)].batch_tokens == 4 * 4096
    assert by_layout[("fl-hsdp", 16, 8, 4)].batch_tokens == 32 * 4096


def test_paper_layouts(llama8b):
    rows = paper_layouts(load_cluster(CLUSTERS / "leonardo.yaml"))
    assert [r.label for r in rows] == ["FSDP", "HSDP", "FL+FSDP", "FL+HSDP"]
    assert [r.measured["overall"][0] for r in rows] == [12.04, 1.84, 1.45, 1.53]
    assert PAPER_TABLE4["FL+FSDP"]["aggregation"] == (0.17, 0.55)
    predicted = {r.label: r.predicted.step_time for r in rows}
    assert predicted["FSDP"] == max(predicted.values()) and predicted["FL+FSDP"] == min(predicted.values())
    assert all(r.predicted.A == (8 if r.label.startswith("FL") else 1) for r in rows)
    with pytest.raises(ConfigError, match="512"):
        paper_layouts(load_cluster(CLUSTERS / "emulated.yaml"))


# ---------------------------------------------------------------------------------------------------------------------
# Command line


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="flwr-sharded")
    plan_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    return args.func(args)


def test_cli_table(capsys):
    assert _cli("--cluster", str(CLUSTERS / "leonardo.yaml"), "--model", "llama3.1-8b", "--top", "3",
                "--activation-checkpointing") == 0  # without it S = 4 does not fit (test_leonardo_recommends_fl)
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "method" in lines[1] and "mem/GPU GiB" in lines[1]
    assert len([x for x in lines if x.lstrip()[:1].isdigit()]) == 3
    # with checkpointing fl-hsdp 4x32x4 and fl-fsdp 128x1x4 are within 0.1% (the replicas' all-reduce hides behind
    # the longer backward): a federation of 4-GPU sharding groups either way
    assert lines[-1].startswith("Recommended: fl-") and "S=4" in lines[-1] and "faster than fsdp" in lines[-1]


def test_cli_json_and_params(capsys):
    assert _cli("--cluster", str(CLUSTERS / "flat-fast.yaml"), "--params", "8e9", "--layers", "32", "--json",
                "--aggregate-every", "1,8") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recommended"]["method"] in ("fsdp", "hsdp") and data["candidates"]
    assert {c["A"] for c in data["candidates"]} <= {1, 8}


def test_cli_sync_dtype(capsys):
    def sync_s(*extra: str) -> float:
        assert _cli("--cluster", str(CLUSTERS / "leonardo.yaml"), "--model", "llama3.1-8b", "--methods", "fl-fsdp",
                    "--aggregate-every", "8", "--json", *extra) == 0
        return json.loads(capsys.readouterr().out)["recommended"]["comm_terms_s"]["sync"]

    assert sync_s("--sync-dtype", "float32") == pytest.approx(2 * sync_s("--sync-dtype", "bfloat16"))
    assert sync_s() == pytest.approx(sync_s("--sync-dtype", "bfloat16"))  # --bytes-per-param 2 by default
    with pytest.raises(SystemExit):
        _cli("--cluster", str(CLUSTERS / "leonardo.yaml"), "--model", "tiny", "--sync-dtype", "float16")


def test_the_planner_recommends_the_dense_2_bit_wire_where_top_k_lacks_syncs_or_sends_more(capsys):
    from flwr_sharded_perf.wire_choice import SparseParity, advice

    reached = (SparseParity(fraction=0.01, syncs=200, longest_run_syncs=256, longest_run_gap=0.01, recipe=""),)
    assert advice(0.01, 400, 4, reached) is None  # enough syncs, fewer bytes than int2 (0.0088x against 0.066x)
    few = advice(0.01, 100, 4, reached)
    assert "needs about 200 syncs" in few and "--sync-dtype int2 --sync-error-feedback" in few
    assert "needs about 100 syncs" in advice(0.02, 50, 4, reached)  # the same exposure: fraction x syncs
    assert "grow with the groups" in advice(0.01, 10_000, 64, reached)  # 64 groups: rows worth 0.14x
    unreached = (SparseParity(fraction=0.01, syncs=None, longest_run_syncs=32, longest_run_gap=0.05, recipe="R"),
                 SparseParity(fraction=0.02, syncs=None, longest_run_syncs=256, longest_run_gap=0.12, recipe="Q"),
                 SparseParity(fraction=0.04, syncs=80, longest_run_syncs=80, longest_run_gap=0.0, recipe=""))
    assert "at 0.02 (Q) was still +12.0% from it after 256 syncs" in advice(0.01, 10_000, 4, unreached)
    assert "at 0.01 (R) was still +5.0% from it after 32 syncs" in advice(0.005, 10_000, 4, unreached[:1])
    assert "at 0.02 (Q)" in advice(0.03, 10_000, 4, unreached)  # parity at 4% bounds nothing below it
    assert advice(0.05, 64, 4, unreached) is None and "needs about 64 syncs" in advice(0.05, 10, 4, unreached)
    assert "after 256 syncs" in advice(0.01, 10_000, 4)  # the benchmark's: top-1% never reached parity
    assert _cli("--cluster", str(CLUSTERS / "leonardo.yaml"), "--model", "llama3.1-8b", "--methods", "fl-fsdp",
                "--aggregate-every", "8", "--sync-dtype", "int2", "--sync-topk", "0.01", "--steps", "64",
                "--json") == 0
    assert "--sync-dtype int2" in json.loads(capsys.readouterr().out)["wire_advice"]  # 8 syncs


def test_cli_paper_layouts(capsys):
    assert _cli("--cluster", str(CLUSTERS / "leonardo.yaml"), "--layouts", "paper") == 0
    out = capsys.readouterr().out
    assert "12.04±0.26" in out and "FL+HSDP" in out and "Speedup over FSDP" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:6]}
    assert "mem/GPU GiB" in out and rows["FSDP"][-1] == "yes" and rows["FL+FSDP"][-1] == "NO"
    assert "try --activation-checkpointing" in out.splitlines()[-1]
    assert _cli("--cluster", str(CLUSTERS / "leonardo.yaml"), "--layouts", "paper", "--activation-checkpointing") == 0
    out = capsys.readouterr().out
    assert all(line.split()[-1] == "yes" for line in out.splitlines()[2:6])


def test_paper_layouts_memory(llama8b):
    leo = load_cluster(CLUSTERS / "leonardo.yaml")
    rows = {r.label: r.predicted for r in paper_layouts(leo)}
    # HSDP, FL+FSDP and FL+HSDP all shard over S = 4: the same memory but for FL's bucket; FSDP over 512
    assert rows["HSDP"].memory.total < rows["FL+FSDP"].memory.total == rows["FL+HSDP"].memory.total
    assert rows["FL+FSDP"].memory.total - rows["HSDP"].memory.total == 64 * 2**20
    assert not rows["FL+FSDP"].fits and rows["FSDP"].fits
    assert rows["FL+FSDP"].memory.peak_phase == "loss backward"  # activations and fp32 logits at the loss
    ckpt = {r.label: r.predicted for r in paper_layouts(leo, activation_checkpointing=True)}
    assert all(c.fits for c in ckpt.values())
    nesterov = paper_layouts(leo, step=StepOptions(outer="nesterov"), activation_checkpointing=True)
    assert nesterov[2].predicted.memory.sync - ckpt["FL+FSDP"].memory.sync == pytest.approx(
        8 * llama8b.num_params / 4)  # the global shards and the momentum


def test_cli_errors(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**GOOD, "nodes": -1}))
    assert _cli("--cluster", str(bad), "--model", "tiny") == 2
    assert "nodes" in capsys.readouterr().err
    assert _cli("--cluster", str(CLUSTERS / "leonardo.yaml")) == 2
    assert "--model" in capsys.readouterr().err
    assert _cli("--cluster", str(CLUSTERS / "leonardo.yaml"), "--params", "1e9") == 2
    assert "--layers" in capsys.readouterr().err
    small = tmp_path / "small.yaml"
    small.write_text(yaml.safe_dump({**GOOD, "gpu_memory": "1GB"}))
    assert _cli("--cluster", str(small), "--model", "llama3.1-8b") == 1
    assert "no layout fits" in capsys.readouterr().err


def test_cli_takes_a_model_directory_or_a_hub_id_as_train_does(tmp_path, capsys, monkeypatch):
    """`plan --model` reads the architecture from a model's config.json (a directory, or a hub id in the cache)."""
    from flwr_sharded_perf.model_shape import model_from_name, model_from_preset

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
              "tie_word_embeddings": True, "vocab_size": 8192}  # the tiny preset's shape, with its vocabulary
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config))
    tiny = model_from_preset("tiny", 8192)
    assert model_from_name(str(model_dir)) == replace(tiny, name=str(model_dir))
    from huggingface_hub import constants

    snapshot = tmp_path / "hub" / "models--acme--tiny-llama" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert model_from_name("acme/tiny-llama").num_params == tiny.num_params
    assert _cli("--cluster", str(CLUSTERS / "flat-fast.yaml"), "--model", str(model_dir), "--json") == 0
    assert json.loads(capsys.readouterr().out)["model"] == str(model_dir)
    (model_dir / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 32}))
    assert _cli("--cluster", str(CLUSTERS / "flat-fast.yaml"), "--model", str(model_dir)) == 2
    assert "does not describe a Llama-like decoder" in capsys.readouterr().err
    assert _cli("--cluster", str(CLUSTERS / "flat-fast.yaml"), "--model", "acme/missing") == 2
    assert "cannot read the config.json of 'acme/missing'" in capsys.readouterr().err
