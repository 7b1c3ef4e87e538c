"""Models that are wrong for some layout, for the bad-configuration cases of tests/unit/test_errors.py."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from examples.lit import CausalLM
from tests.models import build


class Mixer(nn.Module):
    """A block whose linear layers have names no auto-detection knows."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.alpha = nn.Linear(hidden, inner)
        self.beta = nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.beta(torch.relu(self.alpha(x)))


class ReversedMixer(Mixer):
    """The same block, its layers registered out-of-order (``beta`` first): what its structure shows does not
    say which layer fans out first, so no plan is inferred."""

    def __init__(self, hidden: int, inner: int) -> None:
        nn.Module.__init__(self)
        self.beta = nn.Linear(inner, hidden)
        self.alpha = nn.Linear(hidden, inner)


class MixerNet(nn.Module):
    def __init__(self, hidden: int = 16, inner: int = 32, block: type[Mixer] = Mixer) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block(hidden, inner) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def moe(experts: int, bias: bool = False) -> nn.Module:
    from examples.models.llama import Llama, LlamaConfig

    model = Llama(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=2, num_experts=experts))
    for layer in model.layers if bias else ():  # experts as some models have them: with biases
        layer.mlp.experts.gate_up_proj_bias = nn.Parameter(torch.zeros(experts, 32))
    return model


class LearnedPositions(nn.Module):
    """Positions from its own input's length (a learned table sliced ``[:seq]``), no `position_ids` argument."""

    def __init__(self, vocab: int = 64, hidden: int = 16) -> None:
        super().__init__()
        self.tok, self.pos_emb = nn.Embedding(vocab, hidden), nn.Embedding(32, hidden)
        self.blocks = nn.ModuleList(Mixer(hidden, 2 * hidden) for _ in range(2))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos_emb.weight[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class NormedMixer(Mixer):
    def __init__(self, hidden: int, inner: int, norm: type[nn.Module] = nn.BatchNorm1d) -> None:
        super().__init__(hidden, inner)
        self.norm = norm(hidden)


def batch_norm_net(norm: type[nn.Module] = nn.BatchNorm1d) -> nn.Module:
    net = MixerNet()
    net.blocks = nn.ModuleList(NormedMixer(16, 32, norm) for _ in range(2))
    return net


def torch_transformer() -> nn.Module:
    from lightning.pytorch.demos import Transformer

    return Transformer(vocab_size=64, ninp=16, nhead=2, nhid=16, nlayers=2, dropout=0.0)


def falcon_alibi() -> nn.Module:
    from transformers import FalconConfig, FalconForCausalLM

    return FalconForCausalLM(FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          alibi=True, attn_implementation="sdpa"))


def hf_mixtral_router_logits() -> nn.Module:
    model = build("hf_mixtral")
    model.config.output_router_logits = True
    return CausalLM(model=model)


def hf_llama(**config: object) -> nn.Module:
    model = build("hf_llama")
    for key, value in config.items():
        setattr(model.config, "_attn_implementation" if key == "attn_implementation" else key, value)
    return model


def shared_blocks() -> nn.Module:
    """A GPT whose two blocks share a weight (its tied embeddings are fine under pp; this tie is not)."""
    model = build("gpt")
    model.blocks[1].fc1.weight = model.blocks[0].fc1.weight
    return model


def tied_norms() -> nn.Module:
    """A GPT whose blocks use one norm's parameters twice (a tie inside every block, so inside one stage)."""
    model = build("gpt4")
    for block in model.blocks:
        block.ln_2.weight = block.ln_1.weight
    return model


def two_models() -> CausalLM:
    module = CausalLM(model=build("llama"))
    module.extra = nn.Linear(2, 2)
    return module


MIXER_PLAN = {"model.blocks.*.alpha": "colwise", "model.blocks.*.beta": "rowwise"}


def lightning_module(factory: Callable[..., nn.Module], *args: object, **kwargs: object) -> Callable[[], CausalLM]:
    """A zero-argument factory of the LightningModule a case connects, importable as MODULE:FACTORY by the dry
    run (``--model tests.unit.bad_models:eager_llama``)."""
    return lambda: CausalLM(model=factory(*args, **kwargs))


llama = lightning_module(build, "llama")
gpt = lightning_module(build, "gpt")
eager_llama = lightning_module(hf_llama, attn_implementation="eager")
windowed_llama = lightning_module(hf_llama, sliding_window=8)
attention_dropout_llama = lightning_module(hf_llama, attention_dropout=0.1)
learned_positions = lightning_module(LearnedPositions)
transformer = lightning_module(torch_transformer)
alibi_falcon = lightning_module(falcon_alibi)
batch_norm = lightning_module(batch_norm_net)
sync_batch_norm = lightning_module(batch_norm_net, nn.SyncBatchNorm)
router_logits_mixtral = lightning_module(hf_mixtral_router_logits)
six_experts = lightning_module(moe, 6)
biased_experts = lightning_module(moe, 8, bias=True)
mixer = lightning_module(MixerNet)
reversed_mixer = lightning_module(MixerNet, block=ReversedMixer)
narrow_mixer = lightning_module(MixerNet, 16, 12)
blocks_sharing_a_weight = lightning_module(shared_blocks)
norms_tied_in_a_block = lightning_module(tied_norms)


class ScaleNorm(nn.Module):
    """A norm whose parameter is drawn in its constructor, with no `reset_parameters()` and no init entry point: a
    meta-device build cannot draw it again (a constant, `torch.ones(dim)`, would be filled again)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(dim).uniform_(0.5, 1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x / x.norm(dim=-1, keepdim=True)


def _scale_normed_llama() -> nn.Module:
    model = build("llama")
    model.norm = ScaleNorm(64)
    return model


def scale_norm_in_configure_model() -> CausalLM:
    return CausalLM(model_factory=_scale_normed_llama)


class InitAfterConstruction(CausalLM):
    """Builds the example GPT in `configure_model`, then initialises its embedding there: nothing the model's
    construction calls could give those values again."""

    def configure_model(self) -> None:
        super().configure_model()
        nn.init.normal_(self.model.tok.weight, std=0.02)


def init_after_construction() -> CausalLM:
    return InitAfterConstruction(model_factory=lambda: build("gpt"))
