"""Every model type of the installed `transformers` that declares a tp plan, at tp=2, in one process.

For each: a tiny random config, the model built under `FakeTensorMode`, `plan_layout` at tp=2, the plan applied
on torch's `fake` process group (world size 2, this process rank 0), one forward and backward. Or the plan is
refused with a `TPPlanRefusal` naming the styles it does not apply. A family whose tiny model does not run under
fake tensors even without tp (vision inputs, data-dependent shapes) is recorded as such, not as a crash.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import warnings

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_nd import ParallelConfig, ParallelDims, plan_layout
from lightning_nd.layout.hf_styles import TPPlanRefusal
from lightning_nd.parallel.tensor import apply_tp

transformers = pytest.importorskip("transformers")
from transformers.models.auto import modeling_auto  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402

TINY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "max_position_embeddings": 64,
        "moe_intermediate_size": 32, "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "shared_expert_intermediate_size": 32, "n_layer": 2, "n_embd": 64, "n_head": 4,
        "n_positions": 64, "rotary_dim": 8, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
        "attention_dropout": 0.0, "hidden_dropout": 0.0}
VOCAB, BATCH, SEQ = 128, 2, 8
DATA_DEPENDENT = ("DataDependentOutputException", "data-dependent", "_local_scalar_dense", "nonzero", "Dynamic")


def declaring_families() -> list[str]:
    return [model_type for model_type in CONFIG_MAPPING.keys()
            if getattr(CONFIG_MAPPING[model_type], "base_model_tp_plan", None)]


FAMILIES = declaring_families()


def tiny_model(model_type: str) -> torch.nn.Module:
    """The family's causal LM (else its base model) from a small config, on fake tensors (callers' mode)."""
    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class()
    config = config_class(**{key: value for key, value in TINY.items() if hasattr(defaults, key)})
    # Nested configs (vision, audio, and a text model the top config does not forward to) keep their full default
    # size otherwise: muse_glimmer's text model had 52 layers of width 6656, 23 s of fake-tensor forward and backward.
    for sub in vars(config).values():
        if isinstance(sub, transformers.PretrainedConfig):
            for key, value in TINY.items():
                if hasattr(sub, key):
                    setattr(sub, key, value)
    config.dtype, config.use_cache = torch.float32, False
    config._experts_implementation = "eager"  # grouped_mm has no float32 kernel on fake tensors
    for names in (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, modeling_auto.MODEL_MAPPING_NAMES):
        if model_type in names:
            module = importlib.import_module(config_class.__module__.replace(".configuration_", ".modeling_"))
            model_class = getattr(module, names[model_type], None)
            if model_class is not None:
                return model_class(config)
    return _model_of_config(config_class)(config)


def _model_of_config(config_class: type) -> type:
    """A sub-model's class (``Qwen3OmniMoeTalkerTextConfig``): the family's model classes that take this config."""
    module = importlib.import_module(config_class.__module__.replace(".configuration_", ".modeling_"))
    classes = [value for value in vars(module).values() if isinstance(value, type)
               and issubclass(value, transformers.PreTrainedModel) and getattr(value, "config_class", None) is config_class]
    classes = [cls for cls in classes if "PreTrained" not in cls.__name__]
    classes.sort(key=lambda cls: (not cls.__name__.endswith("ForCausalLM"), not cls.__name__.endswith("Model")))
    if not classes:
        raise LookupError(f"no model class of {config_class.__name__}")
    return classes[0]


def forward_backward(model: torch.nn.Module) -> None:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    output = model(input_ids=ids, use_cache=False)
    output[0].float().sum().backward()


@pytest.fixture(scope="module")
def tp_mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        yield
        logging.disable(logging.NOTSET)


def run_family(model_type: str, tp_mesh) -> tuple[str, str]:
    """``("planned", "")``, ``("refused", styles)`` or ``("not runnable", why)``; a crash of ours raises.

    On fake tensors first; a family whose forward needs real values (MoE routing reads how many tokens each
    expert got; under tp, a module with dropout draws a seed per tp rank) runs again on real tensors of its tiny
    model (the fake group's collectives move no data, so only shapes and the absence of errors are checked, as on
    fake tensors)."""
    outcome, detail = _run(model_type, tp_mesh, FakeTensorMode(allow_non_fake_inputs=True))
    if outcome == "not runnable" and any(words in detail for words in DATA_DEPENDENT):
        outcome, detail = _run(model_type, tp_mesh, contextlib.nullcontext())
    return outcome, detail


def _run(model_type: str, tp_mesh, mode) -> tuple[str, str]:
    with mode:
        try:
            model = tiny_model(model_type)
        except Exception as error:  # noqa: BLE001  (the family's own config checks)
            return "not runnable", f"{type(error).__name__}: {str(error).splitlines()[0][:90]}"
        try:
            layout = plan_layout(model, ParallelDims(tp=2, world_size=2), ParallelConfig())
        except TPPlanRefusal as refusal:
            return "refused", ", ".join(sorted(refusal.pieces))
        except ValueError as error:  # a planning check: it names the module and gives a HINT
            assert "HINT" in str(error) and "`" in str(error), error
            return "refused", str(error).split(" HINT")[0][:160]
        try:
            forward_backward(tiny_model(model_type))
        except Exception as error:  # noqa: BLE001  (the family itself, without tp)
            return "not runnable", f"{type(error).__name__}: {str(error).splitlines()[0][:90]}"
        apply_tp(model, tp_mesh, {entry.module: entry.style for entry in layout.tp}, sequence_parallel=False,
                 loss_parallel=False, block_names=list(layout.blocks))
        try:
            forward_backward(model)
        except DataDependentOutputException as error:  # a value read under tp (a dropout seed per tp rank)
            return "not runnable", f"{type(error).__name__}: {error}"
    return "planned", ""


@pytest.mark.parametrize("model_type", FAMILIES)
def test_family_plans_at_tp2_or_is_refused_by_name(model_type, tp_mesh, record_property):
    outcome, detail = run_family(model_type, tp_mesh)
    record_property("outcome", f"{outcome}: {detail}")
    if outcome == "refused":
        assert detail and "catch" not in detail


def test_most_families_plan():
    assert len(FAMILIES) > 100  # the enumeration found the families (164 in transformers 5.24)
