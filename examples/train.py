"""Train a small model under any parallel layout, with Hydra configs from ``conf/``.

    python examples/train.py parallel=fsdp_tp trainer.devices=4 trainer.max_steps=20
    python examples/train.py parallel=hsdp model=gpt trainer.devices=4
    python examples/train.py -m parallel=fsdp,fsdp_tp,hsdp trainer.devices=4 trainer.max_steps=20
    python examples/train.py parallel=fsdp trainer.devices=4 ckpt_path=outputs/<date>/<time>/checkpoints/last.ckpt

TensorBoard logs land in Hydra's run directory (``outputs/<date>/<time>/tensorboard``):
``tensorboard --logdir outputs``; checkpoints in its ``checkpoints/`` (``last.ckpt`` links the newest), and
``ckpt_path=`` resumes from one under any layout. Every key is typed (`examples/schema.py`): ``parallel.tp_sise=2``
fails before anything starts, naming the key. ``diagnostics=off|default|full`` picks the monitors.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diagnostics import LayoutCard, all_monitors  # noqa: E402
from examples.data import TokenDataModule  # noqa: E402
from examples.lit import CausalLM  # noqa: E402
from examples.models.gpt import GPT, GPTConfig  # noqa: E402
from examples.models.llama import Llama, LlamaConfig  # noqa: E402
from examples.schema import register  # noqa: E402
from lightning_nd import NDParallel  # noqa: E402

MODELS = {"llama": (Llama, LlamaConfig), "gpt": (GPT, GPTConfig)}


def model_factory(model_cfg: DictConfig):
    options = OmegaConf.to_container(model_cfg, resolve=True)
    name = options.pop("name")
    if name not in MODELS:
        raise ValueError(f"Unknown `model.name={name!r}`. HINT: choose from {sorted(MODELS)}.")
    model_cls, config_cls = MODELS[name]
    return lambda: model_cls(config_cls(**options))


register()  # conf/'s typed schemas: a typo or a wrong type fails at composition, naming the key


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    seed_everything(cfg.seed, workers=True)
    strategy = NDParallel.from_config(OmegaConf.to_container(cfg.parallel, resolve=True))
    logger = TensorBoardLogger(save_dir=cfg.log_dir, name="", version="")
    checkpoints = ModelCheckpoint(**OmegaConf.to_container(cfg.checkpoint, resolve=True))
    d = cfg.diagnostics
    monitors = all_monitors(
        log_dir=cfg.log_dir, collectives=d.collectives and {"distributed_debug": d.distributed_debug,
                                                             "log_every_n_steps": d.collectives_every_n_steps},
        memory=d.memory and {"log_every_n_steps": d.memory_every_n_steps},
        bottleneck=d.bottleneck and {"every_n_steps": d.bottleneck_every_n_steps},
        routing=d.routing and {"every_n_steps": d.routing_every_n_steps}) if d.enabled else [LayoutCard()]
    trainer = Trainer(**OmegaConf.to_container(cfg.trainer, resolve=True), strategy=strategy, logger=logger,
                      callbacks=[checkpoints, *monitors])
    module = CausalLM(model_factory=model_factory(cfg.model), lr=cfg.lr)
    trainer.fit(module, datamodule=TokenDataModule(**OmegaConf.to_container(cfg.data, resolve=True)),
                ckpt_path=cfg.ckpt_path)
    return float(trainer.callback_metrics["train_loss"])


if __name__ == "__main__":
    main()
