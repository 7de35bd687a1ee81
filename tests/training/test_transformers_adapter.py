"""The adapter finds every transformers internal it wraps on the installed release, and names the release and the
API when one is missing (fast tier: no processes)."""

from __future__ import annotations

import inspect

import pytest
import transformers
from transformers import PreTrainedModel

from flwr_sharded.training import transformers_adapter as adapter


def test_every_wrapped_internal_is_found_on_the_installed_transformers():
    from flwr_sharded.training.hf_conversion import OPERATIONS
    from flwr_sharded.training.model_init import _RECORDED

    adapter.check_available()
    assert set(adapter.OPERATION_FIELDS) == set(OPERATIONS)  # every operation the plan reads, its fields looked up
    assert set(_RECORDED) <= set(adapter.INIT_FUNCTIONS)
    for name, (_, parse) in _RECORDED.items():  # the recorder reads each call's arguments as transformers names them
        wrapped = adapter.internal("initialization", name)
        assert list(inspect.signature(wrapped).parameters)[1:] == list(inspect.signature(parse).parameters), name


def test_the_wrapped_calls_work_on_a_model():
    from flwr_sharded.training.models import build_meta_model

    model = build_meta_model(transformers.AutoConfig.for_model(
        "mixtral", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4))
    mapping = adapter.LoadMapping(model)
    name, pattern = mapping.rename("model.layers.0.block_sparse_moe.experts.3.w1.weight",
                                   {"model.layers.0.mlp.experts.gate_up_proj": ()})
    assert name == "model.layers.0.mlp.experts.gate_up_proj"
    assert [op.kind for op in mapping.converters[pattern].operations] == ["MergeModulelist", "Concatenate"]
    assert sorted(["a.10", "a.9"], key=adapter.checkpoint_key_order) == ["a.9", "a.10"]
    assert adapter.block_class_names(model) == {"MixtralDecoderLayer"}
    assert r"rotary_emb\.inv_freq$" in adapter.ignored_key_patterns(model)


@pytest.mark.parametrize("module, name", [("core_model_loading", "rename_source_key"),
                                          ("conversion_mapping", "get_model_conversion_mapping"),
                                          ("initialization", "trunc_normal_")])
def test_a_missing_internal_is_an_error_naming_the_release_and_the_api(module, name, monkeypatch):
    import importlib

    monkeypatch.delattr(importlib.import_module(f"transformers.{module}"), name)
    with pytest.raises(adapter.TransformersAPIError, match=rf"transformers {transformers.__version__} lacks "
                                                           rf"transformers\.{module}\.{name} "):
        adapter.check_available()


def test_a_missing_model_attribute_or_operation_field_is_named(monkeypatch):
    from transformers.core_model_loading import Transpose

    from flwr_sharded.training.models import transformer_blocks

    monkeypatch.delattr(PreTrainedModel, "_no_split_modules")
    with pytest.raises(adapter.TransformersAPIError, match=r"lacks PreTrainedModel\._no_split_modules"):
        transformer_blocks(PreTrainedModel.__new__(PreTrainedModel))
    monkeypatch.undo()
    op = Transpose()
    del op.check_dims
    with pytest.raises(adapter.TransformersAPIError, match=r"lacks transformers\.core_model_loading\.Transpose"
                                                           r"\.check_dims"):
        adapter._operation(op)
