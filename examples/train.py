"""Train a small model under any parallel layout, with Hydra configs from ``conf/``.

    python examples/train.py parallel=fsdp_tp trainer.devices=4 trainer.max_steps=20
    python examples/train.py parallel=hsdp model=gpt trainer.devices=4
    python examples/train.py -m parallel=fsdp,fsdp_tp,hsdp trainer.devices=4 trainer.max_steps=20
    python examples/train.py parallel=fsdp trainer.devices=4 ckpt_path=outputs/<date>/<time>/checkpoints/last.ckpt
    torchrun --nproc-per-node=4 --max-restarts=3 examples/train.py parallel=fsdp_tp
    python examples/train.py -m parallel=search trainer.devices=4 --budget 3

A sweep (``-m``) ends with one comparison table of its runs (`diagnostics.CompareSweep`, also
``python -m diagnostics compare multirun/<date>/<time>``): a run that fails is recorded as a row (refused, out of
memory, hang, crash) and the sweep goes on. ``parallel=search`` asks the planner for the layouts to measure
(`examples/search.py`).

TensorBoard logs land in the run directory (``outputs/<date>/<time>/tensorboard``; under torchrun
``outputs/torchrun-<run id>``, under SLURM ``outputs/slurm-<job id>``: the same folder for every restart of a job):
``tensorboard --logdir outputs``; checkpoints in its ``checkpoints/`` (``last.ckpt`` links the newest). ``ckpt_path``
defaults to ``auto``: a restarted or requeued job resumes from its newest complete checkpoint; ``ckpt_path=PATH``
resumes from one under any layout, ``ckpt_path=null`` starts fresh. Every key is typed (`examples/schema.py`): ``parallel.tp_sise=2``
fails before anything starts, naming the key. ``diagnostics=off|default|full`` picks the monitors.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diagnostics import LayoutCard, RunSummary, all_monitors
from diagnostics.callbacks.sweep_comparison import first_process
from examples.data import TokenDataModule
from examples.lit import CausalLM
from examples.models.gpt import GPT, GPTConfig
from examples.models.llama import Llama, LlamaConfig
from examples.progress_bar import progress_bars
from examples.schema import register
from examples.search import run_search
from lightning_nd import NDParallel
from lightning_nd.planner.pricing import is_preset

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
    hydra_config = HydraConfig.get()
    overrides = list(hydra_config.overrides.task)
    summary = RunSummary(log_dir=cfg.log_dir, overrides=overrides, **prices(cfg.diagnostics.profile))
    try:
        if cfg.search.enabled:  # Lightning's other ranks of an earlier job run the sweep too: one searches
            return run_search(cfg, overrides, Path(hydra_config.runtime.output_dir), model_factory) if (
                first_process()) else float("nan")
        seed_everything(cfg.seed, workers=True)
        strategy = NDParallel.from_config(OmegaConf.to_container(cfg.parallel, resolve=True))
        logger = TensorBoardLogger(save_dir=cfg.log_dir, name="", version="")
        checkpoints = ModelCheckpoint(**OmegaConf.to_container(cfg.checkpoint, resolve=True))
        # The run folder is the root: a SLURM requeue's `hpc_ckpt_<N>` lands beside `checkpoints/`, where
        # `ckpt_path=auto` looks.
        options = OmegaConf.to_container(cfg.trainer, resolve=True)
        options["default_root_dir"] = options.get("default_root_dir") or hydra_config.runtime.output_dir
        if os.environ.get("GROUP_WORLD_SIZE"):  # torchrun: the nodes its agents met with, which an elastic run changes
            options["num_nodes"] = int(os.environ["GROUP_WORLD_SIZE"])
        bars = progress_bars(options.get("enable_progress_bar") is not False)
        trainer = Trainer(**options, strategy=strategy, logger=logger,
                          callbacks=[checkpoints, *bars, *monitors(cfg, summary)])
        module = CausalLM(model_factory=model_factory(cfg.model), lr=cfg.lr)
        trainer.fit(module, datamodule=TokenDataModule(**OmegaConf.to_container(cfg.data, resolve=True)),
                    ckpt_path=cfg.ckpt_path)
        return float(trainer.callback_metrics["train_loss"])
    except Exception as error:
        if not cfg.search.enabled and first_process() and not summary.recorded:
            summary.write_failure(error)  # before fit (refused when built): fit's own failures it records itself
        if hydra_config.mode != RunMode.MULTIRUN:
            raise
        # Lightning's other ranks run the same sweep in step with this process (its launcher starts them with
        # the sweep's arguments once): each goes on to the next job too.
        logging.getLogger(__name__).exception("This run failed; the sweep goes on (its row says why)")
        return float("nan")


def monitors(cfg: DictConfig, summary: RunSummary) -> list:
    d = cfg.diagnostics
    if not d.enabled:
        return [LayoutCard(), summary]
    return all_monitors(
        log_dir=cfg.log_dir, collectives=d.collectives and {"distributed_debug": d.distributed_debug,
                                                             "log_every_n_steps": d.collectives_every_n_steps},
        memory=d.memory and {"log_every_n_steps": d.memory_every_n_steps},
        bottleneck=d.bottleneck and {"every_n_steps": d.bottleneck_every_n_steps},
        routing=d.routing and {"every_n_steps": d.routing_every_n_steps}, summary=False) + [summary]


def prices(profile: str | None) -> dict[str, str]:
    """`RunSummary`'s keyword for ``diagnostics.profile``: a preset name, or a profile file."""
    if profile is None:
        return {}
    return {"hardware": profile} if is_preset(profile) else {"profile": profile}


def budget_flag(argv: list[str]) -> list[str]:
    """``--budget K`` (or ``--budget=K``) as Hydra's ``search.budget=K``."""
    out, words = [], iter(argv)
    for word in words:
        if word == "--budget":
            out.append(f"search.budget={next(words, '')}")
        elif word.startswith("--budget="):
            out.append(f"search.budget={word.split('=', 1)[1]}")
        else:
            out.append(word)
    return out


if __name__ == "__main__":
    sys.argv = budget_flag(sys.argv)
    main()
