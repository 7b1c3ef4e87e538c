"""Materialising a model built on the meta device gives the model plain construction gives (one process, no process
group): ties stay one tensor, a shared tensor takes its creator's init, the constructor's own init entry points run
again (``self.apply(self._init_weights)``, torchtitan's ``init_weights()``, transformers' ``post_init()``), a method
the constructor never calls does not, and an init nothing can replay is refused, naming the tensor and the line."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from examples.models.gpt import GPT, GPTConfig
from lightning_nd.runtime.init_record import InitRecorder
from lightning_nd.runtime.materialize import materialize
from lightning_nd.runtime.model_init import ModelInit
from lightning_nd.runtime.probe import check_initialisable, model_to_check
from tests.distributed.meta_starts_ranks import OwnInitGPT, conf_model, describe
from tests.unit.bad_models import init_after_construction, scale_norm_in_configure_model

CONFIG = GPTConfig(**conf_model("gpt"))


class Holder(nn.Module):
    """What `configure_model` builds into (the LightningModule's place)."""


def on_meta(build) -> tuple[Holder, ModelInit]:
    """``build()`` on the meta device as `NDParallel` runs `configure_model`: recorded, then resolved."""
    holder, recorder = Holder(), InitRecorder()
    with recorder, torch.device("meta"):
        holder.model = build()
    return holder, recorder.resolve(holder)


def materialized(build) -> nn.Module:
    holder, init = on_meta(build)
    materialize(holder, torch.device("cpu"), seed=0, init=init)
    return holder.model


def assert_like_plain(model: nn.Module, build) -> None:
    """The same tensors and ties; each tensor of 1,000 elements or more within 10% of plain construction's standard
    deviation, the smaller ones the same kind of init (zero, constant, random); equal buffers."""
    torch.manual_seed(0)
    plain = build()
    assert [n for n, _ in model.named_parameters(remove_duplicate=False)] == \
           [n for n, _ in plain.named_parameters(remove_duplicate=False)]
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in plain.parameters())
    got = dict(model.named_parameters())
    for name, param in plain.named_parameters():
        (numel, std, kind, _), (_, got_std, got_kind, _) = describe(param), describe(got[name])
        if numel >= 1000:
            assert math.isclose(got_std, std, rel_tol=0.1, abs_tol=1e-9), (name, got_std, std)
        else:
            assert got_kind == kind, (name, got_kind, kind)
    for (name, got_buffer), (_, expected) in zip(model.named_buffers(), plain.named_buffers()):
        torch.testing.assert_close(got_buffer, expected, msg=lambda m: f"buffer {name}: {m}")


def test_a_tie_made_on_meta_is_one_parameter_after_materialising():
    model = materialized(lambda: GPT(CONFIG))
    assert model.out.weight is model.tok.weight
    assert sum(p.numel() for p in model.parameters()) == 220_288  # conf/model/gpt.yaml's GPT, as plain construction
    assert model.tok.weight.std().item() == pytest.approx(1.0, rel=0.1)  # the embedding's init, not a Linear's


class NanoStyle(nn.Module):
    """nanoGPT ties the other way round: the embedding takes the head's weight (the head created it)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(256, 64)
        self.lm_head = nn.Linear(64, 256, bias=False)
        self.wte.weight = self.lm_head.weight


def test_a_shared_tensor_takes_the_init_of_the_module_that_created_it():
    model = materialized(NanoStyle)
    assert model.wte.weight is model.lm_head.weight
    assert_like_plain(model, NanoStyle)  # the head's init (std 1/sqrt(3 * 64)), not the embedding's N(0, 1)


def test_the_constructors_own_init_runs_again():
    model = materialized(lambda: OwnInitGPT(CONFIG))
    assert model.out.weight is model.tok.weight and model.blocks[0].ln_2.weight is model.blocks[0].ln_1.weight
    assert model.blocks[0].fc1.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert not model.blocks[0].fc1.bias.any()
    assert_like_plain(model, lambda: OwnInitGPT(CONFIG))


class NeverCalled(GPT):
    """Defines an init the constructor never calls (as LitGPT's `GPT._init_weights`): it is not run."""

    def _init_weights(self, module: nn.Module) -> None:
        raise AssertionError("materialising ran an init the constructor never called")


def test_an_init_the_constructor_never_calls_is_not_run():
    assert_like_plain(materialized(lambda: NeverCalled(CONFIG)), lambda: NeverCalled(CONFIG))


class Rotary(nn.Module):
    """torchtitan's shape: buffers and weights initialised by ``init_weights(buffer_device)``, which the constructor
    calls and which initialises its children too."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.register_buffer("freqs", torch.empty(16), persistent=False)
        self.init_weights()

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        with torch.device(buffer_device or self.freqs.device):
            self.freqs = 1.0 / 10_000 ** (torch.arange(16, dtype=torch.float32) / 16)
        nn.init.trunc_normal_(self.proj.weight, std=0.5)
        nn.init.ones_(self.proj.bias)


def test_an_init_weights_entry_point_initialises_buffers_and_children():
    model = materialized(Rotary)
    assert_like_plain(model, Rotary)
    assert bool((model.proj.bias == 1).all())


class DataAlias(nn.Module):
    """Initialises through ``.data``, as older Hugging Face models did."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=0.5)
            module.bias.data.zero_()


def test_an_init_through_the_data_alias_runs_again():
    assert_like_plain(materialized(DataAlias), DataAlias)


def test_a_hugging_face_model_is_initialised_by_its_post_init():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True)
    holder, init = on_meta(lambda: LlamaForCausalLM(config))
    assert [call.method for call in init.calls] == ["post_init", "post_init"]  # the base model's, then the head's
    materialize(holder, torch.device("cpu"), seed=0, init=init)
    assert holder.model.lm_head.weight is holder.model.model.embed_tokens.weight
    assert_like_plain(holder.model, lambda: LlamaForCausalLM(config))  # norms at 1, inv_freq as computed


def test_an_init_after_construction_is_refused_naming_the_tensor_and_the_line():
    def build():
        model = GPT(CONFIG)
        nn.init.normal_(model.tok.weight, std=0.02)
        return model

    holder, init = on_meta(build)
    with pytest.raises(ValueError, match=r"`model.tok.weight` \(test_materialize.py:\d+ in `build`\)") as raised:
        check_initialisable(holder, init)
    assert "HINT" in str(raised.value) and "init_weights()" in str(raised.value)


def test_a_parameter_swapped_in_after_construction_is_refused():
    def build():
        model = GPT(CONFIG)
        model.pos.weight = nn.Parameter(torch.randn(64, 64) * 0.01)
        return model

    holder, init = on_meta(build)
    assert [lost.tensor for lost in init.lost] == ["model.pos.weight"]


class NewParameter(nn.Module):
    """Its init makes a new parameter: after sharding that would leave FSDP and TP holding the old one."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.init_weights()

    def init_weights(self) -> None:
        self.fc.bias = nn.Parameter(torch.zeros(8))


def test_an_entry_point_that_replaces_a_parameter_is_refused():
    with pytest.raises(ValueError, match=r"replaces `model.fc.bias` with a new parameter.*HINT: initialise it in place"):
        on_meta(NewParameter)


class ReadsValues(nn.Module):
    """Skips its init on the meta device (as transformers' does), and reads values in it: it cannot run again on
    a model that is still on meta, so nothing can tell what it initialises."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.init_weights()

    def init_weights(self) -> None:
        if torch.get_default_device().type != "meta":
            nn.init.constant_(self.fc.bias, float(self.fc.weight.abs().max().item()))


def test_an_entry_point_that_cannot_run_on_meta_is_refused():
    with pytest.raises(ValueError, match=r"`model.init_weights\(\)`.*fails there.*HINT"):
        on_meta(ReadsValues)


def test_the_probe_refuses_before_any_process_group_and_not_off_meta():
    with pytest.raises(ValueError, match="`model.tok.weight`"):
        model_to_check(init_after_construction())
    with pytest.raises(ValueError, match="ScaleNorm"):
        model_to_check(scale_norm_in_configure_model())
    assert model_to_check(scale_norm_in_configure_model(), on_meta=False) is not None
    assert not torch.distributed.is_initialized()
