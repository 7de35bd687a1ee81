"""The memory model: every term against a hand computation for a small shape, the phases, and what options change."""

from dataclasses import replace

import pytest

from flwr_sharded.config import TrainConfig
from flwr_sharded.errors import ConfigError
from flwr_sharded_perf import memory_model as mm
from flwr_sharded_perf.memory_model import StepOptions, memory_per_gpu, rule_state_bytes, trainer_memory
from flwr_sharded_perf.model_shape import ModelShape
from tests.perf.paper_equations import states

# P = 1100: a root of 100 (embedding, head, norm) and 2 blocks of 500; h 10, kv 5, i 20, vocab 50
SHAPE = ModelShape(num_params=1100, num_layers=2, root_params=100, hidden_size=10, intermediate_size=20,
                   vocab_size=50, kv_size=5)
T = 3  # tokens per micro-batch
FP32 = StepOptions(precision="fp32")
BF16 = StepOptions(precision="bf16")


def test_terms_by_hand_fp32():
    m = trainer_memory(SHAPE, S=4, tokens=T, options=FP32)
    assert m.parameters == 4 * 1100 / 4 and m.gradients == 4 * 1100 / 4  # fp32 shards and fp32 sharded gradients
    assert m.optimizer == 8 * 1100 / 4  # AdamW's exp_avg and exp_avg_sq
    assert m.optimizer_temp == 4 * 1100 / 4  # CUDA's foreach: one fp32 sqrt(exp_avg_sq) of every shard
    assert m.sync == m.sync_temp == m.anchor == m.host == 0  # F = 1, no FedProx
    assert m.gathered_params == 4 * (100 + 2 * 500)  # the root and 2 blocks in flight, in the compute dtype
    # the root's unsharded gradients, one block's and its fp32 reduce-scatter input; or the root's reduce-scatter
    assert m.gathered_grads == max(4 * 100 + (4 + 4) * 500, (4 + 4) * 100)
    block = 4 * (8 * 10 + 2 * 5 + 4 * 20)  # no RMSNorm upcast in fp32
    outside = 4 * 3 * 10
    assert m.activations == T * (2 * block + outside)
    assert m.backward_working == T * 4 * 20  # one MLP-wide activation gradient
    assert m.logits == T * 3 * 4 * 50


def test_terms_by_hand_bf16():
    m = trainer_memory(SHAPE, S=4, tokens=T, options=BF16)
    assert m.parameters == 4 * 1100 / 4 and m.optimizer == 8 * 1100 / 4  # still fp32: bf16 is only for compute
    assert m.gathered_params == 2 * (100 + 2 * 500)
    assert m.gathered_grads == 2 * 100 + (2 + 4) * 500
    block = 2 * (8 * 10 + 2 * 5 + 4 * 20) + 2 * 2 * 10  # each of 2 RMSNorms keeps its input upcast to fp32
    outside = 2 * 3 * 10 + 2 * 10
    assert m.activations == T * (2 * block + outside)
    assert m.logits == T * 3 * 4 * 50  # the loss upcasts the logits: fp32 whatever the compute dtype


def test_phases_sum_the_live_terms():
    m = trainer_memory(SHAPE, S=4, tokens=T, options=FP32)
    base = m.parameters + m.optimizer
    outside = T * 4 * 3 * 10
    block_acts = T * 4 * (8 * 10 + 2 * 5 + 4 * 20)
    grads_block = 4 * 100 + 8 * 500
    assert m.phases == pytest.approx({
        "loss backward": base + m.gathered_params + m.activations + m.logits,
        "first block backward": base + m.gathered_params + m.activations - outside + m.backward_working + grads_block,
        "last block backward": base + 4 * 500 / 4 + 4 * (100 + 500) + block_acts + m.backward_working + grads_block,
        "root reduce-scatter": base + m.gradients + 4 * 100 + 8 * 100,
        "optimizer step": base + m.gradients + m.optimizer_temp,
    })
    assert m.total == max(m.phases.values()) == m.phases[m.peak_phase]
    assert m.peak_phase == "first block backward"
    # gradients and the full activations never coexist: the total is below the sum of all terms
    assert m.total < sum(m.terms().values())


def test_hsdp_replicates_over_R():
    fsdp = trainer_memory(SHAPE, S=2, tokens=T)
    hsdp = trainer_memory(SHAPE, S=2, R=2, tokens=T)
    assert hsdp == fsdp  # HSDP shards over S only; its all-reduce over R is in place
    assert trainer_memory(SHAPE, S=4, tokens=T).parameters == fsdp.parameters / 2  # FSDP over R x S ranks


def test_activation_checkpointing_lowers_activations():
    plain = trainer_memory(SHAPE, S=2, tokens=T, options=FP32)
    ckpt = trainer_memory(SHAPE, S=2, tokens=T, options=StepOptions(precision="fp32", activation_checkpointing=True))
    assert ckpt.activations == T * (2 * 4 * 10 + 4 * 3 * 10)  # only each block's input, and the head's
    assert ckpt.activations < plain.activations
    # the block being recomputed in backward comes back as working memory
    assert ckpt.backward_working == plain.backward_working + T * 4 * (8 * 10 + 2 * 5 + 4 * 20)
    assert ckpt.parameters == plain.parameters and ckpt.logits == plain.logits


def test_fl_sync_state():
    fedavg = trainer_memory(SHAPE, S=2, F=2, tokens=T, options=FP32)
    assert fedavg.sync == 4 * 1100 / 2  # the flat bucket: 64 MiB, capped at the rank's shards
    assert fedavg.sync_temp == 0 and fedavg.phases["shard sync"] == fedavg.parameters + fedavg.optimizer + fedavg.sync
    small_bucket = StepOptions(precision="fp32", bucket_mb=400 / 2**20)
    assert trainer_memory(SHAPE, S=2, F=2, tokens=T, options=small_bucket).sync == 400
    # a bf16 wire keeps the fp32 global shards (+4 bytes/param/S) and a bf16 wire buffer of the bucket
    bf16_wire = trainer_memory(SHAPE, S=2, F=2, tokens=T, options=StepOptions(precision="fp32",
                                                                              sync_dtype="bfloat16"))
    assert bf16_wire.sync == fedavg.sync + 2 * 1100 / 2 + 4 * 1100 / 2
    # Nesterov: the global shards and the momentum (+8 bytes/param/S), and its temporaries during the sync
    nesterov = trainer_memory(SHAPE, S=2, F=2, tokens=T, options=StepOptions(precision="fp32", outer="nesterov"))
    assert nesterov.sync == fedavg.sync + 8 * 1100 / 2
    assert nesterov.sync_temp == 4 * fedavg.sync
    assert nesterov.total > fedavg.total
    fedadam = trainer_memory(SHAPE, S=2, F=2, tokens=T, options=StepOptions(outer="fedadam"))
    assert fedadam.sync == fedavg.sync + (4 + 8) * 1100 / 2
    trimmed = trainer_memory(SHAPE, S=2, F=3, tokens=T, options=StepOptions(outer="trimmed-mean"))
    assert trimmed.sync == fedavg.sync and trimmed.sync_temp == 3 * 5 * fedavg.sync
    median = trainer_memory(SHAPE, S=2, F=3, tokens=T, options=StepOptions(outer="median"))
    assert median.sync == trimmed.sync and median.sync_temp == trimmed.sync_temp  # the same gather and sort
    with pytest.raises(ConfigError, match="linear"):
        trainer_memory(SHAPE, S=2, F=2, tokens=T, options=StepOptions(outer="trimmed-mean", sync_dtype="bfloat16"))
    assert trainer_memory(SHAPE, S=2, F=1, tokens=T, options=StepOptions(outer="nesterov")).sync == 0  # no sync
    # top-k: the global shards, the residual, |delta| of the bucket, this rank's row and the F gathered rows
    from flwr_sharded.parallel.sparse import RowLayout
    from flwr_sharded.parallel.wire import WIRES

    topk = StepOptions(precision="fp32", sync_dtype="int8", sync_topk=0.1, sync_error_feedback=True)
    row = RowLayout(550, 0.1, WIRES["int8"]).bytes
    assert trainer_memory(SHAPE, S=2, F=3, tokens=T, options=topk).sync == fedavg.sync + (4 + 4 + 4) * 550 + 4 * row


def test_rule_state_comes_from_the_rules():
    assert rule_state_bytes("fedavg") == rule_state_bytes("trimmed-mean") == rule_state_bytes("median") == 0
    assert rule_state_bytes("nesterov") == rule_state_bytes("fedavgm") == 4
    assert rule_state_bytes("fedadam") == rule_state_bytes("fedyogi") == 8  # m and v; the step count is a scalar
    from flwr_sharded.parallel.rules import RULES

    for name, cls in RULES.items():  # declared (torch-free) == measured from the rule's init_state (its import path)
        assert rule_state_bytes(name) == rule_state_bytes(f"{cls.__module__}:{cls.__name__}"), name


def test_other_options():
    base = trainer_memory(SHAPE, S=2, tokens=T)
    proximal = trainer_memory(SHAPE, S=2, tokens=T, options=StepOptions(proximal=True))
    assert proximal.anchor == 4 * 1100 / 2 and proximal.total == base.total + proximal.anchor
    sgd = trainer_memory(SHAPE, S=2, tokens=T, options=StepOptions(optimizer="sgd"))
    assert sgd.optimizer == 0 and sgd.total < base.total
    cpu = trainer_memory(SHAPE, S=2, tokens=T, options=StepOptions(device="cpu"))
    assert cpu.optimizer_temp == 2 * 4 * max(50 * 10, 10 * 20) / 2  # one parameter at a time: the embedding's size
    # grad-accum: each micro-batch is reduce-scattered into the sharded gradients: nothing more than one micro-batch
    accum = trainer_memory(SHAPE, S=2, tokens=T, options=StepOptions(grad_accum=2))
    assert accum.phases == base.phases and accum.total == base.total
    # without reshard-after-forward every block stays gathered until its backward
    kept = trainer_memory(SHAPE, S=2, tokens=T, options=StepOptions(reshard_after_forward=False))
    assert kept.gathered_params == 2 * (100 + 2 * 500) and base.gathered_params == 2 * (100 + 2 * 500)
    four = ModelShape(num_params=2100, num_layers=4, root_params=100, hidden_size=10, intermediate_size=20,
                      vocab_size=50)
    assert trainer_memory(four, S=2, tokens=T, options=StepOptions(reshard_after_forward=False)).gathered_params \
        == 2 * (100 + 4 * 500) > trainer_memory(four, S=2, tokens=T).gathered_params
    # an overlapped sync's snapshot (a carrying one: and its copy) of the largest fragment, error-feedback residuals
    fl = trainer_memory(SHAPE, S=2, F=2, tokens=T)
    fragment = 500 + 100  # one of the two blocks and everything outside them, at most
    overlapped = trainer_memory(SHAPE, S=2, F=2, tokens=T, options=StepOptions(sync_fragments=2, sync_delay=1,
                                                                                sync_carry=False, sync_max_move=0))
    assert overlapped.sync - fl.sync == 4 * fragment / 2
    checked = trainer_memory(SHAPE, S=2, F=2, tokens=T, options=StepOptions(sync_fragments=2, sync_delay=1,
                                                                             sync_carry=False))
    assert checked.sync - fl.sync == 2 * 4 * fragment / 2  # the plausibility check reads the copy at the start
    carrying = trainer_memory(SHAPE, S=2, F=2, tokens=T, options=StepOptions(sync_fragments=2, sync_delay=1))
    assert carrying.sync - fl.sync == 2 * 4 * fragment / 2  # carry is the default with an overlapped sync
    int8 = StepOptions(sync_dtype="int8")
    feedback = trainer_memory(SHAPE, S=2, F=2, tokens=T, options=replace(int8, sync_error_feedback=True))
    assert feedback.sync - trainer_memory(SHAPE, S=2, F=2, tokens=T, options=int8).sync == 4 * 1100 / 2
    rollback = trainer_memory(SHAPE, S=2, F=2, tokens=T, options=StepOptions(rollback=True, outer="nesterov"))
    # on the host: the shards, their AdamW moments, the global shards and the outer momentum
    assert rollback.host == (4 + 8 + 4 + 4) * 1100 / 2
    assert rollback.total == trainer_memory(SHAPE, S=2, F=2, tokens=T, options=StepOptions(outer="nesterov")).total


def test_memory_per_gpu_is_the_planners_view():
    m = memory_per_gpu(SHAPE, S=2, tokens=2 * T, bytes_per_param=4, options=StepOptions(grad_accum=2))
    assert m == trainer_memory(SHAPE, S=2, tokens=T, options=StepOptions(precision="fp32", grad_accum=2))
    override = memory_per_gpu(SHAPE, S=2, tokens=T, state_bytes_per_param=32)
    assert override.parameters + override.gradients + override.optimizer == pytest.approx(32 * 1100 / 2)
    assert override.parameters == pytest.approx(2 * memory_per_gpu(SHAPE, S=2, tokens=T).parameters)
    with pytest.raises(ConfigError, match="bytes-per-param"):
        memory_per_gpu(SHAPE, S=2, tokens=T, bytes_per_param=1)
    with pytest.raises(ConfigError, match="micro-batches"):
        memory_per_gpu(SHAPE, S=2, tokens=T, options=StepOptions(grad_accum=2))


def test_options_from_a_train_config():
    cfg = TrainConfig()
    cfg.parallel.outer, cfg.parallel.sync_dtype, cfg.grad_accum = "nesterov", "bfloat16", 4
    cfg.model.activation_checkpointing, cfg.optim.proximal_mu = True, 0.01
    o = StepOptions.from_config(cfg, "cpu")
    assert (o.precision, o.outer, o.sync_dtype, o.grad_accum, o.activation_checkpointing, o.proximal, o.device) == \
        ("fp32", "nesterov", "bfloat16", 4, True, True, "cpu")  # precision auto: fp32 on CPU
    assert StepOptions.from_config(cfg, "cuda").precision == "bf16"
    with pytest.raises(ConfigError, match="precision"):
        StepOptions(precision="fp16")
    with pytest.raises(ConfigError, match="grad_accum"):
        StepOptions(grad_accum=0)


def test_one_declaration_per_fact():
    # the planner's bytes per parameter follow the declarations: change one and the estimate follows
    assert mm.MASTER_BYTES + mm.GRAD_BYTES + mm.OPTIMIZER_STATE_BYTES["adamw"] == 16
    m = trainer_memory(SHAPE, S=1, tokens=T)
    assert states(m) == 16 * 1100
