"""A model's pipeline units come in the order its forward calls them (one forward on the meta device), not the order
they are registered, and what a stage cannot receive from the stage before it is refused by name at planning. The
parity of LitGPT models under pp is in tests/distributed/test_families.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_nd.model.structure import find_blocks
from lightning_nd.pipeline_parallel.split import split_stages
from lightning_nd.pipeline_parallel.stage import StageModule, pack_inputs

WIDTH, VOCAB, LENGTH = 16, 32, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.mix(x * rotation))


class HeadFirst(nn.Module):
    """Registers its head and final norm before its blocks and embedding; computes one extra block argument from a
    buffer, once, and hands it to every block (as LitGPT's rope ``cos``/``sin``)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(WIDTH, VOCAB)
        self.norm = nn.LayerNorm(WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.register_buffer("table", torch.linspace(0.5, 1.5, 64 * WIDTH).view(64, WIDTH), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rotation = self.table[: tokens.shape[1]].unsqueeze(0)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, rotation)
        return self.head(self.norm(x))


def test_a_hand_written_model_is_split_in_its_forward_order_and_its_stages_compute_the_whole_model():
    torch.manual_seed(0)
    model = HeadFirst()
    rng = torch.get_rng_state()
    layout = split_stages(model, find_blocks(model), 4)
    assert [unit for stage in layout.stages for unit in stage] == [
        "embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm", "head"]
    assert "the order the model's forward calls its units" in layout.source
    assert torch.equal(torch.get_rng_state(), rng) and next(model.parameters()).device.type == "cpu"
    assert not any(module._forward_hooks or module._forward_pre_hooks for module in model.modules())
    tokens = torch.randint(0, VOCAB, (2, LENGTH))
    expected = model(tokens)
    stages = [StageModule(model, layout, index) for index in range(4)]
    carried: list[torch.Tensor] = []
    for stage in stages:
        stage.attach()
        carried = [stage(*carried, **pack_inputs(tokens))]
    torch.testing.assert_close(carried[0], expected, rtol=0, atol=0)


LITGPT_SHRINK = {"n_layer": 4, "n_embd": 48, "n_head": 4, "n_query_groups": 1, "head_size": 12, "vocab_size": 64,
                 "padded_vocab_size": 64, "block_size": 64, "intermediate_size": 96}


def _litgpt(name: str, **fields: int) -> nn.Module:
    config = pytest.importorskip("litgpt.config")
    model_module = pytest.importorskip("litgpt.model")
    with torch.device("meta"):
        return model_module.GPT(config.Config.from_name(name, **{**LITGPT_SHRINK, **fields}))


def test_litgpt_units_come_in_forward_order():
    model = _litgpt("Llama-3.2-1B")
    assert next(iter(model.named_children()))[0] == "lm_head"  # registered first
    layout = split_stages(model, find_blocks(model), 2)
    assert [unit for stage in layout.stages for unit in stage] == [
        "transformer.wte", *(f"transformer.h.{index}" for index in range(4)), "transformer.ln_f", "lm_head"]


def test_litgpt_gemma3_rope_picked_by_block_position_is_refused():
    """Gemma 3 picks each block's rope (local or global) by ``enumerate(self.transformer.h)``: a later stage would
    hand its blocks the first blocks' rope. Six blocks: its first five take the local rope, the sixth the global."""
    model = _litgpt("Gemma-3-1b-it", n_layer=6)
    with pytest.raises(ValueError, match=r"hands `transformer.h.5` its positional argument 1 that changes when the"
                                         r" blocks before `transformer.h.1` are not there.*HINT"):
        split_stages(model, find_blocks(model), 2)


class _Variant(HeadFirst):
    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        self.gate = nn.Embedding(VOCAB, WIDTH)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rotation = self.table[: tokens.shape[1]].unsqueeze(0)
        x = embedded = self.embed(tokens)
        if self.variant == "weight_argument":
            rotation = self.gate(tokens)
        elif self.variant == "twice":
            x = self.norm(x)
        order = list(self.blocks)[::-1] if self.variant == "reversed" else self.blocks
        for index, block in enumerate(order):
            x = block(x, self.table[index: index + tokens.shape[1]] if self.variant == "by_position" else rotation)
            if self.variant == "between":
                x = x * 2
        if self.variant == "skip":
            x = x + embedded
        return self.head(self.norm(x))


@pytest.mark.parametrize("variant, refusal", [
    ("weight_argument", r"calls `blocks.1` with its positional argument 1 computed from the weight `gate.weight`.*HINT"),
    ("between", r"does not call `blocks.1` on what `blocks.0` returned.*HINT: move what happens between the blocks"),
    ("skip", r"reads the weight `embed.weight` other than through the last block's output.*HINT"),
    ("twice", r"calls `norm` both before and after its blocks.*HINT"),
    ("reversed", r"calls its blocks as `blocks.3`, `blocks.2`.*not once each in the order they are registered.*HINT"),
    ("by_position", (r"hands `blocks.1` its positional argument 1 that changes when the blocks before `blocks.1` are"
                     r" not there.*by the block's position.*HINT: read it inside each block")),
])
def test_what_a_stage_cannot_receive_is_refused_by_name(variant, refusal):
    model = _Variant(variant)
    with pytest.raises(ValueError, match=refusal):
        split_stages(model, find_blocks(model), 2)


class _NeedsValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, : int(tokens.max()) + 1])  # reads a value: the meta device has none
        for block in self.blocks:
            x = block(x, torch.ones(()))
        return self.head(x)


def test_a_forward_that_needs_values_is_split_in_registration_order_saying_why():
    model = _NeedsValues()
    layout = split_stages(model, find_blocks(model), 2)
    assert layout.pre == ("embed",) and layout.post == ("head",)
    assert "registration order (the forward did not run on the meta device: RuntimeError" in layout.source
