"""The MoE routing knobs reach the layers from the Hydra config (conf/model/moe.yaml composed as the
main job composes it, with command-line overrides -> LlamaConfig -> MoE), and
the loss-free bias moves after every optimizer step under NDParallel. The fit runs in a process of its own (one
rank, tests/launcher.py); the update's own arithmetic is in tests/unit/test_moe.py."""

from __future__ import annotations

import torch

from tests.launcher import launch

RATE = 0.1


def fit_with_knobs() -> dict[str, object]:
    """One rank: a 3-step fit of the example's MoE Llama configured as the test's overrides say."""
    from lightning.pytorch import Trainer

    from examples.data import TokenDataModule
    from examples.lit import CausalLM
    from examples.schema import compose
    from examples.train import model_factory
    from lightning_nd import NDParallel
    from lightning_nd.nn.moe import moe_layers

    knobs = {"moe_aux_loss_coef": 0.03, "moe_capacity_factor": 1.5, "moe_random_routing_steps": 1,
             "moe_bias_update_rate": RATE, "num_hidden_layers": 1}
    cfg = compose(["model=moe", *(f"model.{k}={v}" for k, v in knobs.items())]).model
    module = CausalLM(model_factory=model_factory(cfg), lr=1e-3)
    trainer = Trainer(strategy=NDParallel(), accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, max_steps=3, limit_val_batches=0)
    trainer.fit(module, datamodule=TokenDataModule(vocab_size=cfg.vocab_size, seq_len=16, num_samples=12, batch_size=4))
    (layer,) = moe_layers(module)
    return {"knobs": (layer.aux_loss_coef, layer.experts.capacity_factor, layer.random_routing_steps),
            "bias": layer.gate.expert_bias.clone(), "load": layer.load.clone()}


def test_the_moe_config_reaches_every_layer_and_the_bias_moves_each_step(tmp_path):
    (result,) = launch("tests.unit.test_moe_knobs:fit_with_knobs", 1, tmp_path, timeout=120)
    assert result["knobs"] == (0.03, 1.5, 1)
    bias = result["bias"]
    assert bias.abs().sum() > 0 and bias.abs().max() <= 3 * RATE + 1e-6  # 3 steps of at most RATE each
    torch.testing.assert_close(bias / RATE, (bias / RATE).round())  # whole steps of the rate
    assert not result["load"].any()  # reset after each update
